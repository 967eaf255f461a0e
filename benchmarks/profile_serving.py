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
   ignored) and take each wave's median ITL;
3. simulate the very same waves with the engine-only step model
   (:func:`planner.predict.run`, same requests, same arrival times) and take their
   median ITL;
4. fit ``served = factor x engine + per_seq x batch`` through the two waves
   (:func:`fit_serving`): the factor is what sharing the machine costs every step (and
   how much faster or slower the machine runs now than when the grid was measured),
   the per-sequence seconds what each sampled token's message costs the cores (its
   gRPC send, the router's relay, the client). One wave cannot tell them apart.

``pdserve plan --validate`` runs it again before each candidate, for that candidate's
thread count, so a prediction is made with the machine's speed of that minute.

The median ITL of such a wave is the decode step of its batch (``per_worker``
sequences on each worker), which is what most of a serving step's time is.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from dataclasses import replace

from cluster.local import LocalCluster, LocalClusterConfig, free_port
from common.cost_model import Profile
from loadtest.metrics import percentile
from loadtest.runner import RunOptions, drive
from loadtest.workloads import random_workload
from planner.config import PoolConfig
from planner.predict import run as simulate_run

INPUT_LEN, OUTPUT_LEN = 128, 64
WAVES = (2, 8)
"""Requests per worker in the light and the heavy wave."""


def fit_serving(waves: list[tuple[float, float, int]]) -> tuple[float, float]:
    """``(factor, per_seq)`` from waves of ``(measured, engine, batch)`` (one time
    unit): least squares of ``measured = factor x engine + per_seq x batch`` with
    ``per_seq >= 0`` (at the bound, the factor alone). The factor may come out below 1:
    it also carries how much faster or slower the machine runs now than when the step
    grid was measured (a VM's speed drifts: the same decode step took 26.8 ms and 43.4
    ms 90 minutes apart on one AMD EPYC VM)."""
    import numpy as np

    m = np.array([w[0] for w in waves])
    e = np.array([w[1] for w in waves])
    b = np.array([float(w[2]) for w in waves])
    if len(waves) >= 2 and len(set(b)) >= 2:
        (factor, per_seq), *_ = np.linalg.lstsq(np.stack([e, b], axis=1), m, rcond=None)
        if factor > 0.0 and per_seq >= 0.0:
            return float(factor), float(per_seq)
    return float(np.dot(e, m) / np.dot(e, e)), 0.0


def serving_waves(profile: Profile, model: str, threads: int, per_worker: tuple[int, ...] = WAVES,
                  dtype: str = "auto", log_dir: str | None = None) -> list[dict]:
    """Each wave of ``per_worker`` requests per worker on one cluster of ``threads``-thread
    workers: what it measured and what the engine-only model predicts."""
    if log_dir is None:  # the cluster's logs, out of the way (they tell only on failure)
        with tempfile.TemporaryDirectory(prefix="pdserve-serving-") as tmp:
            return serving_waves(profile, model, threads, per_worker, dtype, tmp)
    workers = max(1, (os.cpu_count() or 1) // threads)
    config = LocalClusterConfig(model=model, mixed=workers, threads_per_worker=threads,
                                dtype=dtype, port=free_port(), http_port=0, metrics_port=None,
                                launcher="process", log_dir=log_dir)
    engine_only = replace(profile, serving={}, serving_per_seq={})
    pool = PoolConfig("mixed", mixed_workers=workers, mixed_threads=threads)
    out = []
    with LocalCluster(config) as cluster:
        cluster.wait_ready()
        cluster.warm()
        for k in per_worker:
            n = workers * k
            requests = random_workload(n, INPUT_LEN, OUTPUT_LEN, 0.0, seed=4242 + k)
            trace = asyncio.run(drive(RunOptions(cluster.target, tuple(requests), (0.0,) * n,
                                                 progress=False)))
            measured = [g for r in trace.records if r.ok for g in r.itls]
            if len(measured) < n:
                raise RuntimeError(f"the serving wave failed: "
                                   f"{sum(not r.ok for r in trace.records)} of {n} requests")
            sim = simulate_run(engine_only, pool, requests, [0.0] * n)
            predicted = [g for r in sim.records if r.ok for g in r.itls]
            out.append({"workers": workers, "requests": n, "batch": k,
                        "measured_itl_p50_ms": percentile(measured, 50) * 1e3,
                        "engine_only_itl_p50_ms": percentile(predicted, 50) * 1e3})
    return out


def calibrate(profile: Profile, model: str, progress=print,  # noqa: ANN001 - print-like
              threads: tuple[int, ...] | None = None) -> tuple[Profile, dict]:
    """``profile`` with its ``serving`` factors and ``serving_per_seq`` costs measured
    for each of ``threads`` (default: all of its thread counts; the others keep theirs),
    its workers in the profile's dtype."""
    factors, per_seq = dict(profile.serving), dict(profile.serving_per_seq)
    facts: dict = {}
    for t in sorted(profile.steps if threads is None else threads):
        progress(f"serving calibration: {t} thread(s) per worker ...")
        waves = serving_waves(profile, model, t, dtype=profile.dtype)
        factors[t], per_seq[t] = fit_serving([(w["measured_itl_p50_ms"],
                                               w["engine_only_itl_p50_ms"], w["batch"])
                                              for w in waves])
        per_seq[t] /= 1e3  # the waves are in ms
        facts[t] = {"waves": waves, "factor": factors[t], "per_seq_ms": per_seq[t] * 1e3}
        for w in waves:
            fitted = factors[t] * w["engine_only_itl_p50_ms"] + per_seq[t] * 1e3 * w["batch"]
            progress(f"  {w['workers']} mixed worker(s), {w['batch']} sequences each: ITL p50 "
                     f"{w['measured_itl_p50_ms']:.1f} ms served vs "
                     f"{w['engine_only_itl_p50_ms']:.1f} ms engine alone (fit: {fitted:.1f})")
        progress(f"  x{factors[t]:.2f} per step + {per_seq[t] * 1e3:.2f} ms per sequence")
    points = {**profile.points, "serving": {**profile.points.get("serving", {}),
                                            **{str(t): v for t, v in facts.items()}}}
    return replace(profile, serving=factors, serving_per_seq=per_seq, points=points), facts
