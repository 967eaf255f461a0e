"""The metrics catalog and its Prometheus text: names, labels, counters by delta."""

from __future__ import annotations

from types import SimpleNamespace

from common.metrics import CATALOG, Metrics
from workers.engine_loop import EngineCounters, EngineLoad
from workers.metrics import WorkerMetrics
from workers.transfer import ChannelStats
from workers.transfer.state import TransferState

IDLE = {s.value: 0 for s in TransferState}


def sample(text: str, line_start: str) -> float:
    [line] = [x for x in text.splitlines() if x.startswith(line_start)]
    return float(line.rsplit(" ", 1)[1])


def test_names_follow_vllm_and_every_spec_is_exported() -> None:
    m = Metrics({"model": "m"})
    text = m.text()
    for spec in CATALOG:
        assert f"# TYPE pdserve:{spec.name}" in text or \
            f"# TYPE pdserve:{spec.name.removesuffix('_total')}" in text
    assert {"time_to_first_token_seconds", "num_requests_running", "kv_cache_usage_perc",
            "prefix_cache_hits_total", "routing_decisions_total"} <= {s.name for s in CATALOG}


def test_records_with_constant_and_call_labels() -> None:
    m = Metrics({"model": "m", "role": "decode"})
    m.inc("requests_total", status="OK")
    m.inc("requests_total", 2, status="OK")
    m.set("kv_cache_usage_perc", 0.25)
    m.observe("time_to_first_token_seconds", 0.03)
    m.inc("routing_decisions_total", 0, policy="cache_aware", reason="cache")  # appears at 0
    m.inc("requests_total", -1, status="OK")  # counters never go down
    text = m.text()
    assert sample(text, 'pdserve:requests_total{model="m",role="decode",status="OK"}') == 3
    assert sample(text, 'pdserve:kv_cache_usage_perc{model="m",role="decode"}') == 0.25
    assert sample(text, 'pdserve:time_to_first_token_seconds_bucket{le="0.04"') == 1
    assert sample(text, 'pdserve:time_to_first_token_seconds_bucket{le="0.02"') == 0
    assert sample(text, 'pdserve:routing_decisions_total{model="m",policy="cache_aware"') == 0


def test_worker_sampler_turns_totals_into_counter_increments() -> None:
    counters = EngineCounters()
    load = EngineLoad(running=2, waiting=1, free_blocks=75, total_blocks=100, reserved=3)
    loop = SimpleNamespace(load=lambda: load, counters=counters)
    stats = ChannelStats({"done": 4, "failed": 1}, IDLE, bytes_moved=1000, pairs_open=1,
                         busy_s=0.5)
    m = Metrics({"role": "prefill"})
    sampler = WorkerMetrics(m, loop, lambda: stats)  # type: ignore[arg-type]
    counters.generation_tokens, counters.prompt_tokens, counters.cached_prompt_tokens = 10, 64, 32
    counters.finished["stop"] = 2
    counters.forward_s, counters.forward_cpu_s, counters.thread_cpu_s = 2.0, 1.5, 2.5
    sampler.sample()
    counters.generation_tokens += 5
    counters.finished["stop"] += 1
    stats = ChannelStats({"done": 6, "failed": 1}, IDLE, bytes_moved=3000, pairs_open=1,
                         busy_s=1.0, refused={"bad_mac": 2, "replay": 1}, checksum_failures=1)
    sampler._transfer_stats = lambda: stats  # noqa: SLF001 - the next snapshot
    sampler.sample()
    text = m.text()
    assert sample(text, 'pdserve:engine_generation_tokens_total{role="prefill"}') == 15
    assert sample(text, 'pdserve:engine_forward_seconds_total{role="prefill"}') == 2.0
    assert sample(text, 'pdserve:engine_forward_cpu_seconds_total{role="prefill"}') == 1.5
    assert sample(text, 'pdserve:engine_thread_cpu_seconds_total{role="prefill"}') == 2.5
    assert sample(text, 'pdserve:prefix_cache_hits_total{role="prefill"}') == 32
    assert sample(text, 'pdserve:engine_requests_finished_total{finished_reason="stop"') == 3
    assert sample(text, 'pdserve:kv_transfers_total{role="prefill",state="done"}') == 6
    assert sample(text, 'pdserve:kv_transfers_total{role="prefill",state="timed_out"}') == 0
    assert sample(text, 'pdserve:kv_transfer_bytes_total{role="prefill"}') == 3000
    assert sample(text, 'pdserve:kv_cache_usage_perc{role="prefill"}') == 0.25
    assert sample(text, 'pdserve:num_requests_reserved{role="prefill"}') == 3
    assert sample(text, 'pdserve:kv_transfer_refused_total{reason="bad_mac",role="prefill"}') == 2
    assert sample(text, 'pdserve:kv_transfer_checksum_failures_total{role="prefill"}') == 1


def test_grafana_dashboard_is_current_and_queries_only_catalog_metrics() -> None:
    import importlib.util
    import json
    import re
    from pathlib import Path

    path = Path(__file__).parents[2] / "deploy" / "grafana" / "make_dashboard.py"
    spec = importlib.util.spec_from_file_location("make_dashboard", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    assert mod.OUT.read_text() == mod.render(), "run python deploy/grafana/make_dashboard.py"
    names = {s.name for s in CATALOG}
    exprs = [t["expr"] for p in json.loads(mod.OUT.read_text())["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"pdserve:(\w+)", e)}
    assert used and {u.removesuffix("_bucket") for u in used} <= names
