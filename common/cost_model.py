"""A machine's cost model: how long an engine step, a KV transfer take. Pure; numpy only.

``pdserve profile`` (:mod:`benchmarks.profile`) measures one machine + model + dtype at
one or more thread counts and fits the raw points (:func:`fit_steps`,
:func:`fit_transfer`) into a :class:`Profile`; the planner's simulator
(:mod:`planner.sim`) and the router's local-or-remote prefill rule
(:mod:`router.adaptive`) read it back with :func:`load_profile` and ask it what a step
(:meth:`StepModel.seconds`) or a transfer costs.

**Step time.** One engine step runs a batch of chunks; chunk *i* computes ``n_i`` new
tokens of a sequence whose first ``start_i`` tokens are already in the KV cache (cached
prefix, earlier chunks, or the decoded context). Decode is ``n_i = 1``; prefill of a
prompt with a cached prefix is ``n_i = new, start_i = cached``. The model is linear in
these features of the batch, with a piecewise-linear term in the batched tokens:

- ``T = sum n_i``: weight GEMMs and elementwise work. Piecewise linear (a linear spline
  with knots at the GEMV handover and :data:`KNOTS`, :func:`knots`): a step of 1-16
  tokens is bound by reading the weights, one of hundreds by compute, and the slope
  between differs;
- ``[T > gemv_rows]``: a step up where the engine's linear layers hand over from the
  decode GEMV (up to ``StepModel.gemv_rows`` rows, as the engine measured at load,
  reading the weights once) to the batched GEMM, which costs a step more than the
  spline's slope says (measured on a 2-core AVX2 VM, SmolLM2 fp32, 2 threads: decode
  4@64 26 ms, 8@64 42 ms; without this term the fit missed those two by +8.8% and
  -6.3%);
- query x key pairs of attention, ``n_i * (start_i + (n_i + 1) / 2)`` per chunk, in
  three sums because the engine runs three kernels at very different costs per pair
  (measured on SmolLM2: a decode pair ~17x a fresh prefill pair): ``A_decode``
  (``n_i = 1``: paged decode attention over the context), ``A_fresh`` (a prefill from
  the first token: the causal kernel) and ``A_prefix`` (a prefill chunk after cached or
  earlier tokens: masked attention over the paged prefix);
- ``S``: sequences in the batch (per-sequence bookkeeping, sampling, the LM head's rows
  are already in T).

Fitted by least squares on measured steps; :func:`fit_profile` holds out a seeded share
of the points and reports the fit's error on them (mean and p90 absolute percentage
error), which ``pdserve profile`` prints and stores.

**Serving.** A worker serving through the router runs the same steps slower than the
engine alone, in two ways: the neighbouring workers share the cores, memory bandwidth
and caches (a factor on the whole step), and every token a step samples is a message
that the worker's gRPC thread, the router and the client handle on the same cores while
the next step runs (a cost per sequence in the step; with several intra-op threads a
stolen slice of one thread stalls the whole team at the op's barrier). The factor is
two: one for the memory-bound terms (the intercept, reading the weights, and decode
attention, reading the KV) and one for the rest (compute), since a shared host can
throttle one and not the other (measured on an AMD EPYC VM in a slow spell: decode
steps 1.9x the profile, a prefill's first token far less). ``pdserve profile`` measures
them once per thread count (:mod:`benchmarks.profile_serving`: the whole machine
serving a light and a heavy decode wave and a prefill wave, against what the step model
predicts for the very same batches) and stores them in ``serving`` (memory),
``serving_compute`` and ``serving_per_seq``; :meth:`Profile.step` hands out the step
model with them (:meth:`StepModel.scaled_parts`, the per-sequence cost added to the
``S`` coefficient), :attr:`Profile.steps` keeps the engine's own fit.

**Transfer time** of ``b`` bytes between a prefill and a decode worker: ``latency_s +
b / bytes_per_s``, fitted the same way on measured transfers. When it lands depends on
the prefill worker's ``--kv-offer`` (:data:`KV_OFFERS`, :meth:`TransferModel.landed_s`):
sent layer by layer, the bytes move while the step computes them.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

PROFILE_VERSION = 4
"""3: the GEMV handover term joined the features; 4: a knot at the handover, which each
step model places where its engine measured it (``StepModel.gemv_rows``; a file of an
older version refits its saved points with ``pdserve profile --refit FILE``)."""
GEMV_ROWS = 4
"""The most tokens a step's linear layers run through the decode GEMV where the profile
does not say (``StepModel.gemv_rows``: the engine measures its own at load); the same
number as ``workers.models.linear.GEMV_ROWS`` (this layer cannot import it; a unit test
holds the two equal)."""
KNOTS: tuple[int, ...] = (16, 64, 256, 1024)
"""Where the batched-token slope may change (a linear spline's knots), besides the GEMV
handover (:func:`knots`): the decode GEMV's cost per row and the GEMM's differ, by CPU
and dtype
(SmolLM2 bf16 on a 2-core Zen 4: +4.2 ms a row from 1 to 4 rows in the GEMV, +1.3 ms a row
from 8 to 16 in the GEMM; without this knot the fit missed decode at 1 and 4 sequences by
+16% and -19%, held-out error 6.4% mean / 15.1% p90 over 30 splits; with it 4.0% / 7.6%,
and 2.0% -> 2.1% on the fp32 AVX2 profile of 2026-12-04)."""


def knots(gemv_rows: int = GEMV_ROWS) -> tuple[int, ...]:
    """Every knot of a step model whose engine hands over from the GEMV past
    ``gemv_rows`` tokens: that, then :data:`KNOTS`."""
    return (gemv_rows, *KNOTS)

Chunk = tuple[int, int]
"""``(num_new_tokens, start)``: one sequence's part of a step."""


MEMORY_TERMS = frozenset({0, 4 + len(KNOTS)})
"""Indices in :func:`features` of the terms bound by memory bandwidth: the intercept
(reading the weights once a step) and decode attention pairs (reading the KV)."""


@dataclass(frozen=True)
class StepSums:
    """What :func:`features` needs of a step, summed over its chunks: tokens ``T``,
    sequences ``S`` and the three kinds of attention pairs. A serving worker can record
    these per step (``pdserve worker --step-trace``) without knowing the model's form."""

    tokens: int = 0
    seqs: int = 0
    decode_pairs: float = 0.0
    fresh_pairs: float = 0.0
    prefix_pairs: float = 0.0

    @property
    def decode_only(self) -> bool:
        """Every chunk one token: a decode step with no prefill in it."""
        return self.tokens == self.seqs

    def features(self, gemv_rows: int = GEMV_ROWS) -> list[float]:
        """This step's regression row (see :func:`features`); an engine without a GEMV
        (``gemv_rows`` 0) has no handover: its knot and step are 0 (else they would
        repeat ``T`` and the intercept, and split the weight read between a memory and a
        compute term)."""
        t = float(self.tokens)
        g = gemv_rows >= 1
        return [1.0, t, max(0.0, t - gemv_rows) if g else 0.0,
                *(max(0.0, t - k) for k in KNOTS), float(g and t > gemv_rows),
                self.decode_pairs, self.fresh_pairs, self.prefix_pairs, float(self.seqs)]


def step_sums(chunks: Iterable[Chunk]) -> StepSums:
    """:class:`StepSums` of one step's chunks: a chunk of ``n`` new tokens after
    ``start`` computes ``n * (start + (n + 1) / 2)`` query x key pairs, counted as decode
    (``n == 1``), fresh (``start == 0``) or prefix pairs."""
    t = s = 0
    decode = fresh = prefix = 0.0
    for n, start in chunks:
        t += n
        pairs = n * (start + (n + 1) / 2)
        if n == 1:
            decode += pairs
        elif start == 0:
            fresh += pairs
        else:
            prefix += pairs
        s += 1
    return StepSums(t, s, decode, fresh, prefix)


def features(chunks: Iterable[Chunk], gemv_rows: int = GEMV_ROWS) -> list[float]:
    """The regression row of one step, on an engine whose GEMV runs up to ``gemv_rows``:
    ``[1, T, (T - k)+ for k in knots(gemv_rows), [T > gemv_rows], A_decode, A_fresh,
    A_prefix, S]``."""
    return step_sums(chunks).features(gemv_rows)


@dataclass(frozen=True)
class FitError:
    """Absolute percentage error of a fit on points it was not fitted on."""

    held_out: int
    mean_pct: float
    p90_pct: float
    max_pct: float

    @classmethod
    def of(cls, predicted: Sequence[float], measured: Sequence[float]) -> FitError:
        errs = sorted(abs(p - m) / m * 100 for p, m in zip(predicted, measured, strict=True)
                      if m > 0)
        if not errs:
            return cls(0, math.nan, math.nan, math.nan)
        p90 = errs[min(len(errs) - 1, math.ceil(0.9 * len(errs)) - 1)]
        return cls(len(errs), sum(errs) / len(errs), p90, errs[-1])


@dataclass(frozen=True)
class StepModel:
    """Step seconds of one engine at one thread count; see the module docstring."""

    coef: tuple[float, ...]
    floor_s: float
    """The fastest step measured: predictions never go below it (an empty-ish batch)."""
    error: FitError | None = None
    gemv_rows: int = GEMV_ROWS
    """Up to how many tokens its engine's linear layers ran the decode GEMV (the
    handover term and the first knot of :func:`features` sit there)."""
    decode_factors: tuple[float, ...] = ()
    """Served decode steps' own shape: a decode-only step of ``b`` sequences takes
    ``decode_factors[min(b, len) - 1]`` times what the terms say (empty: 1). Fitted
    from served steps only (:mod:`common.served_fit`): what batch size costs on a worker
    whose neighbour competes for the core is not what the engine alone measured."""

    def decode_factor(self, seqs: int) -> float:
        """The factor of a decode-only step of ``seqs`` sequences (1 without a table)."""
        f = self.decode_factors
        return f[min(seqs, len(f)) - 1] if f and seqs >= 1 else 1.0

    def row(self, chunks: Iterable[Chunk] | StepSums) -> list[float]:
        """A step's regression row for this model (:func:`features`)."""
        sums = chunks if isinstance(chunks, StepSums) else step_sums(chunks)
        return sums.features(self.gemv_rows)

    def scaled_parts(self, memory: float, compute: float) -> StepModel:
        """The memory-bound terms (:data:`MEMORY_TERMS`: the intercept, a step's weight
        read, and decode attention, its KV read) ``memory`` times as long, the rest (the
        GEMMs' slope in tokens, prefill attention, per sequence work) ``compute`` times;
        the floor (a small decode) as memory. ``scaled_parts(f, f)``: every step ``f``
        times as long."""
        scale = [memory if i in MEMORY_TERMS else compute for i in range(len(self.coef))]
        return StepModel(tuple(c * k for c, k in zip(self.coef, scale, strict=True)),
                         self.floor_s * memory, self.error, self.gemv_rows,
                         self.decode_factors)

    def parts(self, chunks: Iterable[Chunk] | StepSums) -> tuple[float, float]:
        """``(memory_s, compute_s)`` of a step (its chunks, or their sums): the two
        groups of terms of :meth:`scaled_parts` (they add up to :meth:`seconds`, floor
        aside)."""
        row = self.row(chunks)
        memory = sum(self.coef[i] * row[i] for i in MEMORY_TERMS)
        return memory, sum(c * x for c, x in zip(self.coef, row, strict=True)) - memory

    def plus_per_sequence(self, seconds: float) -> StepModel:
        """Every step ``seconds`` longer per sequence in it (the serving cost of the
        message each sampled token becomes)."""
        return StepModel((*self.coef[:-1], self.coef[-1] + seconds), self.floor_s + seconds,
                         self.error, self.gemv_rows, self.decode_factors)

    def seconds(self, chunks: Iterable[Chunk] | StepSums) -> float:
        sums = chunks if isinstance(chunks, StepSums) else step_sums(chunks)
        row = self.row(sums)
        t = max(self.floor_s, sum(c * x for c, x in zip(self.coef, row, strict=True)))
        return t * self.decode_factor(sums.seqs) if sums.decode_only else t

    def decode_seconds(self, batch: int, context: int) -> float:
        """A decode-only step of ``batch`` sequences of ``context`` tokens each."""
        return self.seconds([(1, context)] * batch)

    def prefill_seconds(self, new: int, cached: int = 0) -> float:
        """A lone prefill of ``new`` tokens after ``cached`` cached ones (one chunk)."""
        return self.seconds([(new, cached)])


KV_OFFERS = ("layers", "step", "after")
"""When a prefill worker offers a prompt's KV (``pdserve worker --kv-offer``): ``layers``
while the step that computes it runs, each layer sent as it is done; ``step`` while it
runs, the KV sent when it ends; ``after`` once it ended."""


@dataclass(frozen=True)
class TransferModel:
    latency_s: float
    bytes_per_s: float
    error: FitError | None = None

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    def landed_s(self, nbytes: int, compute_s: float, offer: str = "layers") -> float:
        """Seconds from the start of the prefill step that computes a prompt's last chunk
        (``compute_s`` long) until the prompt's ``nbytes`` of KV have landed, the link
        free (a prefill worker offers the KV before that step, so all of it, earlier
        chunks' too, goes then): under ``layers`` the bytes move while the step computes
        the layers and cannot all be there before it ends,
        ``max(compute_s, bytes / rate) + latency``; under ``step`` and ``after`` they move
        once it ended, ``compute_s + bytes / rate + latency``. (The profile times a
        transfer from its KV's being ready, the offer already accepted: ``after``, which
        offers only then, pays a round trip more, a few ms on loopback, not modelled.)"""
        if offer not in KV_OFFERS:
            raise ValueError(f"unknown KV offer {offer!r}: one of {', '.join(KV_OFFERS)}")
        move = nbytes / self.bytes_per_s
        return (max(compute_s, move) if offer == "layers" else compute_s + move) + self.latency_s


@dataclass(frozen=True)
class StepPoint:
    """One measured step."""

    chunks: tuple[Chunk, ...]
    seconds: float


@dataclass(frozen=True)
class Profile:
    """What ``pdserve profile --out FILE`` writes and ``pdserve plan --profile FILE``
    reads: step models per thread count, the transfer model, and the engine limits the
    simulated workers use (so the simulator schedules like the real engine)."""

    model: str
    dtype: str
    machine: dict
    block_size: int
    kv_bytes_per_token: int
    num_blocks: int
    """KV blocks of one worker (at the profiled ``kv_cache_memory_gb``)."""
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    steps: dict[int, StepModel]
    """Threads per worker -> its step model."""
    transfer: TransferModel
    points: dict = field(default_factory=dict)
    """The raw measurements (``steps``: threads -> [[chunks, seconds]], ``transfer``:
    [[bytes, seconds]]), kept so a profile can be refitted or inspected."""
    serving: dict[int, float] = field(default_factory=dict)
    """Threads per worker -> how much slower a step runs while serving (1.0: not
    measured); with ``serving_compute``, its memory-bound terms only."""
    serving_compute: dict[int, float] = field(default_factory=dict)
    """Threads per worker -> how much slower a step's compute-bound terms run while
    serving (:meth:`StepModel.scaled_parts`; absent: as ``serving``). A shared host
    can throttle memory bandwidth and leave compute alone, or the reverse."""
    serving_per_seq: dict[int, float] = field(default_factory=dict)
    """Threads per worker -> seconds a serving step takes longer per sequence in it
    (0: not measured; profiles before it carry the factor alone)."""
    serving_jitter: dict[int, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """Threads per worker -> the spread of served steps around the model: ``(probability,
    ratio)`` quantile points, median 1 (empty: steps take the model's time exactly).
    The simulator draws each step's factor from it (:func:`draw_jitter`)."""
    serving_jitter_step_s: dict[int, float] = field(default_factory=dict)
    """Threads per worker -> how long the served steps the spread was measured on took
    (the decode waves' median gap): a longer step spreads less (:func:`spread_steps`).
    Absent (profiles before it): every step spreads as those did."""
    serving_decode: dict[int, tuple[float, ...]] = field(default_factory=dict)
    """Threads per worker -> the served decode steps' factors by batch size
    (:attr:`StepModel.decode_factors`; absent: none). Only a calibration fitted on
    served steps has them (:mod:`common.served_fit`)."""
    by_role: dict[str, Profile] = field(default_factory=dict, repr=False)
    """Runtime only, never saved: a worker role's own serving calibration, where the
    steps that role's workers served say it (:class:`common.served_fit.ServedFits`: a
    prefill worker's steps also send their KV); :meth:`for_role` hands it out."""

    def with_serving(self, threads: int, memory: float, compute: float, per_seq_s: float,
                     decode: tuple[float, ...] = (),
                     jitter: tuple[tuple[float, float], ...] | None = None,
                     jitter_step_s: float = 0.0) -> Profile:
        """This profile with the serving calibration of ``threads`` replaced (the other
        thread counts' as they were): the memory and compute factors, the cost per
        sequence, the decode table (empty: none), and the spread with the steps' median
        seconds it was measured on when ``jitter`` is given (None: this profile's kept)."""
        out = replace(
            self, serving={**self.serving, threads: memory},
            serving_compute={**self.serving_compute, threads: compute},
            serving_per_seq={**self.serving_per_seq, threads: per_seq_s},
            serving_decode={**{t: f for t, f in self.serving_decode.items() if t != threads},
                            **({threads: tuple(decode)} if decode else {})})
        if jitter is None:
            return out
        return replace(out, serving_jitter={**self.serving_jitter, threads: tuple(jitter)},
                       serving_jitter_step_s={**self.serving_jitter_step_s,
                                              threads: jitter_step_s})

    def for_role(self, role: str) -> Profile:
        """The profile a worker of ``role`` steps with (:attr:`by_role`, else this)."""
        return self.by_role.get(role, self)

    def step(self, threads: int) -> StepModel:
        """The step model of a serving worker of ``threads`` threads."""
        if threads not in self.steps:
            raise KeyError(f"the profile has no step model for {threads} thread(s); it has "
                           f"{sorted(self.steps)} (pdserve profile --threads ...)")
        model = self.steps[threads]
        factor, per_seq = self.serving.get(threads, 1.0), self.serving_per_seq.get(threads, 0.0)
        compute = self.serving_compute.get(threads, factor)
        if (factor, compute) != (1.0, 1.0):
            model = model.scaled_parts(factor, compute)
        if self.serving_decode.get(threads):
            model = replace(model, decode_factors=self.serving_decode[threads])
        return model.plus_per_sequence(per_seq) if per_seq else model


def _lstsq(rows: list[list[float]], ys: list[float]) -> tuple[float, ...]:
    x = np.asarray(rows, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    # Relative error matters, not absolute: weight each point by 1 / its time, so a
    # 20 ms decode step counts as much as a 2 s prefill.
    w = 1.0 / np.maximum(y, 1e-6)
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    return tuple(float(c) for c in coef)


def _split(n: int, held_out: float, seed: int) -> tuple[list[int], list[int]]:
    idx = list(range(n))
    random.Random(seed).shuffle(idx)
    k = int(round(n * held_out)) if n >= 10 else 0
    return sorted(idx[k:]), sorted(idx[:k])


def fit_steps(points: Sequence[StepPoint], held_out: float = 0.2, seed: int = 0,
              gemv_rows: int = GEMV_ROWS) -> StepModel:
    """Fit on ``1 - held_out`` of the points, report the error on the rest, then refit
    on all of them (the error stands for the final model's: it is no better fitted).
    ``gemv_rows``: up to how many tokens the measured engine ran its decode GEMV."""
    n = len(features([]))
    if len(points) < n:
        raise ValueError(f"need at least {n} measured steps, got {len(points)}")
    rows = [features(p.chunks, gemv_rows) for p in points]
    ys = [p.seconds for p in points]
    train, test = _split(len(points), held_out, seed)
    floor = min(ys)
    error = None
    if test:
        part = StepModel(_lstsq([rows[i] for i in train], [ys[i] for i in train]), floor,
                         gemv_rows=gemv_rows)
        error = FitError.of([part.seconds(points[i].chunks) for i in test],
                            [ys[i] for i in test])
    return StepModel(_lstsq(rows, ys), floor, error, gemv_rows)


def fit_transfer(points: Sequence[tuple[int, float]], held_out: float = 0.2, seed: int = 0
                 ) -> TransferModel:
    if len(points) < 2:
        raise ValueError(f"need at least 2 measured transfers, got {len(points)}")

    def fit(idx: list[int]) -> TransferModel:
        lat, per_byte = _lstsq([[1.0, float(points[i][0])] for i in idx],
                               [points[i][1] for i in idx])
        return TransferModel(max(lat, 0.0), 1.0 / max(per_byte, 1e-15))

    train, test = _split(len(points), held_out, seed)
    error = None
    if test:
        part = fit(train)
        error = FitError.of([part.seconds(points[i][0]) for i in test],
                            [points[i][1] for i in test])
    whole = fit(list(range(len(points))))
    return TransferModel(whole.latency_s, whole.bytes_per_s, error)


def _error_json(e: FitError | None) -> dict | None:
    return None if e is None else asdict(e)


def _error_of(d: dict | None) -> FitError | None:
    return None if d is None else FitError(**d)


def profile_to_json(p: Profile) -> dict:
    return {
        "version": PROFILE_VERSION, "model": p.model, "dtype": p.dtype, "machine": p.machine,
        "block_size": p.block_size, "kv_bytes_per_token": p.kv_bytes_per_token,
        "num_blocks": p.num_blocks, "max_num_batched_tokens": p.max_num_batched_tokens,
        "max_num_seqs": p.max_num_seqs, "max_model_len": p.max_model_len, "knots": KNOTS,
        "steps": {str(t): {"coef": m.coef, "floor_s": m.floor_s, "gemv_rows": m.gemv_rows,
                           "error": _error_json(m.error)} for t, m in p.steps.items()},
        "transfer": {"latency_s": p.transfer.latency_s, "bytes_per_s": p.transfer.bytes_per_s,
                     "error": _error_json(p.transfer.error)},
        "points": p.points, "serving": {str(t): f for t, f in p.serving.items()},
        "serving_per_seq": {str(t): s for t, s in p.serving_per_seq.items()},
        "serving_compute": {str(t): f for t, f in p.serving_compute.items()},
        "serving_jitter": {str(t): [list(q) for q in qs] for t, qs in p.serving_jitter.items()},
        "serving_jitter_step_s": {str(t): s for t, s in p.serving_jitter_step_s.items()},
        "serving_decode": {str(t): list(f) for t, f in p.serving_decode.items()},
    }


def _serving_of(d: dict) -> tuple[dict[int, float], dict[int, float], dict[int, float],
                                   dict, dict[int, float], dict[int, tuple[float, ...]]]:
    """The serving fields, in :class:`Profile`'s order."""
    return ({int(t): float(f) for t, f in d.get("serving", {}).items()},
            {int(t): float(f) for t, f in d.get("serving_compute", {}).items()},
            {int(t): float(s) for t, s in d.get("serving_per_seq", {}).items()},
            {int(t): tuple((float(p), float(r)) for p, r in qs)
             for t, qs in d.get("serving_jitter", {}).items()},
            {int(t): float(s) for t, s in d.get("serving_jitter_step_s", {}).items()},
            {int(t): tuple(float(x) for x in f)
             for t, f in d.get("serving_decode", {}).items()})


def draw_jitter(quantiles: Sequence[tuple[float, float]], u: np.ndarray) -> np.ndarray:
    """Step factors for uniform draws ``u`` in [0, 1): the inverse of the distribution
    the ``(probability, ratio)`` points describe, linear between them and flat past the
    outermost (all ones when there are none)."""
    if not quantiles:
        return np.ones_like(u)
    probs = np.array([p for p, _ in quantiles])
    ratios = np.array([r for _, r in quantiles])
    return np.interp(u, probs, ratios)


SPREAD_DECAY = 1 / 3
"""How a served step's spread shrinks with its length: a step ``k`` times as long as the
steps the spread was measured on moves by ``k ** -SPREAD_DECAY`` of their deviation.
Measured on a 2-core AMD EPYC Zen 4 VM (SmolLM2 bf16, one-thread workers, 2026-12-05;
the workers' step traces of four served configurations): decode steps of ~15-35 ms spread
p10/p90 0.80-0.88 / 1.32-1.38 of their median, prefill steps of 512+ tokens (~1-2 s)
0.91-0.96 / 1.04-1.10; with the decode steps' spread at full width on a 2 s prefill, the
simulator put an all-remote split's TTFT p90 at 6.5 s where it measured 4.0 s. The
disturbances (a neighbour's burst, a gRPC send, the router) do not scale with a step:
a long step averages them out, though more slowly than independent ones would
(``k ** -0.5``)."""


def spread_steps(seconds: np.ndarray, ratios: np.ndarray, measured_on_s: float | None
                 ) -> np.ndarray:
    """Steps of ``seconds`` with drawn spread ``ratios`` (median 1; :func:`draw_jitter`)
    measured on served steps of ``measured_on_s``: a step no longer than those takes the
    ratio whole, a longer one ``1 + (ratio - 1) * (measured_on_s / seconds) **
    SPREAD_DECAY`` (:data:`SPREAD_DECAY`). None or 0: every step takes the ratio whole."""
    if not measured_on_s:
        return seconds * ratios
    shrink = np.minimum(1.0, (measured_on_s / np.maximum(seconds, 1e-12)) ** SPREAD_DECAY)
    return seconds * (1.0 + (ratios - 1.0) * shrink)


def profile_from_json(d: dict) -> Profile:
    if d.get("version") != PROFILE_VERSION:
        raise ValueError(f"profile version {d.get('version')!r}; this pdserve reads "
                         f"{PROFILE_VERSION}: rerun pdserve profile, or refit the file's "
                         "saved points with pdserve profile --refit FILE --out NEW")
    if tuple(d.get("knots", ())) != KNOTS:
        raise ValueError(f"profile fitted with knots {d.get('knots')}, this pdserve uses "
                         f"{KNOTS}: rerun pdserve profile")
    steps = {int(t): StepModel(tuple(m["coef"]), m["floor_s"], _error_of(m.get("error")),
                               int(m.get("gemv_rows", GEMV_ROWS)))
             for t, m in d["steps"].items()}
    tr = d["transfer"]
    return Profile(d["model"], d["dtype"], d.get("machine", {}), d["block_size"],
                   d["kv_bytes_per_token"], d["num_blocks"], d["max_num_batched_tokens"],
                   d["max_num_seqs"], d["max_model_len"], steps,
                   TransferModel(tr["latency_s"], tr["bytes_per_s"], _error_of(tr.get("error"))),
                   d.get("points", {}), *_serving_of(d))


def refit_profile(path: str | Path, held_out: float = 0.2, seed: int = 0) -> Profile:
    """The profile in ``path`` fitted anew from its raw points with this version's model
    (``pdserve profile --refit FILE``): a profile of an older version, or one whose
    features changed, needs no new measurement."""
    try:
        d = json.loads(Path(path).read_text())
        raw = d["points"]
        # The GEMV handover of the engine that measured each thread count's points (a
        # file before it was recorded: GEMV_ROWS, the float GEMV's fixed limit then).
        handover = {t: int(m.get("gemv_rows", GEMV_ROWS)) for t, m in d["steps"].items()}
        steps = {int(t): fit_steps([StepPoint(tuple((int(n), int(s)) for n, s in chunks),
                                              float(sec)) for chunks, sec in pts],
                                   held_out, seed, handover.get(t, GEMV_ROWS))
                 for t, pts in raw["steps"].items()}
        transfer = fit_transfer([(int(b), float(sec)) for b, sec in raw["transfer"]],
                                held_out, seed)
        return Profile(d["model"], d["dtype"], d.get("machine", {}), d["block_size"],
                       d["kv_bytes_per_token"], d["num_blocks"], d["max_num_batched_tokens"],
                       d["max_num_seqs"], d["max_model_len"], steps, transfer, raw,
                       *_serving_of(d))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot refit the profile {path}: {e}") from e


def save_profile(p: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile_to_json(p), indent=1))


def load_profile(path: str | Path) -> Profile:
    try:
        return profile_from_json(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read the profile {path}: {e}") from e
