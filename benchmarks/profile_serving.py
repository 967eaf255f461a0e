"""How much slower steps run while serving: the profile's ``serving`` factors.

The step grid (:mod:`benchmarks.profile_steps`) times the engine alone, one process on
an otherwise idle machine. A cluster serving through the router runs the same steps
beside its gRPC streams, the router and the other workers, on the same cores. Per thread
count ``t`` this measures that once, as deployed:

1. start a local cluster of ``cores // t`` mixed workers of ``t`` threads (the machine
   full, as ``pdserve up`` fills it) and warm it;
2. send one wave of decode-heavy requests (``per_worker`` per worker, all at once:
   128-token prompts, 64 tokens out, greedy, EOS ignored) and take the median ITL;
3. simulate the very same wave with the engine-only step model
   (:func:`planner.predict.simulate`, same requests, same arrival times) and take its
   median ITL;
4. the factor is their ratio (at least 1: serving never makes a step faster).

The median ITL of such a wave is the decode step of its batch, which is what most of a
serving step's time is; one factor per thread count scales the whole step model.
"""

from __future__ import annotations

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


def serving_factor(profile: Profile, model: str, threads: int, per_worker: int = 8,
                   dtype: str = "auto", log_dir: str | None = None) -> tuple[float, dict]:
    """The factor for ``threads`` and what it came from."""
    import asyncio

    if log_dir is None:  # the cluster's logs, out of the way (they tell only on failure)
        with tempfile.TemporaryDirectory(prefix="pdserve-serving-") as tmp:
            return serving_factor(profile, model, threads, per_worker, dtype, tmp)
    workers = max(1, (os.cpu_count() or 1) // threads)
    n = workers * per_worker
    requests = random_workload(n, INPUT_LEN, OUTPUT_LEN, 0.0, seed=4242)
    config = LocalClusterConfig(model=model, mixed=workers, threads_per_worker=threads,
                                dtype=dtype, port=free_port(), http_port=0, metrics_port=None,
                                launcher="process", log_dir=log_dir)
    with LocalCluster(config) as cluster:
        cluster.wait_ready()
        cluster.warm()
        trace = asyncio.run(drive(RunOptions(cluster.target, tuple(requests), (0.0,) * n,
                                             progress=False)))
    measured = [g for r in trace.records if r.ok for g in r.itls]
    if len(measured) < n:
        raise RuntimeError(f"the serving wave failed: {sum(not r.ok for r in trace.records)} "
                           f"of {n} requests")
    engine_only = replace(profile, serving={})
    sim = simulate_run(engine_only, PoolConfig("mixed", mixed_workers=workers,
                                               mixed_threads=threads),
                       requests, [0.0] * n)
    predicted = [g for r in sim.records if r.ok for g in r.itls]
    m, p = percentile(measured, 50), percentile(predicted, 50)
    factor = max(1.0, m / p) if p > 0 else 1.0
    return factor, {"workers": workers, "requests": n, "measured_itl_p50_ms": m * 1e3,
                    "engine_only_itl_p50_ms": p * 1e3, "factor": factor}


def calibrate(profile: Profile, model: str,
              progress=print) -> tuple[Profile, dict]:  # noqa: ANN001 - a print-like
    """``profile`` with its ``serving`` factors measured for each of its thread counts
    (its workers in the profile's dtype)."""
    factors, facts = {}, {}
    for t in sorted(profile.steps):
        progress(f"serving calibration: {t} thread(s) per worker ...")
        factors[t], facts[t] = serving_factor(profile, model, t, dtype=profile.dtype)
        f = facts[t]
        progress(f"  {f['workers']} mixed worker(s), a wave of {f['requests']} requests: ITL "
                 f"p50 {f['measured_itl_p50_ms']:.1f} ms served vs "
                 f"{f['engine_only_itl_p50_ms']:.1f} ms engine alone: x{f['factor']:.2f}")
    points = {**profile.points, "serving": {str(t): v for t, v in facts.items()}}
    return replace(profile, serving=factors, points=points), facts
