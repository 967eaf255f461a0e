"""``pdserve plan --validate`` in small, on the default model: profile this machine
(quick grid, one thread), predict two candidates of a long-prompt mix on 2 cores, run
both for real with the same requests, and hold the loop to bounds: both configurations
measured, no request failed, the decision's regret and each candidate's prediction
errors within :data:`CI_BOUNDS`.

Those bounds are the CI's, wider than the benchmark's (the issue's 5% regret, 10%
latency and 5% goodput: ``pdserve plan --validate``, README), because this is timing on
a shared box. Measured on a 2-vCPU AMD EPYC (2026-12-07), this test's workload at about
half of the calibrated capacity: three runs alone, regret 0%, goodput within 8%, TTFT
p90 within 8%, ITL p90 over-predicted 4-29%; with a busy loop on one of the two cores
throughout, load 0.8, regret 10%, goodput -11%, ITL p90 +58%. The same at 0.9 of
capacity (the earlier rate): regret 0-0.1% alone, 42% beside the busy loop (the plan,
made before the runs on the saved profile, saw 0.9 where the runs measured 1.3, and
there the split served 1.7x two mixed workers). So the bounds catch a simulator that is
wrong (a latency off by a factor of two either way, a goodput by a third, a decision
that loses half), not a noisy minute; and a validation that breaks one is run once more,
which a neighbour that came and went does not break again and a wrong simulator does."""

from __future__ import annotations

import math
import os

import pytest

from benchmarks.plan_validate import Bounds, ValidateOptions, validate
from benchmarks.profile import ProfileOptions, run_profile
from benchmarks.profile_steps import StepGrid
from common.cost_model import save_profile
from loadtest.metrics import SLO
from loadtest.workloads import arrival_times, mixed_workload
from planner.config import PoolConfig
from planner.predict import simulate
from planner.workload import ExplicitWorkload

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    (os.cpu_count() or 1) < 2, reason="plans and runs 2-core configurations")]

COLOCATED = PoolConfig("mixed", mixed_workers=2, mixed_threads=1)
SPLIT_LABEL = "1P x1t + 1D x1t, local < 256"
GRID = StepGrid(prefill_new=(16, 64, 256, 512, 768), prefill_cached=(0, 256),
                decode_batches=(1, 4, 8, 16), decode_contexts=(64, 512),
                mixed=((4, 128, 256), (8, 256, 64)), reps=2, decode_steps=2)
"""Shapes within this workload's (prompts up to ~900 tokens): ~20 s on 2 cores."""

CI_BOUNDS = Bounds(regret=0.5, latency_error=1.0, goodput_error=0.35, saturation=math.inf)
"""What the validation in CI fails on (the module's docstring says why so wide): latency
judged at any load, so that a slow minute cannot switch it off. The verdict bounds a
latency over-predicted by up to 2x the measured (+100%); :func:`broken` adds one
under-predicted to less than half of it."""


def broken(summary: dict) -> list[str]:
    """What broke a CI bound (empty: none): the verdict's, and a TTFT or ITL p90
    predicted at less than half the measured (the verdict's relative error cannot reach
    -100%, so its bound alone holds only an over-prediction)."""
    out = list(summary["verdict"])
    for row in summary["rows"]:
        for key in ("ttft_p90_ms", "itl_p90_ms"):
            if row["error"][key] < -0.5:
                out.append(f"{row['config']}: {key} predicted {row['error'][key]:+.0%} "
                           "of the measured (bound: half of it)")
    return out


def test_a_small_validation_stays_within_its_bounds(smollm2_path, tmp_path):
    profile, _ = run_profile(ProfileOptions(
        model=str(smollm2_path), threads=(1,), grid=GRID, transfer_max_bytes=8 * 2**20,
        transfer_reps=2, out=str(tmp_path / "profile.json")))
    # Not calibrated here as `pdserve profile` does: validate calibrates each candidate
    # in its own minute anyway, and a calibration is ~50 s of this box's two cores.
    save_profile(profile, tmp_path / "profile.json")
    requests = mixed_workload(12, 128, 48, 0.25, 640, 8, 0.2, seed=7)
    # A fifth of what the colocated pair can serve here, as the engine-only profile sees
    # it: about half of what the calibrated one says (the load asserted below).
    closed = simulate(profile, COLOCATED, requests, [0.0] * len(requests))
    rate = closed["request_throughput"] / 5
    arrivals = arrival_times(len(requests), rate, 1.0, seed=7)
    solo = simulate(profile, COLOCATED, requests[:1], [0.0])
    slo = SLO(4 * solo["ttft_p90_ms"] + 500, 3 * solo["tpot_p90_ms"] + 20)
    for attempt in (1, 2):  # once more where a bound broke (the docstring says why)
        summary = validate(ValidateOptions(
            model=str(smollm2_path), profile=str(tmp_path / "profile.json"),
            workload=ExplicitWorkload(requests, arrivals, f"mixed at {rate:.2f} req/s"),
            cores=2, slo_ttft_ms=slo.ttft_ms, slo_tpot_ms=slo.tpot_ms,
            configs=(COLOCATED.label, SPLIT_LABEL), thresholds=(256,), bounds=CI_BOUNDS,
            out=str(tmp_path / f"validate-{attempt}"),
            served_after_s=arrivals[len(arrivals) // 2]), profile)
        if not broken(summary):
            break
    assert {r["config"] for r in summary["rows"]} == {COLOCATED.label, SPLIT_LABEL}
    assert all(r["failed"] == 0 for r in summary["rows"])
    for r in summary["rows"]:  # each candidate predicted with the calibration of its minute
        cal = r["serving"]
        assert cal["factor"] > 0 and cal["compute_factor"] > 0 and cal["per_seq_ms"] >= 0, r
        assert [(w["kind"], w["batch"]) for w in cal["waves"]] == [
            ("decode", 2), ("decode", 8), ("prefill", 1)], r
        # ... and its workers' traced steps against that calibration, per role
        roles = {"mixed"} if r["config"] == COLOCATED.label else {"prefill", "decode"}
        assert set(r["step_speed"]) == roles, r
        for speed in r["step_speed"].values():
            assert speed["steps"] > 0 and math.isfinite(speed["drift"]), r
            assert 0.2 < speed["median_ratio"] < 5, r  # the served model, not off by orders
        assert 0 < r["load"] < 2, r  # offered over simulated capacity (~0.55 here)
    split = next(r for r in summary["rows"] if r["config"] == SPLIT_LABEL)
    # The static rule goes by prompt length alone: the simulator's copy of the placement
    # and the router's must agree prompt for prompt (the short ones stay local); a prompt
    # moved to the decode worker after a prefill worker stalled on this shared box is
    # counted apart (``fallback``).
    local = split["local_prefills"]
    assert local["measured"] == local["predicted"] == sum(
        len(r.prompt) < 256 for r in requests), local
    assert 0 <= local["fallback"] <= local["requests"] - local["measured"], local
    for r in summary["rows"]:  # the later half, predicted from the steps served before
        window = r["served_window"]
        # (sent when due, so the half after the cut, give or take one at the boundary)
        assert abs(window["requests"] - (len(requests) - len(requests) // 2)) <= 1, window
        assert all(v >= 0 and math.isfinite(v) for v in window["measured"].values()), window
        assert set(window["error_waves"]) == {"ttft_p90_ms", "itl_p90_ms", "goodput"}
        assert window["fit"] or window["refused"].endswith("needs 100"), window
        if window["fit"]:
            assert all(math.isfinite(e) for e in window["error"].values()), window
    assert summary["recommended"] in {COLOCATED.label, SPLIT_LABEL}, summary
    assert not broken(summary), broken(summary)  # the regret among them (None: 0 goodput)
