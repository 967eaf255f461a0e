"""``pdserve bench-routing --overhead-only``: the routing decision's cost, alone (a real
Redis, no model), reported per index and per phase against a Redis round trip."""

from __future__ import annotations

import json

import pytest

from benchmarks.routing import RoutingBenchOptions, run
from cluster.redis_server import find_redis_server


def test_overhead_only_times_each_phase_of_the_decision_without_a_model(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    if find_redis_server() is None:
        pytest.skip("no redis-server (the benchmark starts one)")
    out = tmp_path / "routing-overhead.json"
    result = run(RoutingBenchOptions(model="", workers=8, overhead_tokens=256,
                                     overhead_only=True, out=str(out)))
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    overhead = result["routing_overhead"]
    for scenario in ("typical", "worst"):
        t = overhead[scenario]
        assert 0 < t["p50_ms"] <= t["p99_ms"]
        assert t["hash_p50_ms"] > 0 and t["lookup_p50_ms"] > 0 and t["score_p50_ms"] > 0
    assert overhead["redis_round_trip"]["p50_ms"] > 0
    printed = capsys.readouterr().out
    assert "typical index: p50" in printed and "x a Redis round trip" in printed
    assert "policy" not in printed  # no cluster ran
