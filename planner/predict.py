"""One configuration's predicted serving metrics: simulate, then measure the simulated
run exactly as ``pdserve bench`` measures a real one.

:func:`simulate` runs :class:`planner.sim.Simulation` and hands its per-request records
to :func:`loadtest.metrics.compute_metrics` (the harness's own TTFT, TPOT, ITL, E2EL and
goodput definitions), then :func:`predicted` renames the figures (``ttft_p90_ms``, ...)
and adds what a slice and a price mean:

- a run of a *slice* (a ``fraction`` of the cluster's workers fed the same fraction of
  its requests, :mod:`planner.search`) has the cluster's latencies; its throughputs and
  goodput are divided by ``fraction`` to stand for the whole cluster;
- a run of a *window* (the first ``window_s`` seconds of a stationary trace) is measured
  as a harness measuring that steady state for ``window_s``: rates are over
  ``window_s`` (not until the last token: the drain after the window's last arrival is
  not part of a long run's rate), and the token throughput counts the tokens produced
  within the window (so an overloaded configuration shows its capacity, not the load);
- ``goodput``: requests/s meeting every SLO given (all completed requests without SLOs);
- ``cost_per_mtok``: what the configuration's resources cost (``units x price per
  unit-hour``, for the simulated duration) per million output tokens.

It is also the entry point of a live autoscaler and of the profile's validation, which
simulate one configuration at a time.
"""

from __future__ import annotations

import math

from common.cost_model import Profile
from loadtest.metrics import SLO, compute_metrics
from loadtest.workloads import Request

from .config import PoolConfig
from .sim import Placement, SimResult, Simulation

PERCENTILES = (50, 90, 99)
SUMMARIES = ("ttft", "tpot", "itl", "e2el")


class AdaptiveUnavailable(RuntimeError):
    """The router's placement rule (:mod:`router.adaptive`) is not in this install."""


def placement_for(profile: Profile, config: PoolConfig) -> Placement | None:
    """The router's per-request placement rule of ``config``: None (static threshold
    alone) except for ``adaptive``, which runs :class:`router.adaptive.PrefillPlacement`
    as the router builds it (``router.core``: the profile, the pools' threads, the ITL
    budget, the TTFT target, and no static threshold of its own: the decode workers
    apply theirs)."""
    if config.kind != "adaptive":
        return None
    try:
        from router.adaptive import PlacementInputs, PrefillPlacement
    except ImportError as e:
        raise AdaptiveUnavailable(f"the adaptive placement rule is not available: {e}") from e
    assert config.itl_budget_ms is not None
    rule = PrefillPlacement(profile, config.decode_threads, config.prefill_threads,
                            config.itl_budget_ms / 1000, static_threshold=0,
                            kv_offer=config.kv_offer,
                            ttft_slo_s=config.ttft_slo_ms / 1000 if config.ttft_slo_ms else None)

    def place(**inputs: int) -> bool:
        return rule.decide(PlacementInputs(**inputs))[0]

    return place


def adaptive_available() -> bool:
    try:
        import router.adaptive  # noqa: F401
    except ImportError:
        return False
    return True


def run(profile: Profile, config: PoolConfig, requests: list[Request], arrivals: list[float],
        *, think_time_s: float = 0.0, fast_forward: bool = True) -> SimResult:
    """Simulate ``config`` on the workload; the raw result (records, workers)."""
    sim = Simulation(profile, config, think_time_s=think_time_s,
                     placement=placement_for(profile, config), fast_forward=fast_forward)
    return sim.run(requests, arrivals)


def predicted(result: SimResult, slo: SLO | None, *, fraction: float = 1.0, units: int = 0,
              price_per_unit_hour: float = 0.0, window_s: float | None = None) -> dict:
    """The planner's figures of one simulated run (see the module docstring)."""
    m = compute_metrics(result.records, window_s or result.duration_s, slo, PERCENTILES)
    throughput = m["output_throughput"]
    if window_s:
        throughput = sum(sum(1 for t in r.token_times if t <= window_s) if r.ok else 0
                         for r in result.records) / window_s
    out: dict = {}
    for name in SUMMARIES:
        out[f"{name}_mean_ms"] = m[f"mean_{name}_ms"]
        for p in PERCENTILES:
            out[f"{name}_p{p}_ms"] = m[f"p{p}_{name}_ms"]
    good_rate = m["request_goodput"] if slo is not None else m["request_throughput"]
    good_share = (m["goodput_fraction"] if slo is not None
                  else m["completed"] / max(1, len(result.records)))
    per_hour = throughput / fraction * 3600  # output tokens
    out.update({
        "goodput": good_rate / fraction,
        "goodput_fraction": good_share,
        "throughput": throughput / fraction,
        "request_throughput": m["request_throughput"] / fraction,
        "cost_per_mtok": units * price_per_unit_hour / per_hour * 1e6 if per_hour else math.inf,
        "completed": m["completed"],
        "failed": m["failed"],
        "duration_s": result.duration_s,
        "cached_token_ratio": m["cached_token_ratio"],
        "preemptions": result.preemptions,
        "local_prefills": result.local_prefills,
        "remote_prefills": result.remote_prefills,
    })
    return out


def simulate(profile: Profile, config: PoolConfig, requests: list[Request],
             arrivals: list[float], slo: SLO | None = None, *, think_time_s: float = 0.0,
             units: int | None = None, price_per_unit_hour: float = 0.0) -> dict:
    """One configuration, the whole workload, no slicing: :func:`predicted`'s figures.
    ``units`` (default: the configuration's cores) prices ``cost_per_mtok``."""
    result = run(profile, config, requests, arrivals, think_time_s=think_time_s)
    return predicted(result, slo, units=config.units() if units is None else units,
                     price_per_unit_hour=price_per_unit_hour)
