"""Metric math on recorded event streams (exact values), workloads and arrivals."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from loadtest.metrics import SLO, RequestRecord, compute_metrics, percentile
from loadtest.workloads import (
    arrival_times,
    random_workload,
    shared_prefix_workload,
    trace_workload,
)


def recorded() -> list[RequestRecord]:
    # a: sent at 0, tokens at 0.1, 0.2, 0.4 (one message each) -> 3 output tokens
    a = RequestRecord(sent=0.0, prompt_tokens=10, token_times=[0.1, 0.2, 0.4],
                      output_tokens=3, cached_tokens=4)
    # b: sent at 1, first message at 1.5 carries 1 token, second at 2.0 carries 2 tokens
    b = RequestRecord(sent=1.0, prompt_tokens=20, token_times=[1.5, 2.0], output_tokens=3)
    c = RequestRecord(sent=2.0, prompt_tokens=5, error="UNAVAILABLE: worker died")
    return [a, b, c]


def test_vllm_definitions_on_a_recorded_stream() -> None:
    m = compute_metrics(recorded(), duration_s=4.0, slo=SLO(ttft_ms=200, tpot_ms=200))
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 6)
    assert m["request_throughput"] == 0.5 and m["output_throughput"] == 1.5
    assert m["total_token_throughput"] == 9.0
    assert m["cached_token_ratio"] == pytest.approx(4 / 30)
    # TTFT 100 and 500 ms; E2EL 400 and 1000 ms
    assert m["mean_ttft_ms"] == pytest.approx(300) and m["median_ttft_ms"] == pytest.approx(300)
    assert m["p99_ttft_ms"] == pytest.approx(100 + 400 * 0.99)
    assert m["mean_e2el_ms"] == pytest.approx(700)
    # TPOT: a (400-100)/2 = 150 ms; b (1000-500)/2 = 250 ms
    assert m["mean_tpot_ms"] == pytest.approx(200) and m["p90_tpot_ms"] == pytest.approx(240)
    # ITL gaps: a 100, 200; b 500 (a two-token message is one gap)
    assert m["mean_itl_ms"] == pytest.approx(800 / 3)
    assert m["median_itl_ms"] == pytest.approx(200)
    assert m["std_itl_ms"] == pytest.approx(statistics.pstdev([100, 200, 500]))
    # goodput: only a meets TTFT <= 200 ms and TPOT <= 200 ms
    assert m["request_goodput"] == 0.25 and m["goodput_fraction"] == pytest.approx(1 / 3)


def test_percentile_is_numpys_linear_interpolation() -> None:
    v = [1.0, 2.0, 3.0, 4.0]
    assert [percentile(v, p) for p in (0, 50, 90, 100)] == pytest.approx([1, 2.5, 3.7, 4])
    assert percentile([], 50) == 0.0
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError, match=r"\[0, 100\].*got 101"):
        percentile(v, 101)


def test_the_benchmarks_use_the_load_tests_percentile() -> None:
    """One percentile in the project: bench-router and bench-routing report with the
    interpolation the load-test reports (and vllm bench serve) use."""
    import benchmarks.router
    import benchmarks.routing

    assert benchmarks.router.percentile is percentile
    assert benchmarks.routing.percentile is percentile


def test_single_token_requests_have_no_tpot_and_empty_runs_report_zeros() -> None:
    one = RequestRecord(sent=0.0, prompt_tokens=3, token_times=[0.05], output_tokens=1)
    m = compute_metrics([one], 1.0)
    assert m["mean_tpot_ms"] == 0.0 and m["mean_itl_ms"] == 0.0
    assert m["mean_ttft_ms"] == pytest.approx(50)
    empty = compute_metrics([], 1.0)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] == 0.0


def test_workloads_are_seeded_and_shaped() -> None:
    a = random_workload(20, 100, 10, range_ratio=0.5, seed=3)
    assert a == random_workload(20, 100, 10, range_ratio=0.5, seed=3)
    assert all(50 <= len(r.prompt) <= 150 and 5 <= r.output_len <= 15 for r in a)
    s = shared_prefix_workload(12, groups=3, prefix_len=40, input_len=8, output_len=4)
    assert len({tuple(r.prompt[:40]) for r in s}) <= 3
    assert all(len(r.prompt) == 48 for r in s)


def test_trace_replay_keeps_timestamps_and_prefix_groups(tmp_path) -> None:
    rows = [{"timestamp": 0.0, "input_length": 30, "output_length": 5, "prefix_group": "x"},
            {"timestamp": 0.5, "input_length": 40, "output_length": 6, "prefix_group": "x"},
            {"timestamp": 0.7, "input_length": 10, "output_length": 2}]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    t = trace_workload(path)
    assert [r.at for r in t] == [0.0, 0.5, 0.7] and [len(r.prompt) for r in t] == [30, 40, 10]
    assert t[0].prompt[:15] == t[1].prompt[:15]  # half the group's shortest input


def test_arrivals_poisson_gamma_and_infinite() -> None:
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    t = arrival_times(4000, rate=10.0, burstiness=1.0, seed=1)
    gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.05)
    bursty = arrival_times(4000, rate=10.0, burstiness=0.25, seed=1)
    bgaps = [b - a for a, b in zip(bursty, bursty[1:], strict=False)]
    assert statistics.fmean(bgaps) == pytest.approx(0.1, rel=0.1)
    assert statistics.pstdev(bgaps) > 1.5 * statistics.pstdev(gaps)  # cv 2 vs 1
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


def test_mixed_and_multi_turn_workloads() -> None:
    from loadtest.runner import group_sessions
    from loadtest.workloads import mixed_workload, multi_turn_workload

    mixed = mixed_workload(200, 100, 50, 0.25, 1000, 10, seed=3)
    long = [r for r in mixed if len(r.prompt) == 1000]
    assert 30 < len(long) < 70 and all(r.output_len == 10 for r in long)
    assert all(len(r.prompt) == 100 and r.output_len == 50 for r in mixed if r not in long)
    assert mixed == mixed_workload(200, 100, 50, 0.25, 1000, 10, seed=3)
    turns = multi_turn_workload(2, 3, 8, 4, seed=1)
    assert [r.conversation for r in turns] == [0, 0, 0, 1, 1, 1]
    assert [len(r.prompt) for r in turns[:3]] == [8, 8 + 4 + 8, 8 + 4 + 8 + 4 + 8]
    assert turns[1].prompt[:8] == turns[0].prompt and turns[2].prompt[:20] == turns[1].prompt
    sessions = group_sessions(turns + mixed[:2])
    assert [len(s) for s in sessions] == [3, 3, 1, 1]


def test_run_plot_and_compare_write_pngs_and_ratios(tmp_path) -> None:
    import json

    from loadtest.plots import compare, plot_run, plot_sweeps

    def result(scale: float) -> dict:
        token_times = [[0.1 * scale + 0.05 * k for k in range(5)] for _ in range(4)]
        return {"completed": 4, "request_throughput": 2.0 / scale, "output_throughput": 10.0,
                "median_ttft_ms": 100.0 * scale, "p99_itl_ms": 50.0 * scale,
                "details": {"ttfts": [0.1 * scale] * 4, "tpots": [0.05] * 4,
                            "itls": [0.05] * 16, "e2els": [0.3] * 4, "sent": [0.0] * 4,
                            "token_times": token_times, "output_tokens": [5] * 4,
                            "queue": []}}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(result(1.0)))
    b.write_text(json.dumps(result(2.0)))
    assert plot_run(result(1.0), tmp_path / "a.png").stat().st_size > 10_000
    png, table = compare([str(a), str(b)], tmp_path / "cmp.png")
    assert png.stat().st_size > 10_000
    assert "median_ttft_ms" in table and "(2.00x)" in table and "(0.50x)" in table
    sweep = [{"request_rate": r, "request_throughput": r, "p99_itl_ms": 10.0,
              "p99_tpot_ms": 5.0, "p99_ttft_ms": 100.0} for r in (1.0, 2.0)]
    assert plot_sweeps({"s": sweep}, tmp_path / "s.png").stat().st_size > 10_000
