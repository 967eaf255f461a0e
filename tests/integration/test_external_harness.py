"""``pdserve bench-harness`` on a tiny cluster: pdserve bench, guidellm and aiperf drive
the same server with the same workload, and their figures must agree.

guidellm and aiperf are not pdserve's dependencies: set ``PDSERVE_GUIDELLM`` and
``PDSERVE_AIPERF`` to their executables (each in a venv of its own) or put them on
``PATH``; with neither found this test skips and says so. When found, each must finish
every request with exactly the output tokens asked for, and its throughput must lie
within 3x of pdserve bench's runs beside it: a parser reading the wrong field or unit
is off by far more. The worker gets one thread so the tools have a core of their own
(with both cores, aiperf's processes slowed the tiny server several-fold).
"""

from __future__ import annotations

import json
import os

import pytest
from cluster_helpers import assert_cluster_idle, start

from benchmarks.external_harness import PDSERVE, HarnessOptions, run
from benchmarks.external_tools import ENV_VARS, Workload, locate

FACTOR = 3.0
WORKLOAD = Workload(num_requests=16, input_len=32, output_len=32, max_concurrency=2)
"""Long enough (~0.5 s a run here) that one stall of a shared machine does not halve a
throughput."""


def _found() -> dict[str, str]:
    found = {}
    for name in ("guidellm", "aiperf"):
        exe, _ = locate(name, os.environ.get(ENV_VARS[name]), ENV_VARS[name])
        if exe:
            found[name] = exe
    return found


def test_external_harnesses_agree_with_pdserve_bench(request, tmp_path) -> None:
    tools = _found()
    if not tools:
        pytest.skip("neither guidellm nor aiperf found: set PDSERVE_GUIDELLM / "
                    "PDSERVE_AIPERF to their executables or put them on PATH")
    model = request.getfixturevalue("tiny_checkpoints")["llama"]
    c = start(model, tmp_path / "logs", threads_per_worker=1)
    try:
        result = run(HarnessOptions(WORKLOAD, target=c.http_url, tokenizer=str(model),
                                    tools=dict(tools), work_dir=str(tmp_path / "work"),
                                    out=str(tmp_path / "harness.json")))
        assert_cluster_idle(c)
    finally:
        c.stop()

    runs = {r["harness"]: r for r in result["runs"]}
    ours = [r for name, r in runs.items() if name.startswith(PDSERVE)]
    assert len(ours) == len(tools) + 1, list(runs)  # one before, one after each tool
    for name, r in runs.items():
        assert r["error"] is None and r["skipped"] is None, (name, r["error"], r["skipped"])
        f = r["figures"]
        assert (f["completed"], f["failed"]) == (WORKLOAD.num_requests, 0), (name, f)
        assert f["mean_output_tokens"] == WORKLOAD.output_len, (name, f)
        # prompts of text are cut by the tokenizer, re-tokenized by the server
        assert abs(f["mean_input_tokens"] - WORKLOAD.input_len) <= 2, (name, f)
        assert min(f["ttft_p50_ms"], f["tpot_p50_ms"], f["e2el_p50_ms"]) > 0, (name, f)
        assert f["ttft_p50_ms"] <= f["e2el_p50_ms"], (name, f)
    for name in tools:
        tool = runs[name]
        assert len(tool["baseline"]) == 2, tool["baseline"]
        q = tool["ratio"]["output_throughput"]
        assert 1 / FACTOR <= q <= FACTOR, (
            f"{name}: {tool['figures']['output_throughput']:.1f} output tok/s, {q:.2f}x "
            f"pdserve bench's beside it ({', '.join(tool['baseline'])}); see "
            f"{tmp_path / 'work' / name / 'tool.log'}")
    assert (tmp_path / "harness.json").exists()


def _pct(p50: float, p90: float) -> dict:
    return {"p50": p50, "p90": p90}


def test_parsers_and_table_without_the_tools(tmp_path) -> None:
    """What CI can check without guidellm or aiperf: each parser reads a minimal output
    of the shape its tool writes (the fields the real runs above read), the ratios
    take the pdserve bench runs on either side, and the table says why a tool is
    missing."""
    from benchmarks.external_harness import HarnessRun, ratios, table
    from benchmarks.external_tools import TOOLS, Figures

    def ok(**kw: object) -> dict:
        return {"successful": kw}

    (tmp_path / "guidellm.json").write_text(json.dumps({
        "metadata": {"guidellm_version": "0.8.1"},
        "benchmarks": [{"duration": 2.0, "metrics": {
            "request_totals": {"successful": 8, "errored": 0, "incomplete": 0},
            "output_tokens_per_second": ok(mean=64.0),
            "prompt_token_count": ok(mean=32.0), "output_token_count": ok(mean=16.0),
            "time_to_first_token_ms": ok(percentiles=_pct(20.0, 30.0)),
            "inter_token_latency_ms": ok(percentiles=_pct(2.0, 3.0)),
            "request_latency": ok(percentiles=_pct(0.05, 0.06))}}]}))
    (tmp_path / "aiperf").mkdir()
    (tmp_path / "aiperf" / "profile_export_aiperf.json").write_text(json.dumps({
        "aiperf_version": "0.13.0", "error_summary": [{"error_details": {}, "count": 1}],
        "request_count": {"avg": 7.0}, "benchmark_duration": {"avg": 2.0},
        "output_token_throughput": {"avg": 56.0}, "input_sequence_length": {"avg": 32.0},
        "output_sequence_length": {"avg": 16.0},
        "time_to_first_token": _pct(20.0, 30.0), "inter_token_latency": _pct(2.0, 3.0),
        "request_latency": _pct(50.0, 60.0)}))
    g, g_version = TOOLS["guidellm"].parse(tmp_path)
    a, a_version = TOOLS["aiperf"].parse(tmp_path)
    assert (g_version, a_version) == ("0.8.1", "0.13.0")
    assert g == Figures(8, 0, 2.0, 64.0, 32.0, 16.0, 20.0, 30.0, 2.0, 50.0)
    assert (a.completed, a.failed, a.output_throughput, a.e2el_p50_ms) == (7, 1, 56.0, 50.0)
    with pytest.raises(ValueError, match="not aiperf"):
        (tmp_path / "aiperf" / "profile_export_aiperf.json").write_text("{}")
        TOOLS["aiperf"].parse(tmp_path)

    ours = [HarnessRun(f"{PDSERVE} #{i}", Figures(8, 0, 2.0, tps, 32.0, 16.0, 20.0, 30.0,
                                                  2.0, 50.0)) for i, tps in ((1, 60.0),
                                                                              (2, 68.0))]
    runs = [ours[0], HarnessRun("guidellm", g), ours[1],
            HarnessRun("aiperf", skipped="aiperf not found")]
    ratios(runs)
    assert runs[1].baseline == [f"{PDSERVE} #1", f"{PDSERVE} #2"]
    assert runs[1].ratio["output_throughput"] == pytest.approx(1.0)
    text = table(runs)
    assert "64.0 (1.00x)" in text and "skipped: aiperf not found" in text
