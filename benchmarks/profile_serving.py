"""How much slower steps run while serving: the profile's ``serving`` factors and
``serving_per_seq`` costs.

The step grid (:mod:`benchmarks.profile_steps`) times the engine alone, one process on
an otherwise idle machine. A cluster serving through the router runs the same steps
beside its gRPC streams, the router and the other workers, on the same cores. Per thread
count ``t`` this measures that once, as deployed:

1. start a local cluster of ``cores // t`` mixed workers of ``t`` threads (the machine
   full, as ``pdserve up`` fills it) and warm it;
2. send a **light** and then a **heavy** wave of decode-heavy requests (:data:`WAVES`
   per worker, each wave all at once: 128-token prompts, 64 tokens out, greedy, EOS
   ignored) and take each wave's median ITL; then a **prefill** wave (one
   :data:`PREFILL_LEN`-token prompt per worker) and take its median TTFT;
3. simulate the very same waves with the engine-only step model
   (:func:`planner.predict.run`, same requests, same arrival times) and take the same
   medians, split into the step model's memory-bound and compute-bound terms
   (:meth:`~common.cost_model.StepModel.parts`);
4. fit ``served = fm x memory + fc x compute + per_seq x batch`` through the three
   waves (:func:`fit_serving`): the factors are what sharing the machine costs each kind
   of work (and how much faster or slower the machine runs now than when the grid was
   measured: a shared host can throttle memory bandwidth and leave compute alone), the
   per-sequence seconds what each sampled token's message costs the cores (its gRPC
   send, the router's relay, the client).

``pdserve plan --validate`` runs it again before each candidate, for that candidate's
thread count, so a prediction is made with the machine's speed of that minute.

The median ITL of such a wave is the decode step of its batch (``per_worker``
sequences on each worker), which is what most of a serving step's time is. The waves
also give the **spread** of served steps around the model (:func:`step_ratios`: each
gap over the predicted one, over the median; kept as quantiles in ``serving_jitter``):
the simulator draws each step's time from it, so that a tail percentile of ITL sees
the steps a real worker stretches (a neighbour's burst, a gRPC send, the router), not
only the deterministic step times.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from cluster.local import LocalCluster, LocalClusterConfig, free_port
from common.cost_model import Profile, StepModel
from common.served_fit import jitter_quantiles
from loadtest.metrics import percentile
from loadtest.runner import RunOptions, drive
from loadtest.workloads import random_workload
from planner.config import PoolConfig
from planner.predict import run as simulate_run
from workers.step_trace import TracedStep

INPUT_LEN, OUTPUT_LEN = 128, 64
WAVES = (2, 8)
"""Requests per worker in the light and the heavy decode wave."""
PREFILL_LEN = 512
"""Prompt tokens of the prefill wave (one prompt per worker, 2 tokens out)."""


def fit_serving(waves: list[tuple[float, float, float, int]]) -> tuple[float, float, float]:
    """``(memory factor, compute factor, per_seq)`` from waves of ``(measured, memory,
    compute, batch)`` (one time unit; ``memory + compute`` is the engine-only model's
    time, split as :meth:`~common.cost_model.StepModel.parts` splits it): least squares
    of ``measured = fm x memory + fc x compute + per_seq x batch`` with ``per_seq >= 0``
    and both factors > 0; where the waves cannot tell the two factors apart (or a bound
    is hit), one factor for both. A factor may come out below 1: it also carries how
    much faster or slower the machine runs now than when the step grid was measured (a
    VM's speed drifts: the same decode step took 26.8 ms and 43.4 ms 90 minutes apart on
    one AMD EPYC VM)."""
    m = np.array([w[0] for w in waves])
    mem = np.array([w[1] for w in waves])
    comp = np.array([w[2] for w in waves])
    b = np.array([float(w[3]) for w in waves])
    for cols in ((mem, comp, b), (mem, comp)):
        x = np.stack(cols, axis=1)
        if len(waves) < len(cols) or np.linalg.matrix_rank(x) < len(cols):
            continue
        sol, *_ = np.linalg.lstsq(x, m, rcond=None)
        fm, fc, per_seq = (*sol, 0.0) if len(cols) == 2 else sol
        if fm > 0 and fc > 0 and per_seq >= 0:
            return float(fm), float(fc), float(per_seq)
    e = mem + comp
    single = float(np.dot(e, m) / np.dot(e, e))
    return single, single, 0.0


def _wave(cluster: LocalCluster, engine_only: Profile, pool: PoolConfig, n: int,
          input_len: int, output_len: int, seed: int) -> tuple[list, list]:
    """One wave of ``n`` alike requests sent at once: the measured and the simulated
    (engine-only) records, each in request order."""
    requests = random_workload(n, input_len, output_len, 0.0, seed=seed)
    trace = asyncio.run(drive(RunOptions(cluster.target, tuple(requests), (0.0,) * n,
                                         progress=False)))
    done = [r for r in trace.records if r.ok]
    if len(done) < n:
        raise RuntimeError(f"the serving wave failed: {n - len(done)} of {n} requests")
    sim = simulate_run(engine_only, pool, requests, [0.0] * n)
    return done, [r for r in sim.records if r.ok]


def serving_waves(profile: Profile, model: str, threads: int, per_worker: tuple[int, ...] = WAVES,
                  dtype: str = "auto", log_dir: str | None = None) -> list[dict]:
    """Each decode wave of ``per_worker`` requests per worker, then the prefill wave
    (:data:`PREFILL_LEN`-token prompts, one per worker), on one cluster of
    ``threads``-thread workers: what each measured (ITL p50; the prefill wave's TTFT
    p50), what the engine-only model predicts, and that prediction's memory and compute
    parts."""
    if log_dir is None:  # the cluster's logs, out of the way (they tell only on failure)
        with tempfile.TemporaryDirectory(prefix="pdserve-serving-") as tmp:
            return serving_waves(profile, model, threads, per_worker, dtype, tmp)
    workers = max(1, (os.cpu_count() or 1) // threads)
    config = LocalClusterConfig(model=model, mixed=workers, threads_per_worker=threads,
                                dtype=dtype, port=free_port(), http_port=0, metrics_port=None,
                                launcher="process", log_dir=log_dir,
                                block_size=profile.block_size)  # as the profile simulates
    engine_only = engine_only_of(profile)
    step = engine_only.step(threads)
    pool = PoolConfig("mixed", mixed_workers=workers, mixed_threads=threads)
    out = []
    with LocalCluster(config) as cluster:
        cluster.wait_ready()
        cluster.warm()
        for k in per_worker:
            done, sim = _wave(cluster, engine_only, pool, workers * k, INPUT_LEN, OUTPUT_LEN,
                              4242 + k)
            out.append({"kind": "decode", "workers": workers, "requests": workers * k,
                        "batch": k,
                        "measured_ms": percentile([g for r in done for g in r.itls], 50) * 1e3,
                        **_split(step, [(1, INPUT_LEN + OUTPUT_LEN // 2)] * k,
                                 percentile([g for r in sim for g in r.itls], 50)),
                        "ratios": step_ratios([r.itls for r in done], [r.itls for r in sim])})
        done, sim = _wave(cluster, engine_only, pool, workers, PREFILL_LEN, 2, 4343)
        out.append({"kind": "prefill", "workers": workers, "requests": workers, "batch": 1,
                    "measured_ms": percentile([r.ttft for r in done], 50) * 1e3,
                    **_split(step, [(PREFILL_LEN, 0)], percentile([r.ttft for r in sim], 50)),
                    "ratios": []})
    return out


def engine_only_of(profile: Profile) -> Profile:
    """``profile`` without its serving calibration: the engine alone, as the grid
    measured it."""
    return replace(profile, serving={}, serving_compute={}, serving_per_seq={},
                   serving_jitter={}, serving_jitter_step_s={}, serving_decode={},
                   by_role={})


def step_speed(profile: Profile, threads: int, steps: Sequence[TracedStep]) -> dict | None:
    """How a run's steps (its workers' step traces, :mod:`workers.step_trace`) ran
    against the served step model of ``threads`` that predicted them: ``steps``,
    ``measured_s`` (their time summed), ``drift`` (that over the model's time for the
    same steps, minus 1) and ``median_ratio`` (the median step's measured time over the
    model's). A drift is the machine's speed moving since the calibration, or work the
    model leaves out (a decode worker's KV receives). None: no step."""
    if not steps:
        return None
    model = profile.step(threads)
    predicted = [model.seconds(s.sums) for s in steps]
    measured = [s.seconds for s in steps]
    total = sum(predicted)
    return {"steps": len(steps), "measured_s": sum(measured),
            "drift": sum(measured) / total - 1 if total > 0 else None,
            "median_ratio": float(np.median([m / p for m, p in zip(measured, predicted,
                                                                   strict=True) if p > 0]))}


def _split(step: StepModel, chunks: list[tuple[int, int]], predicted_s: float) -> dict:
    """The engine-only prediction of a wave, in ms, and its memory-bound and
    compute-bound parts in the shares the wave's typical step has them."""
    memory, compute = step.parts(chunks)
    share = memory / (memory + compute)
    return {"engine_only_ms": predicted_s * 1e3, "memory_ms": predicted_s * share * 1e3,
            "compute_ms": predicted_s * (1 - share) * 1e3}


def step_ratios(measured: list[list[float]], predicted: list[list[float]]) -> list[float]:
    """Each measured gap over the predicted one at the same token index, over its
    wave's median ratio: the served steps' spread around the model, median 1. A wave's
    requests are alike (one prompt length, one output length, sent at once), so the
    predicted gap of token ``j`` is the median of the simulated requests' ``j``-th."""
    width = min((len(g) for g in predicted), default=0)
    if not width:
        return []
    at = np.median(np.array([g[:width] for g in predicted]), axis=0)
    ratios = [m / at[j] for gaps in measured for j, m in enumerate(gaps[:width]) if at[j] > 0]
    median = float(np.median(ratios)) if ratios else 0.0
    return [r / median for r in ratios] if median > 0 else []


def calibrate(profile: Profile, model: str, progress=print,  # noqa: ANN001 - print-like
              threads: tuple[int, ...] | None = None) -> tuple[Profile, dict]:
    """``profile`` with its serving calibration (``serving``, ``serving_compute``,
    ``serving_per_seq``, ``serving_jitter``) measured for each of ``threads`` (default:
    all of its thread counts; the others keep theirs), its workers in the profile's
    dtype."""
    out, facts = profile, {}
    for t in sorted(profile.steps if threads is None else threads):
        progress(f"serving calibration: {t} thread(s) per worker ...")
        waves = serving_waves(profile, model, t, dtype=profile.dtype)
        fm, fc, ps = fit_serving([(w["measured_ms"], w["memory_ms"], w["compute_ms"],
                                   w["batch"]) for w in waves])
        spread = jitter_quantiles([r for w in waves for r in w.pop("ratios")])
        decode = [w["measured_ms"] for w in waves if w["kind"] == "decode"]
        step_s = float(np.median(decode)) / 1e3 if decode else 0.0
        out = out.with_serving(t, fm, fc, ps / 1e3, jitter=spread, jitter_step_s=step_s)
        facts[t] = {"waves": waves, "factor": fm, "compute_factor": fc, "per_seq_ms": ps,
                    "jitter": spread, "jitter_step_ms": step_s * 1e3}
        for w in waves:
            fitted = fm * w["memory_ms"] + fc * w["compute_ms"] + ps * w["batch"]
            what = ("ITL p50" if w["kind"] == "decode" else "TTFT p50")
            progress(f"  {w['workers']} mixed worker(s), {w['kind']} wave of {w['batch']} "
                     f"each: {what} {w['measured_ms']:.1f} ms served vs "
                     f"{w['engine_only_ms']:.1f} ms engine alone (fit: {fitted:.1f})")
        q = dict(spread)
        progress(f"  memory-bound terms x{fm:.2f}, compute x{fc:.2f}, + {ps:.2f} ms per "
                 f"sequence; steps spread p10 {q.get(0.1, 1):.2f} / p90 "
                 f"{q.get(0.9, 1):.2f} of the median")
    points = {**profile.points, "serving": {**profile.points.get("serving", {}),
                                            **{str(t): v for t, v in facts.items()}}}
    return replace(out, points=points), facts  # the waves fit no decode table
