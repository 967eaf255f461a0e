"""``pdserve profile``: measure this machine + model + dtype, fit its cost model, save it.

The planner's simulator and the router's local-or-remote prefill rule ask a
:class:`~common.cost_model.Profile` what a step or a KV transfer costs; this measures one:

1. **Steps, per thread count.** For each count in ``threads``, a fresh child process
   (``python -m benchmarks.profile_steps``, ``OMP_NUM_THREADS`` set, so each has its own
   OpenMP team) builds the engine and times real steps: lone prefills of ``new`` tokens
   after ``cached`` ones, decode batches at several contexts, and decode batches with
   one prefill chunk (:mod:`benchmarks.profile_steps`). It hands back every timed step
   as JSON in a file. A shape's point is the median of its steps (:func:`median_points`);
   the points are fitted with :func:`~common.cost_model.fit_steps`, which holds out a
   seeded 20% of the shapes and reports the fit's error on them.
2. **KV transfer.** This process sends KV from a paged cache through the real channel
   (:class:`~workers.transfer.sender.KVSender` over gloo) into a child's
   :class:`~workers.transfer.receiver.KVReceiver` (the decode stand-in of
   :mod:`benchmarks.transfer`), at sizes from one block to ``transfer_max_bytes``; the
   fastest of each size is fitted with :func:`~common.cost_model.fit_transfer`. The
   payloads are blocks of :mod:`benchmarks.transfer`'s SmolLM2-135M shape in the
   profiled dtype: the fit is in bytes, whatever model made them.
3. **The profile**: both fits, the raw points, the machine (CPU, flags, cores, torch),
   the KV geometry and the engine's limits, written as JSON
   (:func:`~common.cost_model.save_profile`), and a table: per thread count the points,
   the held-out error and a few predictions against measurements; the transfer fit.

The default grid (5 rounds) on SmolLM2-135M fp32 takes ~10 minutes at 1 thread and ~5.5
at 2 on a 2-core AVX2 VM (a 2-core Xeon with AMX in bf16 took ~4 minutes in all with 3
rounds, before the grid went to 5); ``quick`` (a smaller grid, 3 rounds) about a tenth
of that. Run it on a quiet machine:
a neighbour's load is measured too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks import transfer as tx
from benchmarks.machine import cpu_name
from benchmarks.profile_steps import StepGrid
from benchmarks.step_profile import SHOWN_FLAGS
from cluster.child import guarded
from common.cost_model import (
    GEMV_ROWS,
    Profile,
    StepModel,
    StepPoint,
    fit_steps,
    fit_transfer,
    save_profile,
)
from workers.engine.dtype_choice import cpu_flags
from workers.engine.model_runner import keep_freed_memory
from workers.engine.params import resolve_block_size
from workers.transfer.channel import TransferConfig
from workers.transfer.sender import KVSender
from workers.transfer.state import TransferState

TRANSFER_MAX_BYTES = 128 * 2**20
SAMPLE_SHAPES = ("prefill 16 cached 0", "prefill 1024 cached 0", "prefill 512 cached 1024",
                 "decode 1@256", "decode 8@1024", "decode 64@256", "mixed 16@256 + 256")
"""Shapes whose measured and fitted times the table shows, where the grid has them."""


def cores() -> int:
    """CPUs this process may run on (its affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ProfileOptions:
    model: str
    """A local checkpoint directory (the CLI resolves the default model)."""
    dtype: str = "auto"
    threads: tuple[int, ...] = (1, 2)
    kv_cache_gb: float = 1.0
    """The KV pool the profiled workers get (the profile's ``num_blocks``); the
    measurement itself sizes its pool to the grid."""
    block_size: int = 0
    """0: the engine's CPU default (:func:`~workers.engine.params.default_block_size`),
    filled in at construction: the profile records the size it measured with."""
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    grid: StepGrid = field(default_factory=StepGrid)
    transfer_max_bytes: int = TRANSFER_MAX_BYTES
    transfer_reps: int = 5
    out: str = "bench-results/profile.json"
    kernel_cache_dir: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.threads:
            raise ValueError("give at least one thread count")
        object.__setattr__(self, "block_size", resolve_block_size(self.block_size))
        bad = [t for t in self.threads if not 1 <= t <= cores()]
        if bad:
            raise ValueError(f"thread counts {bad} are outside 1..{cores()}, the cores this "
                             "machine gives this process")
        if self.kv_cache_gb <= 0 or self.block_size < 1 or self.max_num_batched_tokens < 1 \
                or self.max_num_seqs < 1 or self.transfer_reps < 1 \
                or self.transfer_max_bytes < 1:
            raise ValueError("kv_cache_gb, block_size, max_num_batched_tokens, max_num_seqs, "
                             "transfer_reps and transfer_max_bytes must be positive")


@dataclass(frozen=True)
class ThreadResult:
    threads: int
    model: StepModel
    shapes: list[str]
    points: list[StepPoint]
    seconds: float
    """Wall time of the child, engine build included."""


# -- steps -----------------------------------------------------------------------------

def measure_steps(opts: ProfileOptions, threads: int) -> dict:
    """Run :mod:`benchmarks.profile_steps` in a fresh process with ``threads`` threads;
    its JSON result. Raises RuntimeError when the child fails (its errors went to our
    stderr)."""
    with tempfile.TemporaryDirectory(prefix="pdserve-profile-") as tmp:
        out = Path(tmp) / "steps.json"
        argv = [sys.executable, "-m", "benchmarks.profile_steps", "--model", opts.model,
                "--dtype", opts.dtype, "--threads", str(threads),
                "--grid", json.dumps(asdict(opts.grid)), "--block-size", str(opts.block_size),
                "--max-num-batched-tokens", str(opts.max_num_batched_tokens),
                "--max-num-seqs", str(opts.max_num_seqs), "--seed", str(opts.seed),
                "--out", str(out)]
        if opts.max_model_len:
            argv += ["--max-model-len", str(opts.max_model_len)]
        if opts.kernel_cache_dir:
            argv += ["--kernel-cache-dir", opts.kernel_cache_dir]
        env = os.environ | {"OMP_NUM_THREADS": str(threads)}
        rc = subprocess.run(guarded(argv), env=env, stdout=sys.stderr).returncode
        if rc != 0 or not out.exists():
            raise RuntimeError(f"the {threads}-thread step measurement failed (exit {rc}); "
                               "its errors are above")
        return json.loads(out.read_text())


def median_points(steps: list[dict]) -> tuple[list[str], list[StepPoint]]:
    """One point per shape: the median of its steps (5 repetitions by default, each in
    its own round over the grid, so a burst of a neighbour's load that covers up to two
    rounds moves no point). Measured on a 2-core AVX2 VM, SmolLM2 fp32, one run of 5
    rounds fitted both ways: held-out error (mean over 30 seeded splits) 2.1% / 3.2% at
    1 / 2 threads from the median of 5, 2.6% / 3.9% from the fastest of the first 3 (the
    estimator before), 2.4% / 3.2% from the fastest of 5: the fastest is the luckiest
    step of a shape, and luck differs from shape to shape."""
    by_shape: dict[str, list[dict]] = {}
    for s in steps:
        by_shape.setdefault(s["shape"], []).append(s)
    shapes, points = [], []
    for shape, group in by_shape.items():
        shapes.append(shape)
        points.append(StepPoint(tuple((n, start) for n, start in group[0]["chunks"]),
                                statistics.median(s["seconds"] for s in group)))
    return shapes, points


# -- transfer --------------------------------------------------------------------------

def transfer_sizes(max_blocks: int, at_least: int = 12) -> list[int]:
    """Block counts from 1 to ``max_blocks``, geometric: two per doubling, and at least
    ``at_least`` of them where there are that many (so the fit has sizes to hold out)."""
    if max_blocks <= at_least:
        return list(range(1, max_blocks + 1))
    k = max(at_least, int(2 * math.log2(max_blocks)) + 1)
    sizes: set[int] = set()
    while len(sizes) < min(at_least, max_blocks):
        sizes = {round(max_blocks ** (i / (k - 1))) for i in range(k)}
        k += 1
    return sorted(sizes)


def measure_transfer(dtype: str, max_bytes: int, reps: int, seed: int = 0,
                     progress: Callable[[str], None] | None = None) -> list[tuple[int, float]]:
    """(bytes, fastest seconds) per size: an early offer (``offer_paged``) from a paged
    cache here into reserved blocks of a paged cache in a child
    (:mod:`benchmarks.transfer`'s decode stand-in), timed from its ``go`` (the KV ready,
    offer and accept done meanwhile, as in a prefill worker's step) to the child's
    "done" line."""
    # As in a worker (its model runner does this): freed buffers stay mapped, so no
    # page faults of a fresh mmap land in the timings.
    keep_freed_memory()
    lay = tx.layout(dtype)
    elem = torch.empty(0, dtype=lay.dtype).element_size()
    block_bytes = tx.LAYERS * 2 * tx.BLOCK * tx.KV_HEADS * tx.HEAD_DIM * elem
    sizes = transfer_sizes(max(1, max_bytes // block_bytes))
    cfg = TransferConfig()
    child = tx.Child(argparse.Namespace(chunk_bytes=cfg.chunk_bytes, window=cfg.recv_window,
                                        dest="paged"))
    raw = socket.create_connection(("127.0.0.1", child.raw_port))  # it waits for one
    sender = KVSender("pdserve-profile", cfg)
    src = tx.cache_for(lay, sizes[-1])
    src.normal_()
    times: dict[int, list[float]] = {n: [] for n in sizes}
    order = random.Random(seed)
    count = 0
    try:
        # The child sizes its cache on its first request: the largest goes first (untimed).
        for rep in range(reps + 1):
            batch = [sizes[-1], sizes[0]] if rep == 0 else order.sample(sizes, len(sizes))
            for n in batch:
                count += 1
                rid = f"profile-transfer-{count}"
                child.say(f"expect {rid} {dtype} {n} direct")
                if child.read() != "ready":
                    raise RuntimeError("the transfer child did not reserve the blocks")
                # As the serving path moves KV (early offers): offered and accepted
                # while the prefill computes, read in place; timed from go.
                offer = sender.offer_paged(child.address, rid, src, list(range(n)),
                                           tx.target_ids(n, "direct"), tx.BLOCK, timeout_s=60)
                h = offer.handle
                accepted_by = time.monotonic() + 60
                while h.state is TransferState.PENDING and time.monotonic() < accepted_by:
                    time.sleep(0.0002)
                start = time.perf_counter()
                offer.go()
                reply = child.read()
                elapsed = time.perf_counter() - start
                result = h.wait(60)
                if result.state is not TransferState.DONE or reply != "done done":
                    raise RuntimeError(f"a {n}-block transfer failed: {result} / {reply}")
                if rep:
                    times[n].append(elapsed)
            if progress and rep:
                progress(f"transfer rep {rep}/{reps}: {len(sizes)} sizes")
    finally:
        sender.close()  # while the child's store is up, so the pair ends cleanly
        child.say("exit")
        try:
            child.proc.wait(30)
        except subprocess.TimeoutExpired:
            child.proc.kill()
        raw.close()
    return [(n * block_bytes, min(ts)) for n, ts in times.items()]


# -- the whole run ---------------------------------------------------------------------

def machine_facts() -> dict:
    flags = cpu_flags() or frozenset()
    return {"cpu": cpu_name(), "cores": cores(), "flags": [f for f in SHOWN_FLAGS if f in flags],
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "loadavg_1m": round(os.getloadavg()[0], 2)}


def run_profile(opts: ProfileOptions, progress: Callable[[str], None] | None = None
                ) -> tuple[Profile, list[ThreadResult]]:
    """Measure, fit and save (to ``opts.out``); the profile and each thread count's
    fit with its points. Raises RuntimeError when a measurement fails."""
    say = progress or (lambda line: None)
    machine = machine_facts()
    results: list[ThreadResult] = []
    child: dict = {}
    for t in opts.threads:
        say(f"steps with {t} thread(s): measuring in a fresh process...")
        start = time.perf_counter()
        child = measure_steps(opts, t)
        shapes, points = median_points(child["steps"])
        model = fit_steps(points, seed=opts.seed,  # where that engine's GEMV hands over
                          gemv_rows=child.get("gemv_rows", GEMV_ROWS))
        results.append(ThreadResult(t, model, shapes, points, time.perf_counter() - start))
    dtype, block_bytes = child["dtype"], child["block_bytes"]
    say(f"KV transfer ({dtype}, up to {opts.transfer_max_bytes / 2**20:.0f} MiB)...")
    transfers = measure_transfer(dtype, opts.transfer_max_bytes, opts.transfer_reps,
                                 opts.seed, say)
    num_blocks = int(opts.kv_cache_gb * 2**30) // block_bytes
    context = min(opts.max_model_len or child["context_len"], child["context_len"])
    machine["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    profile = Profile(
        model=Path(opts.model).name, dtype=dtype, machine=machine,
        block_size=opts.block_size, kv_bytes_per_token=block_bytes // opts.block_size,
        num_blocks=num_blocks, max_num_batched_tokens=opts.max_num_batched_tokens,
        max_num_seqs=opts.max_num_seqs,
        max_model_len=min(context, num_blocks * opts.block_size),
        steps={r.threads: r.model for r in results},
        transfer=fit_transfer(transfers, seed=opts.seed),
        points={"steps": {str(r.threads): [[[list(c) for c in p.chunks], p.seconds]
                                           for p in r.points] for r in results},
                "shapes": {str(r.threads): r.shapes for r in results},
                "transfer": [[b, s] for b, s in transfers]})
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, opts.out)
    return profile, results


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1f}%"


def report(profile: Profile, results: list[ThreadResult], seconds: float) -> str:
    """The table ``pdserve profile`` prints."""
    m = profile.machine
    lines = [f"pdserve profile: {profile.model}, {profile.dtype}; {m['cpu']}, {m['cores']} "
             f"cores ({' '.join(m['flags']) or 'no vector flags of note'}), torch "
             f"{m['torch']}; load {m['loadavg_1m']} -> {m.get('loadavg_1m_after', '?')}",
             *([f"warning: the machine was busy (1-minute load {m['loadavg_1m']} on "
                f"{m['cores']} cores): the times include a neighbour's work"]
               if m["loadavg_1m"] > m["cores"] / 2 else []),  # before we started
             "", "step time: a fit per thread count; error on the held-out 20% of shapes",
             f"{'threads':>7} {'shapes':>6} {'held out':>8} {'mean err':>8} {'p90 err':>8} "
             f"{'max err':>8} {'prefill 1024':>13} {'decode 8@512':>13} {'measured in':>11}"]
    for r in results:
        e = r.model.error
        errs = (_pct(e.mean_pct), _pct(e.p90_pct), _pct(e.max_pct)) if e else ("-",) * 3
        lines.append(f"{r.threads:>7} {len(r.points):>6} {e.held_out if e else 0:>8} "
                     f"{errs[0]:>8} {errs[1]:>8} {errs[2]:>8} "
                     f"{r.model.prefill_seconds(1024) * 1e3:>10.1f} ms "
                     f"{r.model.decode_seconds(8, 512) * 1e3:>10.2f} ms {r.seconds:>9.0f} s")
    lines.append("  (prefill 1024: a lone 1024-token prompt, decode 8@512: 8 sequences of 512 "
                 "tokens, as the fit predicts them)")
    for r in results:
        lines += ["", f"{r.threads} thread(s), measured vs fitted (all points in the fit):",
                  f"  {'shape':<26} {'measured':>10} {'fitted':>10} {'error':>7}"]
        misfit = []
        for shape, p in zip(r.shapes, r.points, strict=True):
            fitted = r.model.seconds(p.chunks)
            misfit.append(((fitted - p.seconds) / p.seconds * 100, shape, p.seconds, fitted))
        worst = sorted(misfit, key=lambda x: -abs(x[0]))[:3]
        shown = [x for s in SAMPLE_SHAPES for x in misfit if x[1] == s]
        for err, shape, measured, fitted in shown + [x for x in worst if x not in shown]:
            tag = "  (worst)" if (err, shape, measured, fitted) in worst else ""
            lines.append(f"  {shape:<26} {measured * 1e3:>7.2f} ms {fitted * 1e3:>7.2f} ms "
                         f"{err:>+6.1f}%{tag}")
    tr, pts = profile.transfer, profile.points["transfer"]
    te = tr.error
    lines += ["", f"KV transfer (gloo, loopback; {len(pts)} sizes, {pts[0][0] / 2**20:.2f}-"
                  f"{pts[-1][0] / 2**20:.0f} MiB): latency {tr.latency_s * 1e3:.2f} ms, "
                  f"{tr.bytes_per_s / 1e9:.2f} GB/s; held-out error "
                  + (f"mean {_pct(te.mean_pct)}, p90 {_pct(te.p90_pct)}, max {_pct(te.max_pct)} "
                     f"({te.held_out} sizes)" if te else "- (too few sizes)"),
              f"total {seconds:.0f} s"]
    return "\n".join(lines)
