"""A worker's step trace (workers.step_trace), a run's steps against the model that
predicted them (benchmarks.profile_serving.step_speed), and the simulator's spread of a
step by its length (common.cost_model.spread_steps): the file's round trip, the step sums
against the cost model's features, made-up machines."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from benchmarks.profile_serving import engine_only_of, step_speed
from common.cost_model import (
    SPREAD_DECAY,
    StepSums,
    features,
    knots,
    load_profile,
    save_profile,
    spread_steps,
    step_sums,
)
from loadtest.workloads import arrival_times, mixed_workload
from planner.config import PoolConfig
from planner.predict import simulate
from planner.synthetic import synthetic_profile
from workers.step_trace import StepTrace, TracedStep, read_step_trace

PROFILE = synthetic_profile("cpu")
THREADS = min(PROFILE.steps)


def test_step_sums_give_the_cost_models_features() -> None:
    chunks = [(1, 99), (1, 7), (40, 0), (8, 300), (3, 0)]
    sums = step_sums(chunks)
    assert (sums.tokens, sums.seqs) == (53, 5)
    assert sums.decode_pairs == 100 + 8
    assert sums.fresh_pairs == 40 * 41 / 2 + 3 * 4 / 2
    assert sums.prefix_pairs == 8 * (300 + 9 / 2)
    assert sums.features() == features(chunks)
    model = PROFILE.step(THREADS)
    assert model.seconds(sums) == model.seconds(chunks)
    assert model.parts(sums) == model.parts(chunks)
    assert step_sums([]) == StepSums()


def test_a_trace_reads_back_within_its_window_and_skips_a_torn_line(tmp_path) -> None:
    path = str(tmp_path / "traces" / "decode-5.steps.csv")
    trace = StepTrace(path)
    steps = [TracedStep(100.0 + i, 0.02 * (i + 1), step_sums([(1, 50 + i)] * (i + 1)))
             for i in range(5)]
    for s in steps:
        trace.write(s.start_unix_s, s.seconds, s.sums)
    trace.close()
    with open(path, "a", encoding="utf-8") as f:
        f.write("105.5,0.01,3")  # a worker killed mid-line
    assert read_step_trace(path) == steps
    assert read_step_trace(path, since=101.0, until=103.0) == steps[1:4]
    again = StepTrace(path)  # a restarted worker appends, no second header
    again.write(200.0, 0.5, step_sums([(16, 0)]))
    again.close()
    assert read_step_trace(path, since=150.0)[0].sums.tokens == 16
    with open(path, "a", encoding="utf-8") as f:
        f.write("201.0,0.5,16,1,0,136,2")  # whole fields, but the worker died before "5\n"
    assert [s.start_unix_s for s in read_step_trace(path, since=150.0)] == [200.0]


def test_an_engine_without_a_gemv_has_no_handover_terms() -> None:
    """gemv_rows 0 (no GEMV: a GPU, int8 without kernels): the handover knot and step
    are 0, not copies of T and of the intercept."""
    row = step_sums([(1, 10)] * 3).features(0)
    assert row[2] == 0.0 and row[2 + len(knots(0))] == 0.0
    assert row[:2] == [1.0, 3.0]
    with_gemv = step_sums([(1, 10)] * 3).features(2)
    assert with_gemv[2] == 1.0 and with_gemv[2 + len(knots(2))] == 1.0


def test_a_file_that_is_no_trace_is_refused_by_name(tmp_path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match="x.csv is not a step trace"):
        read_step_trace(str(path))


def _run(memory: float, compute: float, per_seq_s: float, spread: float,
         seed: int = 0) -> list[TracedStep]:
    """Steps a made-up machine ran: decode batches, prefills and mixed steps, each
    ``memory`` x the engine's memory-bound time + ``compute`` x the rest + ``per_seq_s``
    a sequence, times a noise of median 1."""
    rng = random.Random(seed)
    model = engine_only_of(PROFILE).step(THREADS)
    out = []
    for i in range(300):
        kind = i % 3
        if kind == 0:
            chunks = [(1, rng.randint(64, 900))] * rng.randint(1, 32)
        elif kind == 1:
            chunks = [(rng.randint(64, 1024), rng.choice((0, 256)))]
        else:
            chunks = [(1, rng.randint(64, 600))] * rng.randint(1, 8) + [(rng.randint(16, 256), 0)]
        sums = step_sums(chunks)
        mem, comp = model.parts(sums)
        true = memory * mem + compute * comp + per_seq_s * sums.seqs
        out.append(TracedStep(float(i), true * rng.uniform(1 - spread, 1 + spread), sums))
    return out


def test_a_runs_steps_are_compared_with_the_calibration_that_predicted_them() -> None:
    calibrated = replace(PROFILE, serving={THREADS: 1.4}, serving_compute={THREADS: 0.9},
                         serving_per_seq={THREADS: 0.0005})
    same = step_speed(calibrated, THREADS, _run(1.4, 0.9, 0.0005, 0.0))
    assert same["steps"] == 300
    assert same["drift"] == pytest.approx(0.0, abs=1e-9)
    assert same["median_ratio"] == pytest.approx(1.0)
    slower = step_speed(calibrated, THREADS, _run(1.4 * 1.2, 0.9 * 1.2, 0.0006, 0.0))
    assert slower["drift"] == pytest.approx(0.2, abs=1e-6)
    assert slower["measured_s"] == pytest.approx(1.2 * same["measured_s"])
    # against the engine alone (no calibration), the same steps ran 0.9-1.4x as long
    alone = step_speed(PROFILE, THREADS, _run(1.4, 0.9, 0.0, 0.0))
    assert 0.9 - 1 < alone["drift"] < 1.4 - 1
    assert step_speed(calibrated, THREADS, []) is None


def test_a_long_step_spreads_less_than_the_steps_the_spread_was_measured_on() -> None:
    ratios = np.array([0.8, 1.0, 1.35, 1.35, 1.35])
    seconds = np.array([0.02, 0.02, 0.02, 0.01, 2.0])
    out = spread_steps(seconds, ratios, measured_on_s=0.02)
    assert out[:4] == pytest.approx([0.016, 0.02, 0.027, 0.0135])  # as long or shorter: whole
    # 100x as long: the deviation shrinks by 100 ** -SPREAD_DECAY
    assert out[4] == pytest.approx(2.0 * (1 + 0.35 * 100 ** -SPREAD_DECAY))
    assert 2.0 * 1.05 < out[4] < 2.0 * 1.10  # what 1-2 s prefill steps spread, measured
    assert spread_steps(seconds, ratios, None) == pytest.approx(seconds * ratios)


def test_the_simulator_narrows_a_long_steps_spread_with_the_profiles_step_length() -> None:
    """All-remote, long prompts queueing at one prefill worker: with the decode waves'
    spread at full width on every 1-2 s prefill step, the simulated TTFT tail grows."""
    requests = mixed_workload(60, 128, 32, 0.2, 1024, 8, 0.3, seed=3)
    arrivals = arrival_times(len(requests), 0.5, 1.0, seed=3)
    quantiles = ((0.005, 0.6), (0.1, 0.85), (0.5, 1.0), (0.9, 1.35), (0.995, 1.9))
    wide = replace(PROFILE, serving_jitter={THREADS: quantiles})
    narrow = replace(wide, serving_jitter_step_s={THREADS: 0.02})
    split = PoolConfig("disaggregated", prefill_workers=1, decode_workers=1,
                       prefill_threads=THREADS, decode_threads=THREADS)
    tails = [simulate(p, split, requests, arrivals)["ttft_p90_ms"]
             for p in (PROFILE, narrow, wide)]
    assert tails[0] <= tails[1] * 1.15 and tails[1] < tails[2], tails


def test_the_profile_keeps_the_step_length_its_spread_was_measured_on(tmp_path) -> None:
    p = replace(PROFILE, serving_jitter={THREADS: ((0.1, 0.9), (0.5, 1.0), (0.9, 1.2))},
                serving_jitter_step_s={THREADS: 0.025})
    save_profile(p, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").serving_jitter_step_s == {THREADS: 0.025}
