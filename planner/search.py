"""``pdserve plan``'s search: every candidate configuration for some resources, each
simulated on the same workload, ranked, one recommended.

Lifecycle of :func:`plan_workload`: list the candidates (:func:`candidates`) -> cut each
to the slice it is simulated as (:func:`slice_of`) -> sample the workload once per slice
size (every candidate of one size sees the very same requests and arrivals) ->
simulate each distinct slice once (:mod:`planner.predict`) -> figures per candidate
(its own units price its cost) -> recommend (:func:`recommend`) -> :class:`PlanResult`,
with the search's wall time.

**Candidates** for ``N`` units (cores: a worker of ``t`` threads takes ``t``; GPUs: one
worker per GPU, running the profile's 1-thread step model):

- ``mixed``: ``K`` workers of ``N / K`` threads, for every thread count of the profile
  that divides ``N``;
- ``disaggregated``: ``P`` prefill + ``D`` decode workers with thread counts from the
  profile, using the units as fully as they can (no further worker fits); every such
  split while at most :data:`ENUMERATE_WORKERS` workers fit, else one split per small
  ratio ``p:d`` (``p + d <= max_slice_workers``: ``m*p`` + ``m*d`` workers, ``m`` as
  large as fits); each with every local-prefill threshold asked for;
- ``adaptive``: each split once more, with the router's live placement rule
  (:mod:`router.adaptive`) over the decode workers' static threshold (left out, with a
  note, where that module is not installed);
- with ``prefill_caps`` (``pdserve plan --prefill-caps``), each of them once per cap,
  every worker's ``--prefill-tokens-while-decoding`` (``auto``: the live planner's,
  :func:`planner.caps.prefill_caps`, per thread count).

**The symmetric-slice approximation.** Workers of one pool are identical and the router
spreads load over them, so a cluster of many behaves like many copies of a small slice,
each fed its share of the requests. A configuration of more than ``max_slice_workers``
workers is simulated as: ``mixed``, ``max_slice_workers`` of its workers; disaggregated,
the smallest ``p:d`` with its ``P:D`` ratio (the nearest ratio that fits when the
smallest does not). The slice sees ``fraction = slice workers / workers`` of the
sessions (:meth:`planner.workload.Workload.sample`); latencies are the slice's,
throughputs and goodput are scaled by ``1 / fraction``. What it misses: cache-aware
routing over more workers than the slice (a prefix's holder among 1,000 rather than 4)
and the tails of load imbalance across the whole pool. A stationary synthetic trace is
also cut in time: every candidate simulates the same first window of it, the one that
gives the largest slice ``max_requests`` requests. A window understates how far an
overloaded configuration falls behind over the hour (its rates are measured over the
window: :func:`planner.predict.predicted`).

**Recommendation**: the highest goodput; candidates within 1% of it are tied, and the
tie goes to the lower cost per million output tokens, then the lower TTFT p90. Costs
within 1% of the lowest count as equal too: candidates that all keep up with the load
on the same resources differ in cost only by how many tokens their simulated window
happened to produce, which is noise, not a reason to prefer one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from common.cost_model import Profile
from loadtest.metrics import SLO
from loadtest.workloads import Request

from .config import PoolConfig, Resources
from .predict import adaptive_available, predicted, run
from .workload import ExplicitWorkload, Sample, Workload

DEFAULT_THRESHOLDS = (0, 64, 256, 1024)
ENUMERATE_WORKERS = 16
MAX_SLICE_WORKERS = 4
ADAPTIVE_STATIC_THRESHOLD = 32
"""The decode workers' static threshold under the adaptive rule (the workers' default)."""
DEFAULT_ITL_BUDGET_MS = 200.0
TIE = 0.01


@dataclass(frozen=True)
class Slice:
    config: PoolConfig
    """What is simulated."""
    fraction: float
    """Its share of the candidate's workers (and of the requests)."""

    @property
    def label(self) -> str:
        return "whole" if self.fraction == 1 else f"1/{1 / self.fraction:.4g}"


def slice_of(config: PoolConfig, max_workers: int = MAX_SLICE_WORKERS) -> Slice:
    """The slice ``config`` is simulated as (see the module docstring)."""
    n = config.workers
    if n <= max_workers:
        return Slice(config, 1.0)
    if config.kind == "mixed":
        return Slice(replace(config, mixed_workers=max_workers), max_workers / n)
    p, d = config.prefill_workers, config.decode_workers
    g = math.gcd(p, d)
    if p // g + d // g <= max_workers:
        sp, sd = p // g, d // g
    else:
        share = p / n
        sp, sd = min(((a, b) for a in range(1, max_workers) for b in range(1, max_workers)
                      if a + b <= max_workers),
                     key=lambda ab: (abs(ab[0] / (ab[0] + ab[1]) - share), ab[0] + ab[1]))
    return Slice(replace(config, prefill_workers=sp, decode_workers=sd), (sp + sd) / n)


def _splits(units: int, tp: int, td: int, max_slice_workers: int) -> list[tuple[int, int]]:
    """(P, D) using ``units`` as fully as they can (see the module docstring)."""
    if units // min(tp, td) <= ENUMERATE_WORKERS:
        return [(p, d) for p in range(1, units // tp + 1) for d in range(1, units // td + 1)
                if 0 <= units - (p * tp + d * td) < min(tp, td)]
    out = []
    for s in range(2, max_slice_workers + 1):
        for p in range(1, s):
            d = s - p
            m = units // (p * tp + d * td)
            if math.gcd(p, d) == 1 and m >= 1:
                out.append((m * p, m * d))
    return out


def candidates(profile: Profile, resources: Resources,
               thresholds: tuple[int, ...] = DEFAULT_THRESHOLDS, *,
               policy: str = "cache_aware", adaptive: bool = True,
               itl_budget_ms: float = DEFAULT_ITL_BUDGET_MS,
               max_slice_workers: int = MAX_SLICE_WORKERS,
               kv_offer: str = "layers",
               prefill_caps: Callable[[int], tuple[int, ...]] | None = None,
               ttft_slo_ms: float | None = None) -> list[PoolConfig]:
    """``prefill_caps(threads)``: the stall-free caps to try for workers of ``threads``
    threads (None: none); ``ttft_slo_ms``: the adaptive router's TTFT target."""
    n = resources.units
    threads = sorted(profile.steps) if resources.kind == "cores" else [1]
    if resources.kind == "gpus" and 1 not in profile.steps:
        raise ValueError(f"a GPU is planned with the profile's 1-thread step model; this "
                         f"profile has {sorted(profile.steps)} (pdserve profile --threads 1)")
    out = [PoolConfig("mixed", mixed_workers=n // t, mixed_threads=t)
           for t in threads if n % t == 0]
    for tp in threads:
        for td in threads:
            for p, d in _splits(n, tp, td, max_slice_workers):
                base = PoolConfig("disaggregated", prefill_workers=p, decode_workers=d,
                                  prefill_threads=tp, decode_threads=td, policy=policy,
                                  kv_offer=kv_offer)
                out += [replace(base, local_prefill_threshold=t) for t in thresholds]
                if adaptive:
                    out.append(replace(base, kind="adaptive",
                                       local_prefill_threshold=ADAPTIVE_STATIC_THRESHOLD,
                                       itl_budget_ms=itl_budget_ms,
                                       ttft_slo_ms=ttft_slo_ms))
    out = [replace(c, policy=policy) for c in out]
    if prefill_caps is not None:
        out = [replace(c, prefill_tokens_while_decoding=cap) for c in out
               for cap in prefill_caps(max(c.mixed_threads, c.decode_threads))]
    return list(dict.fromkeys(out))


@dataclass
class CandidateResult:
    config: PoolConfig
    predicted: dict
    slice: Slice

    def as_dict(self) -> dict:
        return {"config": self.config.as_dict(), "label": self.config.label,
                "units": self.predicted.get("units"), "slice": self.slice.label,
                "predicted": {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                              for k, v in self.predicted.items()}}


@dataclass
class PlanResult:
    candidates: list[CandidateResult]
    recommended: PoolConfig
    search_s: float
    resources: Resources
    workload: dict
    slo: SLO | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> CandidateResult:
        return next(c for c in self.candidates if c.config == self.recommended)

    def as_json(self) -> dict:
        slices = sorted({c.slice.label for c in self.candidates if c.slice.fraction < 1})
        return {
            "candidates": [c.as_dict() for c in self.candidates],
            "recommended": self.recommended.as_dict(),
            "recommended_label": self.recommended.label,
            "search_s": self.search_s,
            "resources": {"units": self.resources.units, "kind": self.resources.kind,
                          "price_per_unit_hour": self.resources.price_per_unit_hour},
            "slo": None if self.slo is None else {"ttft_ms": self.slo.ttft_ms,
                                                  "tpot_ms": self.slo.tpot_ms},
            "workload": self.workload,
            "slice": (f"simulated {', '.join(slices)} slices of the larger configurations"
                      if slices else None),
            "notes": self.notes,
        }


def recommend(results: list[CandidateResult]) -> CandidateResult:
    """Highest goodput; within :data:`TIE` of it, lowest cost (within :data:`TIE` of the
    lowest), then lowest TTFT p90."""
    best = max(r.predicted["goodput"] for r in results)
    tied = [r for r in results if r.predicted["goodput"] >= best * (1 - TIE)]
    cheapest = min(r.predicted["cost_per_mtok"] for r in tied)
    tied = [r for r in tied if r.predicted["cost_per_mtok"] <= cheapest * (1 + TIE)]
    return min(tied, key=lambda r: (r.predicted["ttft_p90_ms"], r.predicted["cost_per_mtok"]))


def plan(profile: Profile, requests: list[Request], arrivals: list[float],
         resources: Resources, slo: SLO | None = None, **options: object) -> PlanResult:
    """:func:`plan_workload` of explicit requests (one arrival per session)."""
    return plan_workload(profile, ExplicitWorkload(requests, arrivals), resources, slo,
                         **options)  # type: ignore[arg-type]


def plan_workload(profile: Profile, workload: Workload, resources: Resources,
                  slo: SLO | None = None, *, thresholds: tuple[int, ...] = DEFAULT_THRESHOLDS,
                  policy: str = "cache_aware", adaptive: bool = True,
                  itl_budget_ms: float | None = None,
                  max_slice_workers: int = MAX_SLICE_WORKERS,
                  max_requests: int | None = 2000, think_time_s: float = 0.0,
                  configs: list[PoolConfig] | None = None,
                  kv_offer: str = "layers",
                  prefill_caps: Callable[[int], tuple[int, ...]] | None = None
                  ) -> PlanResult:
    """Search (see the module docstring); ``configs`` replaces the candidate list."""
    started = time.perf_counter()
    notes: list[str] = []
    if itl_budget_ms is None:
        itl_budget_ms = slo.tpot_ms if slo is not None and slo.tpot_ms else DEFAULT_ITL_BUDGET_MS
    if adaptive and not adaptive_available():
        adaptive = False
        notes.append("adaptive candidates left out: router.adaptive is not installed")
    if configs is None:
        configs = candidates(profile, resources, thresholds, policy=policy, adaptive=adaptive,
                             itl_budget_ms=itl_budget_ms, max_slice_workers=max_slice_workers,
                             kv_offer=kv_offer, prefill_caps=prefill_caps,
                             ttft_slo_ms=slo.ttft_ms if slo is not None else None)
    if not configs:
        raise ValueError(f"no configuration fits {resources.units} {resources.kind} with the "
                         f"profile's thread counts {sorted(profile.steps)}")
    slices = [slice_of(c, max_slice_workers) for c in configs]
    window = workload.window(max(s.fraction for s in slices), max_requests)
    samples: dict[float, Sample] = {}
    runs: dict[tuple[PoolConfig, float], tuple] = {}
    results = []
    for config, sl in zip(configs, slices, strict=True):
        sample = samples.get(sl.fraction)
        if sample is None:
            sample = samples[sl.fraction] = workload.sample(sl.fraction, window)
        key = (sl.config, sl.fraction)
        if key not in runs:
            runs[key] = (run(profile, sl.config, sample.requests, sample.arrivals,
                             think_time_s=think_time_s), sample)
        result, sample = runs[key]
        units = config.units(resources.kind)
        fig = predicted(result, slo, fraction=sl.fraction, units=units,
                        price_per_unit_hour=resources.price_per_unit_hour,
                        window_s=sample.window_s)
        fig.update(units=units, simulated_requests=len(result.records),
                   window_s=sample.window_s)
        results.append(CandidateResult(config, fig, sl))
    best = recommend(results)
    if window is not None:
        notes.append(f"stationary trace: simulated its first {window:.0f} s (a time slice: at "
                     f"most {max_requests} requests per simulation)")
    sliced = sorted({c.slice.label for c in results if c.slice.fraction < 1})
    if sliced:
        notes.append(f"configurations of more than {max_slice_workers} workers were simulated "
                     f"as symmetric slices ({', '.join(sliced)}; column `slice`)")
    wl = {"description": workload.description,
          "samples": [{"fraction": s.fraction, "requests": len(s.requests),
                       "window_s": s.window_s} for s in samples.values()]}
    return PlanResult(results, best.config, time.perf_counter() - started, resources,
                      wl, slo, notes)
