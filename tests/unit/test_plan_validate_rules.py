"""benchmarks.plan_validate's pure rules: the offered rate, a candidate's simulated
capacity and load, and which bounds judge which row (latency only below saturation).
No cluster is started: the capacity comes from the simulator on a synthetic profile."""

from __future__ import annotations

import math

import pytest

from benchmarks.plan_validate import Bounds, capacity, judged_latency, offered_rate, verdict
from loadtest.workloads import random_workload
from planner.config import PoolConfig
from planner.predict import run
from planner.synthetic import synthetic_profile
from planner.workload import ExplicitWorkload

PROFILE = synthetic_profile("cpu")
TWO_MIXED = PoolConfig("mixed", mixed_workers=2, mixed_threads=1)
ONE_MIXED = PoolConfig("mixed", mixed_workers=1, mixed_threads=1)


def _row(load: float | None, ttft: float = 0.0, itl: float = 0.0, goodput: float = 0.0
         ) -> dict:
    row = {"config": "c", "error": {"ttft_p90_ms": ttft, "itl_p90_ms": itl,
                                    "goodput": goodput}}
    if load is not None:
        row["load"] = load
    return row


def _summary(*rows: dict) -> dict:
    return {"regret": 0.0, "rows": list(rows)}


def test_the_offered_rate_is_sessions_over_the_arrivals_span() -> None:
    assert offered_rate([0.0, 1.0, 2.0, 3.0, 4.0]) == pytest.approx(1.0)
    assert offered_rate([10.0, 10.5]) == pytest.approx(2.0)
    assert offered_rate([0.0, 0.0, 0.0]) == math.inf  # a burst
    assert offered_rate([3.0]) == math.inf


def test_capacity_is_the_sessions_a_burst_serves_per_second_and_grows_with_workers() -> None:
    requests = random_workload(24, 128, 32, 0.0, seed=3)
    work = ExplicitWorkload(requests, [0.0] * len(requests))
    two, one = capacity(PROFILE, TWO_MIXED, work), capacity(PROFILE, ONE_MIXED, work)
    burst = run(PROFILE, TWO_MIXED, requests, [0.0] * len(requests))
    assert two == pytest.approx(len(requests) / burst.duration_s)
    assert 1.5 * one < two < 2.5 * one


def test_latency_errors_are_judged_only_below_saturation() -> None:
    b = Bounds(regret=0.05, latency_error=0.10, goodput_error=0.05, saturation=0.85)
    assert judged_latency(_row(0.5), b) and not judged_latency(_row(0.9), b)
    assert judged_latency(_row(None), b)  # saved before loads were recorded: judged
    assert verdict(_summary(_row(0.9, ttft=-0.6, itl=0.4)), b) == []
    broken = verdict(_summary(_row(0.5, ttft=-0.2, itl=0.05)), b)
    assert len(broken) == 1 and "ttft_p90_ms off by -20%" in broken[0]


def test_goodput_and_regret_are_judged_at_any_load() -> None:
    b = Bounds(saturation=0.85)
    assert any("goodput" in v for v in verdict(_summary(_row(1.2, goodput=0.2)), b))
    assert any("regret" in v for v in verdict({"regret": 0.2, "rows": [_row(0.3)]}, b))
