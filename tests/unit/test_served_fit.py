"""common.served_fit: the serving calibration refitted from served steps (the live
planner's): recovers the factors steps were drawn with, shrugs off stretched steps,
falls back to one factor where the steps cannot tell memory from compute, and refuses
what no machine's speed explains."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from common.cost_model import StepModel, StepSums, step_sums
from common.served_fit import (
    MIN_STEPS,
    ServedFitError,
    decode_table,
    fit_served,
    fit_served_roles,
)
from loadtest.workloads import Request
from planner.config import PoolConfig
from planner.predict import simulate
from planner.synthetic import synthetic_profile

# [1, T, (T-4)+, (T-16)+, (T-64)+, (T-256)+, (T-1024)+, [T>4], A_dec, A_fresh, A_pre, S]
ENGINE = StepModel((0.012, 0.002, 0.0, -0.0005, 0.0, 0.0, 0.0, 0.003, 2e-6, 1e-7, 2e-7,
                    2e-4), floor_s=0.01)


def served_steps(n: int, memory: float, compute: float, per_seq: float, seed: int = 0,
                 noise: float = 0.08, stretched: float = 0.0) -> list[tuple[float, StepSums]]:
    """``n`` steps of a mixed batch's shapes, timed as a worker serving at these factors
    would run them (log-normal spread of ``noise``; a share ``stretched`` of them 4x, a
    neighbour's burst)."""
    rng = random.Random(seed)
    served = ENGINE.scaled_parts(memory, compute).plus_per_sequence(per_seq)
    out = []
    for _ in range(n):
        kind = rng.random()
        decodes = [(1, rng.randint(40, 700)) for _ in range(rng.randint(1, 24))]
        chunks = ([(rng.randint(64, 1024), 0)] if kind < 0.15 else
                  [(rng.randint(16, 256), 0), *decodes] if kind < 0.3 else decodes)
        sums = step_sums(chunks)
        seconds = served.seconds(sums) * float(np.exp(rng.gauss(0.0, noise)))
        if rng.random() < stretched:
            seconds *= 4
        out.append((seconds, sums))
    return out


def test_recovers_the_factors_and_the_spread_of_served_steps() -> None:
    fit = fit_served(ENGINE, 1, served_steps(2000, 1.5, 0.9, 0.0005, stretched=0.05))
    assert fit.memory == pytest.approx(1.5, rel=0.04)
    assert fit.compute == pytest.approx(0.9, rel=0.04)
    assert fit.per_seq_s == pytest.approx(0.0005, abs=0.0002)
    assert fit.steps == 2000
    assert 0.03 < fit.deviation < 0.09  # the log-normal's median |ratio - 1|, not the bursts'
    spread = dict(fit.jitter)
    assert spread[0.5] == pytest.approx(1.0)
    assert spread[0.1] == pytest.approx(np.exp(-1.2816 * 0.08), rel=0.03)
    assert spread[0.995] > 3  # the bursts are in the spread, not in the factors
    assert fit.jitter_step_s is not None and 0.01 < fit.jitter_step_s < 0.2


def test_applied_to_a_profile_the_simulator_steps_at_the_fitted_speed() -> None:
    profile = synthetic_profile("cpu")
    profile = dataclasses.replace(profile, steps={**profile.steps, 1: ENGINE},
                                  serving={1: 3.0, 2: 1.7}, serving_compute={1: 3.0})
    fit = fit_served(ENGINE, 1, served_steps(600, 1.2, 1.1, 0.0, noise=0.0))
    now = fit.apply(profile)
    decode = step_sums([(1, 300)] * 8)
    assert now.step(1).seconds(decode) == pytest.approx(
        ENGINE.scaled_parts(1.2, 1.1).seconds(decode), rel=0.01)
    assert now.serving[2] == 1.7 and now.steps == profile.steps  # the rest as it was
    assert now.serving_jitter[1] and now.serving_jitter_step_s[1] == fit.jitter_step_s


def test_steps_all_of_one_shape_give_one_factor() -> None:
    sums = step_sums([(1, 200)] * 4)
    steps = [(ENGINE.seconds(sums) * 1.3 * (1 + 0.01 * (i % 7 - 3)), sums) for i in range(300)]
    fit = fit_served(ENGINE, 1, steps)
    assert fit.memory == fit.compute == pytest.approx(1.3, rel=0.01)
    assert fit.per_seq_s == 0.0


def test_a_negative_cost_per_sequence_is_never_fitted() -> None:
    fit = fit_served(ENGINE, 1, served_steps(800, 1.0, 1.0, -0.0004, noise=0.02))
    assert fit.per_seq_s == 0.0 and fit.memory > 0 and fit.compute > 0


def test_too_few_steps_or_factors_no_machine_explains_are_refused() -> None:
    with pytest.raises(ServedFitError, match=f"needs {MIN_STEPS}") as few:
        fit_served(ENGINE, 1, served_steps(MIN_STEPS - 1, 1.0, 1.0, 0.0))
    assert few.value.reason == "few_steps"  # the autoscaler logs once a kind
    with pytest.raises(ServedFitError, match="not this profile's engine") as far:
        fit_served(ENGINE, 1, served_steps(400, 12.0, 12.0, 0.0))
    assert far.value.reason == "out_of_range"


def test_each_role_gets_its_own_calibration_where_its_steps_make_one() -> None:
    """A prefill worker's steps also send their KV: its own factors, not the pool's; a
    role with too few steps for a fit takes the pooled factors, with the decode table of
    its own decode steps."""
    prefill = [("prefill", sec, sums) for sec, sums in served_steps(300, 1.0, 1.8, 0.0, 1)]
    decode = [("decode", sec, sums) for sec, sums in served_steps(300, 1.3, 1.0, 0.0, 2)]
    few = [("mixed", sec, sums) for sec, sums in served_steps(MIN_STEPS - 1, 3.0, 3.0, 0.0, 3)]
    fits = fit_served_roles(ENGINE, 1, prefill + decode + few)
    assert set(fits.roles) == {"prefill", "decode", "mixed"}
    assert fits.roles["prefill"].compute == pytest.approx(1.8, rel=0.05)
    assert fits.roles["decode"].memory == pytest.approx(1.3, rel=0.05)
    assert fits.pooled.steps == 300 + 300 + MIN_STEPS - 1
    mixed = fits.roles["mixed"]  # the pooled factors; its decodes 3x: in its table
    assert (mixed.memory, mixed.compute) == (fits.pooled.memory, fits.pooled.compute)
    assert min(mixed.decode_factors) > 1.8
    profile = synthetic_profile("cpu")
    profile = dataclasses.replace(profile, steps={**profile.steps, 1: ENGINE})
    now = fits.apply(profile)
    prompt = step_sums([(512, 0)])
    assert now.for_role("prefill").step(1).seconds(prompt) == pytest.approx(
        ENGINE.scaled_parts(fits.roles["prefill"].memory, fits.roles["prefill"].compute)
        .seconds(prompt), rel=1e-3)  # + its per-sequence cost, ~0
    assert now.for_role("mixed").step(1).seconds(prompt) == now.step(1).seconds(prompt)
    assert now.step(1).seconds(prompt) < now.for_role("prefill").step(1).seconds(prompt)


def test_the_simulator_steps_each_role_with_its_own_calibration() -> None:
    profile = synthetic_profile("cpu")
    split = PoolConfig("disaggregated", prefill_workers=1, decode_workers=1, prefill_threads=1,
                       decode_threads=1, local_prefill_threshold=0)
    requests = [Request(list(range(5, 1029)), 8)]
    base = simulate(profile, split, requests, [0.0])
    slow = dataclasses.replace(profile, by_role={
        "prefill": dataclasses.replace(profile, serving={1: 2.0}, serving_compute={1: 2.0})})
    got = simulate(slow, split, requests, [0.0])
    assert got["ttft_p90_ms"] == pytest.approx(2 * base["ttft_p90_ms"], rel=0.1)
    assert got["tpot_p90_ms"] == pytest.approx(base["tpot_p90_ms"], rel=1e-6)  # decode as it was


def _decodes(rng: random.Random, most: int) -> StepSums:
    return step_sums([(1, rng.randint(40, 700)) for _ in range(rng.randint(1, most))])


def _timed(rng: random.Random, served: StepModel, sums: StepSums, extra: float = 1.0
           ) -> tuple[float, StepSums]:
    """A step as served: the model's time, ``extra`` (what it does not know of), noise."""
    return served.seconds(sums) * extra * float(np.exp(rng.gauss(0, 0.05))), sums


def _fitted(steps: list[tuple[float, StepSums]]) -> StepModel:
    return fit_served(ENGINE, 1, steps).apply(dataclasses.replace(
        synthetic_profile("cpu"), steps={1: ENGINE})).step(1)


def test_the_few_steps_that_prefill_weigh_as_much_as_the_many_decodes() -> None:
    """A decode worker serves ~20 decode steps per prefill, and its prefills cost what
    the engine-only model leaves out (a KV send, a receive): the fit must still predict
    the prefills (TTFT), not only the decodes."""
    rng = random.Random(5)
    served = ENGINE.scaled_parts(1.3, 1.0)
    steps = [_timed(rng, served, _decodes(rng, 24)) if i % 20 else
             _timed(rng, served, step_sums([(rng.randint(64, 1024), 0)]), 1.4)  # unknown
             for i in range(1000)]
    model = _fitted(steps)
    for kind in (True, False):  # decode-only steps, then the prefills
        ratios = [sec / model.seconds(sums) for sec, sums in steps
                  if (sums.tokens == sums.seqs) == kind]
        assert float(np.median(ratios)) == pytest.approx(1.0, abs=0.06), kind


def test_the_prefilling_steps_weigh_by_their_time() -> None:
    """Many short prompts' steps beside few long ones, the long ones running faster
    than the engine-only model's shape says: the fit follows where the prefill time
    goes (a pool's capacity), so the long steps' total comes out near what they ran."""
    rng = random.Random(7)
    served = ENGINE.scaled_parts(1.2, 1.5)
    steps = [_timed(rng, served, _decodes(rng, 12)) if i % 9 else
             _timed(rng, served, step_sums([(rng.randint(100, 160), 0)])) if i % 27 else
             _timed(rng, served, step_sums([(rng.randint(1200, 1800), 0)]), 0.75)
             for i in range(900)]  # two in three prefills: ~130-token prompts
    model = _fitted(steps)
    long = [(sec, model.seconds(sums)) for sec, sums in steps if sums.tokens >= 1200]
    prefill = [(sec, model.seconds(sums)) for sec, sums in steps if sums.tokens > sums.seqs]
    for group in (long, prefill):
        ran, fitted = (sum(x) for x in zip(*group, strict=True))
        assert fitted == pytest.approx(ran, rel=0.1)


def gemv_steps(n: int, one_seq: float, memory: float, seed: int, prefills: float = 0.0,
               prefill_compute: float = 1.0) -> list[tuple[float, StepSums]]:
    """Decode-only steps of 1-8 sequences served at ``memory`` x the engine, except
    those of one sequence at ``one_seq`` x (the GEMV running beside a neighbour's GEMMs
    keeps more of its speed than they do); a share ``prefills`` of prefill steps at
    ``prefill_compute``. 5% log-normal noise."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < prefills:
            sums = step_sums([(rng.randint(128, 1024), 0)])
            seconds = ENGINE.scaled_parts(1.0, prefill_compute).seconds(sums)
        else:
            b = rng.randint(1, 8)
            sums = step_sums([(1, rng.randint(100, 400)) for _ in range(b)])
            seconds = ENGINE.seconds(sums) * (one_seq if b == 1 else memory)
        out.append((seconds * float(np.exp(rng.gauss(0.0, 0.05))), sums))
    return out


def by_batch(steps: list[tuple[float, StepSums]], model: StepModel) -> dict[int, float]:
    """Median served / predicted per batch size of the decode-only steps."""
    ratios: dict[int, list[float]] = {}
    for sec, sums in steps:
        if sums.decode_only:
            ratios.setdefault(sums.seqs, []).append(sec / model.seconds(sums))
    return {b: float(np.median(r)) for b, r in ratios.items()}


def test_decode_steps_get_the_shape_their_batch_sizes_served() -> None:
    """The factors scale the engine's own shape; where a one-sequence step kept its speed
    and the larger ones slowed 1.4x, the table carries what the factors cannot, and the
    spread is what is left around it (the 5% noise, not the two shapes' 1.4x)."""
    steps = gemv_steps(2000, 1.0, 1.4, seed=7, prefills=0.1)
    fit = fit_served(ENGINE, 1, steps)
    assert len(fit.decode_factors) == 8
    profile = fit.apply(dataclasses.replace(synthetic_profile("cpu"),
                                            steps={1: ENGINE}))
    later = gemv_steps(2000, 1.0, 1.4, seed=8)
    for b, ratio in by_batch(later, profile.step(1)).items():
        assert ratio == pytest.approx(1.0, abs=0.03), b
    spread = dict(fit.jitter)
    assert spread[0.9] == pytest.approx(np.exp(1.2816 * 0.05), rel=0.03)
    # Without the table, the one-sequence steps are what the factors miss.
    flat = dataclasses.replace(profile, serving_decode={})
    assert by_batch(later, flat.step(1))[1] < 0.85


def test_a_decode_worker_that_never_prefills_steps_with_its_own_decode_table() -> None:
    """Its decode steps say nothing of the compute factor, which the pool takes from a
    prefill worker whose steps also send their KV (1.8x): the decode worker's decodes
    are predicted from its own steps, its rare prefills with the pooled factors."""
    prefill = [("prefill", sec, sums) for sec, sums in served_steps(300, 1.0, 1.8, 0.0, 1)
               if not sums.decode_only]
    decode = [("decode", sec, sums) for sec, sums in gemv_steps(600, 1.0, 1.4, seed=3)]
    fits = fit_served_roles(ENGINE, 1, prefill + decode)
    own = fits.roles["decode"]
    assert (own.memory, own.compute) == (fits.pooled.memory, fits.pooled.compute)
    profile = fits.apply(dataclasses.replace(synthetic_profile("cpu"), steps={1: ENGINE}))
    later = gemv_steps(1000, 1.0, 1.4, seed=4)
    for b, ratio in by_batch(later, profile.for_role("decode").step(1)).items():
        assert ratio == pytest.approx(1.0, abs=0.03), b
    pooled = by_batch(later, profile.step(1))  # the pool's table: the prefill role has none
    assert max(abs(r - 1) for r in pooled.values()) < 0.03  # one decode role: the same
    prompt = step_sums([(512, 0)])
    assert profile.for_role("decode").step(1).seconds(prompt) == profile.step(1).seconds(prompt)


def test_the_decode_table_interpolates_between_sizes_and_holds_past_the_last() -> None:
    seqs = np.array([1] * 30 + [2] * 5 + [4] * 30 + [20] * 3)
    ratios = np.where(seqs == 1, 0.8, np.where(seqs == 4, 1.4, 9.0))
    table = decode_table(ratios, seqs)
    assert table == pytest.approx((0.8, 1.0, 1.2, 1.4))  # sizes 2, 3 too few: between
    model = dataclasses.replace(ENGINE, decode_factors=table)
    assert model.decode_factor(9) == model.decode_factor(4) == pytest.approx(1.4)
    assert decode_table(ratios[:10], seqs[:10]) == ()  # no size has MIN_BUCKET steps


def test_a_batch_size_no_machine_speed_explains_leaves_the_table_out() -> None:
    fit = fit_served(ENGINE, 1, gemv_steps(1500, 8.0, 1.0, seed=9, prefills=0.2))
    assert fit.decode_factors == ()  # one-sequence steps 8x: not a speed, a wrong engine
    assert fit_served(ENGINE, 1, gemv_steps(1500, 1.5, 1.0, seed=9, prefills=0.2)
                      ).decode_factors[0] == pytest.approx(1.5, rel=0.05)
