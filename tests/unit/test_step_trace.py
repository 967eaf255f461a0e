"""A worker's step trace (workers.step_trace) and the serving calibration fitted to a
run's own steps (benchmarks.profile_serving.speed_of_run): the file's round trip, the
step sums against the cost model's features, and a fit that recovers a made-up speed."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from benchmarks.profile_serving import engine_only_of, speed_of_run
from common.cost_model import StepSums, features, step_sums
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


def test_the_runs_own_speed_is_fitted_from_its_steps() -> None:
    steps = _run(memory=1.4, compute=0.9, per_seq_s=0.0005, spread=0.05)
    at_run, facts = speed_of_run(PROFILE, THREADS, steps)
    assert facts["factor"] == pytest.approx(1.4, rel=0.05)
    assert facts["compute_factor"] == pytest.approx(0.9, rel=0.05)
    assert facts["per_seq_ms"] == pytest.approx(0.5, rel=0.25)
    assert facts["steps"] == 300
    assert facts["measured_s"] == pytest.approx(sum(s.seconds for s in steps))
    # The profile had no serving calibration: the drift is against the engine alone.
    predicted = sum(PROFILE.step(THREADS).seconds(s.sums) for s in steps)
    assert facts["drift"] == pytest.approx(facts["measured_s"] / predicted - 1)
    assert at_run.serving[THREADS] == facts["factor"]
    assert at_run.serving_per_seq[THREADS] == pytest.approx(facts["per_seq_ms"] / 1e3)
    assert at_run.serving_jitter == PROFILE.serving_jitter  # the spread is the waves'


def test_the_drift_is_against_the_calibration_the_prediction_used() -> None:
    calibrated = replace(PROFILE, serving={THREADS: 1.4}, serving_compute={THREADS: 0.9},
                         serving_per_seq={THREADS: 0.0005})
    same = speed_of_run(calibrated, THREADS, _run(1.4, 0.9, 0.0005, 0.0))[1]
    assert same["drift"] == pytest.approx(0.0, abs=1e-9)
    slower = speed_of_run(calibrated, THREADS, _run(1.4 * 1.2, 0.9 * 1.2, 0.0006, 0.0))[1]
    assert slower["drift"] == pytest.approx(0.2, abs=1e-6)
    assert speed_of_run(calibrated, THREADS, []) is None
