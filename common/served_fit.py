"""A profile's serving calibration refitted from the steps workers really served. Pure;
numpy only.

``pdserve profile`` measures the serving calibration once (:mod:`benchmarks.profile_serving`:
three short waves on the whole machine) and stores it in the profile: a factor for the
step model's memory-bound terms, one for the rest, a cost per sequence, and the spread
of served steps around the model (:class:`common.cost_model.Profile`). A shared VM's
speed moves by more than that calibration can hold: on a 2-core AMD EPYC VM the memory
factor read x0.70, x1.98, x1.53 and x1.36 in four calibrations minutes apart, and a
calibration of a few seconds' waves is as noisy as the 10% a latency prediction may be
off. Dynamo's SLA planner corrects its profile from live TTFT and ITL with one factor a
phase; this refits the same terms the waves fit, on every step a worker served in the
last minutes:

Lifecycle: workers record each step's seconds and :class:`~common.cost_model.StepSums`
(``pdserve worker --step-trace FILE`` writes them to a file, ``--publish-steps`` to
Redis, :mod:`common.served_steps`) -> :func:`fit_served` fits, per thread count,
``served = fm x memory + fc x compute + per_seq x seqs`` over those steps, each step's
memory and compute parts as the engine-only model splits them
(:meth:`~common.cost_model.StepModel.parts`), by least *absolute relative* deviations
(the model predicts the median step, around which the simulator draws the spread; a 2 s
prefill counts as much as a 20 ms decode step, and a step stretched by a neighbour's
burst does not pull the fit), the decode-only steps and the steps that prefill weighing
alike as two groups -> :meth:`ServedFit.apply` puts it in a profile for the
simulator (the live planner, ``pdserve up --autoscale``; ``pdserve plan --validate``'s
``served`` prediction).

The decode-only steps get a table besides (:func:`decode_table`): their median ratio to
the fitted model per batch size. The two factors scale the engine's own shape, and a
served decode step's is not the engine's: on a 2-core Xeon a decode step of two or more
sequences ran 1.1-1.7 times the ratio to the engine alone of a one-sequence step on the
same worker (all remote: x1.07 and x1.28-1.42), the other worker prefilling
meanwhile or not, and the fitted model put a decode worker's ITL p90 21-44% high. The
spread is then what is left around the table.

Where the steps cannot tell memory from compute (every step the same shape) one factor
serves both; a fit outside :data:`FACTOR_RANGE` or on fewer than :data:`MIN_STEPS`
steps is refused (:class:`ServedFitError`), and the caller keeps its profile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .cost_model import Profile, StepModel, StepSums

MIN_STEPS = 100
"""The fewest served steps a fit is made from (a few seconds of a busy worker)."""
FACTOR_RANGE = (0.2, 5.0)
"""A factor outside it says the steps are not this profile's engine (another model,
dtype or machine), not that the machine slowed: such a fit is refused."""
JITTER_PROBS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95,
                0.975, 0.995)
"""Where the spread of served steps is kept (quantiles of the ratios)."""
MIN_JITTER_STEPS = 20
TABLE_SEQS = 16
"""The decode table's last batch size: larger batches take its factor."""
MIN_BUCKET = 20
"""Decode-only steps of one batch size a factor of the table is made from."""
MIN_GROUP = 20
"""The decode-only steps and the steps that prefill weigh alike as two groups, each step
``1 / max(its group's size, MIN_GROUP)``: a group of a few steps weighs less, so that one
stretched prefill among a thousand decodes cannot set the compute factor. A role's own
fit needs this many of each kind; else the role takes the pooled one."""


class ServedFitError(ValueError):
    """The steps do not make a calibration; the message says why, ``reason`` its kind:
    ``few_steps`` or ``out_of_range``."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def jitter_quantiles(ratios: Sequence[float]) -> tuple[tuple[float, float], ...]:
    """``(probability, ratio)`` points of the ratios' distribution (empty: fewer than
    :data:`MIN_JITTER_STEPS`)."""
    if len(ratios) < MIN_JITTER_STEPS:
        return ()
    qs = np.quantile(np.asarray(ratios, dtype=np.float64), JITTER_PROBS)
    return tuple((p, float(q)) for p, q in zip(JITTER_PROBS, qs, strict=True))


@dataclass(frozen=True)
class ServedFit:
    """One thread count's serving calibration, fitted on ``steps`` served steps."""

    threads: int
    steps: int
    memory: float
    compute: float
    per_seq_s: float
    jitter: tuple[tuple[float, float], ...]
    """The decode steps' spread around the fitted model, median 1 (empty: too few)."""
    jitter_step_s: float | None
    """Those decode steps' median seconds (None: no spread fitted)."""
    deviation: float
    """Median ``|served / fitted - 1|`` over the steps (the decode-only ones with the
    decode table): how closely the fit follows them."""
    decode_factors: tuple[float, ...] = ()
    """:func:`decode_table` of the decode-only steps (empty: too few of any one size, or
    a factor outside :data:`FACTOR_RANGE`)."""

    def apply(self, profile: Profile) -> Profile:
        """``profile`` with this calibration for :attr:`threads` (the others as they
        were; a spread not fitted keeps the profile's), and no role's own
        (:attr:`Profile.by_role`: they were fitted against the calibration this
        replaces)."""
        fitted = bool(self.jitter and self.jitter_step_s)
        out = profile.with_serving(self.threads, self.memory, self.compute, self.per_seq_s,
                                   self.decode_factors, self.jitter if fitted else None,
                                   self.jitter_step_s or 0.0)
        return dataclasses.replace(out, by_role={})

    def describe(self) -> str:
        return (f"{self.threads} thread(s): {self.factors()}, from {self.steps} served "
                f"steps (median deviation {self.deviation:.1%})")

    def factors(self) -> str:
        table = self.decode_factors
        decode = (f", decode x{min(table):.2f}-{max(table):.2f} by batch" if table else "")
        return (f"memory x{self.memory:.2f}, compute x{self.compute:.2f}, "
                f"+{self.per_seq_s * 1e3:.2f} ms a sequence{decode}")


def decode_table(ratios: np.ndarray, seqs: np.ndarray) -> tuple[float, ...]:
    """Per batch size ``b`` (1 to :data:`TABLE_SEQS`; the last takes every larger one),
    the median of the decode-only steps' ``ratios`` (served / model) of that size, where
    there are at least :data:`MIN_BUCKET` of them; a size with fewer is interpolated
    between its measured neighbours, and held flat past the outermost. Empty: no size
    has enough."""
    sizes = np.minimum(seqs, TABLE_SEQS)
    known = {b: float(np.median(ratios[sizes == b])) for b in range(1, TABLE_SEQS + 1)
             if (sizes == b).sum() >= MIN_BUCKET}
    if not known:
        return ()
    xs = np.array(sorted(known), dtype=np.float64)
    table = np.interp(np.arange(1, TABLE_SEQS + 1), xs, [known[int(b)] for b in xs])
    last = int(xs[-1])  # sizes past the last measured one take its factor: no entry
    return tuple(float(f) for f in table[:last])


def _lad(x: np.ndarray, y: np.ndarray, weights: np.ndarray, iterations: int = 50
         ) -> np.ndarray:
    """Weighted least absolute deviations of ``y ~ x`` (minimise ``sum(weights * |y -
    x @ coef|)``) by iteratively reweighted least squares."""
    coef, *_ = np.linalg.lstsq(x * np.sqrt(weights)[:, None], y * np.sqrt(weights),
                               rcond=None)
    for _ in range(iterations):
        w = weights / np.maximum(np.abs(y - x @ coef), 1e-4)
        sw = np.sqrt(w)
        new, *_ = np.linalg.lstsq(x * sw[:, None], y * sw, rcond=None)
        if np.allclose(new, coef, rtol=1e-6, atol=1e-9):
            return new
        coef = new
    return coef


@dataclass(frozen=True)
class _Steps:
    """Served steps as the fit reads them: each one's engine-only memory and compute
    parts and sequences (columns of ``parts``), seconds, and kind."""

    parts: np.ndarray
    seconds: np.ndarray
    decode_only: np.ndarray

    @classmethod
    def of(cls, engine_only: StepModel, steps: Sequence[tuple[float, StepSums]]) -> _Steps:
        return cls(np.array([[*engine_only.parts(s), float(s.seqs)] for _, s in steps]
                            ).reshape(-1, 3),
                   np.array([sec for sec, _ in steps], dtype=np.float64),
                   np.array([s.decode_only for _, s in steps], dtype=bool))

    def __getitem__(self, mask: np.ndarray) -> _Steps:
        return _Steps(self.parts[mask], self.seconds[mask], self.decode_only[mask])

    def ratios(self, engine_only: StepModel, memory: float, compute: float,
               per_seq: float) -> np.ndarray:
        """Served / fitted of each step, the fitted model floored as
        :meth:`Profile.step` floors it (scaled parts, then the per-sequence cost)."""
        fitted = self.parts @ np.array([memory, compute, per_seq])
        return self.seconds / np.maximum(fitted, engine_only.floor_s * memory + per_seq)

    def usable(self) -> _Steps:
        """The steps a fit reads: a positive time, and a positive time by the model."""
        return self[(self.parts[:, 0] + self.parts[:, 1] > 0) & (self.seconds > 0)]

    def decode_spread(self, ratios: np.ndarray) -> _DecodeSpread:
        """Of the decode-only steps (of one sequence or more) and their ``ratios``: the
        :func:`decode_table` (empty when a factor is outside :data:`FACTOR_RANGE`: not
        a batch size's speed), and the spread and deviation left around it."""
        decode = self.decode_only & (self.parts[:, 2] >= 1)
        r, seqs = ratios[decode], self.parts[decode, 2].astype(int)
        table = decode_table(r, seqs)
        lo, hi = FACTOR_RANGE
        if not all(lo <= f <= hi for f in table):
            table = ()
        left = ratios.copy()
        if table:
            left[decode] = r / np.array(table)[np.minimum(seqs, len(table)) - 1]
        deviation = float(np.median(np.abs(left - 1.0)))
        if len(r) < MIN_JITTER_STEPS:
            return _DecodeSpread(table, (), None, deviation)
        r = left[decode]
        return _DecodeSpread(table, jitter_quantiles(r / float(np.median(r))),
                             float(np.median(self.seconds[decode])), deviation)


class _DecodeSpread(NamedTuple):
    table: tuple[float, ...]
    jitter: tuple[tuple[float, float], ...]
    step_s: float | None
    deviation: float
    """Median ``|served / fitted - 1|`` of the steps, the decode ones' with the table."""


def fit_served(engine_only: StepModel, threads: int,
               steps: Sequence[tuple[float, StepSums]]) -> ServedFit:
    """The serving calibration of ``threads``-thread workers from their served steps
    (``(seconds, sums)``), against ``engine_only`` (the profile's engine fit for that
    thread count, :attr:`Profile.steps`). Raises :class:`ServedFitError`."""
    return _fit(engine_only, threads, _Steps.of(engine_only, steps))


def _fit(engine_only: StepModel, threads: int, steps: _Steps) -> ServedFit:
    if len(steps.seconds) < MIN_STEPS:
        raise ServedFitError(f"{len(steps.seconds)} served steps of {threads}-thread "
                             f"workers; a fit needs {MIN_STEPS}", "few_steps")
    kept = steps.usable()
    if len(kept.seconds) < MIN_STEPS:
        raise ServedFitError(f"{len(kept.seconds)} served steps with a positive time; a fit "
                             f"needs {MIN_STEPS}", "few_steps")
    parts, seconds, decode_only = kept.parts, kept.seconds, kept.decode_only
    # Each step's weight: the engine-only model's time, its floor included (a tiny
    # decode the linear terms put under the floor must not count more than it runs).
    model = np.maximum(parts[:, 0] + parts[:, 1], engine_only.floor_s)
    x, y = parts / model[:, None], seconds / model  # relative; weights: how much each counts
    # The two kinds of step weigh alike, whatever their numbers: decode-only steps (their
    # time mostly the memory-bound terms) and steps that prefill (mostly compute). A
    # serving decode worker runs twenty of the first for one of the second, and an
    # unweighted median would fit the compute factor to the decode steps' small compute
    # share and leave the prefills, which TTFT is made of, out (a 2-core Xeon: compute
    # x0.49 where prefilling steps ran x1.1-1.2 the engine alone).
    weights = np.where(decode_only, 1.0 / max(MIN_GROUP, decode_only.sum()),
                       1.0 / max(MIN_GROUP, (~decode_only).sum())) * len(y)
    # Within the prefilling steps, each by its time: a pool's prefill capacity is the
    # long prompts' steps, and a median over steps counted alike follows the many short
    # ones (a 2-core Xeon at 120% load: 24 steps of ~130 prompt tokens beside 10 of
    # 600-2000 fitted compute x1.96, which put those 10 at 23.2 s where they ran 18.3;
    # weighed by time, a point's own steps predict its goodput within 6.6% on average
    # over 16 headline points, 9.0% counted alike: loadtest/results/
    # headline-xeon-1206-traced/).
    pre = ~decode_only
    if pre.any():
        weights[pre] *= model[pre] / model[pre].mean()
    memory = compute = per_seq = None
    for cols in ((0, 1, 2), (0, 1)):
        xs = x[:, cols]
        if np.linalg.matrix_rank(xs, tol=1e-6 * np.abs(xs).max()) < len(cols):
            continue
        sol = _lad(xs, y, weights)
        fm, fc, ps = (*sol, 0.0) if len(cols) == 2 else sol
        if fm > 0 and fc > 0 and ps >= 0:
            memory, compute, per_seq = float(fm), float(fc), float(ps)
            break
    if memory is None:  # one factor for the whole step: the weighted median ratio
        order = np.argsort(y)
        at = np.searchsorted(np.cumsum(weights[order]), weights.sum() / 2)
        memory = compute = float(y[order][min(at, len(y) - 1)])
        per_seq = 0.0
    lo, hi = FACTOR_RANGE
    if not (lo <= memory <= hi and lo <= compute <= hi):
        raise ServedFitError(f"served steps fit memory x{memory:.2f}, compute x{compute:.2f}: "
                             f"outside [{lo}, {hi}], not this profile's engine (its model, "
                             "dtype or machine differ?)", "out_of_range")
    d = kept.decode_spread(kept.ratios(engine_only, memory, compute, per_seq))
    return ServedFit(threads, len(y), memory, compute, per_seq, d.jitter, d.step_s,
                     d.deviation, d.table)


def _with_decode_of(fit: ServedFit, engine_only: StepModel, steps: _Steps) -> ServedFit:
    """``fit``'s factors with the decode table and spread of ``steps`` (a role's own,
    too few of its steps prefill for a fit of its own)."""
    steps = steps.usable()
    if not len(steps.seconds):
        return fit
    d = steps.decode_spread(steps.ratios(engine_only, fit.memory, fit.compute, fit.per_seq_s))
    if not d.table:  # (a table takes MIN_BUCKET >= MIN_JITTER_STEPS steps: a spread too)
        return fit
    return dataclasses.replace(fit, steps=len(steps.seconds), decode_factors=d.table,
                               jitter=d.jitter, jitter_step_s=d.step_s,
                               deviation=d.deviation)


@dataclass(frozen=True)
class ServedFits:
    """One thread count's calibration from every role's steps together (``pooled``), and
    each role's own where its steps make one (``roles``): a prefill worker's steps also
    send their KV and a decode worker's receive it, which the engine-only model leaves
    out, so one calibration for every role misfits both (a 2-core Xeon: prefill steps
    x1.6-1.9 the engine alone on a prefill worker, x1.1-1.2 on a mixed one)."""

    pooled: ServedFit
    roles: dict[str, ServedFit]

    def apply(self, profile: Profile) -> Profile:
        """``profile`` with the pooled calibration, and each fitted role's in
        :attr:`Profile.by_role` (the simulator's workers of that role step with it)."""
        base = self.pooled.apply(profile)  # by_role cleared: a window's roles alone
        return dataclasses.replace(base, by_role={role: fit.apply(base)
                                                  for role, fit in self.roles.items()})

    def describe(self) -> str:
        roles = "".join(f"; {role}: {f.factors()} ({f.steps} steps)"
                        for role, f in sorted(self.roles.items()))
        return self.pooled.describe() + roles


def fit_served_roles(engine_only: StepModel, threads: int,
                     steps: Sequence[tuple[str, float, StepSums]]) -> ServedFits:
    """:func:`fit_served` over every step (``(role, seconds, sums)``), and per role where
    that role's steps make a fit with at least :data:`MIN_GROUP` of each kind. Else the
    role takes the pooled factors (a decode worker that never prefills says nothing of
    its compute factor, which its local prefills would step with), with its own decode
    table and spread where its decode steps make one. Raises :class:`ServedFitError`
    when the pooled fit does."""
    every = _Steps.of(engine_only, [(sec, sums) for _, sec, sums in steps])  # once
    pooled = _fit(engine_only, threads, every)
    of_role = np.array([r for r, _, _ in steps])
    roles: dict[str, ServedFit] = {}
    for role in sorted(set(of_role)):
        mine = every[of_role == role]
        decodes = int(mine.decode_only.sum())
        if min(decodes, len(mine.seconds) - decodes) >= MIN_GROUP:
            try:
                roles[role] = _fit(engine_only, threads, mine)
                continue
            except ServedFitError as e:
                if e.reason == "out_of_range":  # not this engine's steps: no table either
                    continue
        own = _with_decode_of(pooled, engine_only, mine)
        if own is not pooled:
            roles[role] = own
    return ServedFits(pooled, roles)
