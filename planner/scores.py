"""The live planner's scores: what the simulator predicts a configuration serves on a
window of logged traffic (:mod:`planner.window` turns the window into its workload).

:func:`simulated` replays the window on a configuration (:mod:`planner.predict`) and
gives its predicted figures; :func:`goodput_of` and :func:`itl_of` read one figure of
them as a :data:`Score`; :func:`per_window` runs each configuration once per window
however many scores read it; :func:`simulated_goodput` is the production score of
:class:`planner.autoscale.Autoscaler`. The stall-free cap's scores are in
:mod:`planner.caps`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence

from common.cost_model import Profile
from common.traffic import TrafficRecord

from .config import PoolConfig
from .predict import predicted, run
from .window import window_requests, window_slo

Score = Callable[[PoolConfig, Sequence[TrafficRecord]], float]
"""A configuration's score on a window of traffic (higher is better, or the ITL p99
in ms where rule 2b asks for one)."""

Predict = Callable[[PoolConfig, Sequence[TrafficRecord]], Mapping[str, float]]
"""A configuration's predicted figures on the window (``goodput``, ``itl_p99_ms``)."""


def simulated_goodput(profile: Profile, threads: int, slo_ttft_ms: float | None = None,
                      slo_tpot_ms: float | None = None, seed: int = 0,
                      slo_profile: Profile | None = None,
                      window_s: float | None = None) -> Score:
    """The production score: :func:`simulated`'s predicted goodput (requests/s meeting
    the SLOs)."""
    return goodput_of(simulated(profile, threads, slo_ttft_ms, slo_tpot_ms, seed,
                                slo_profile, window_s))


def goodput_of(figures: Predict) -> Score:
    """The score of ``figures``: the predicted goodput."""
    return lambda config, records: float(figures(config, records)["goodput"])


def itl_of(figures: Predict) -> Score:
    """The ITL score of ``figures`` (rule 2b): the predicted ITL p99, ms."""
    return lambda config, records: float(figures(config, records)["itl_p99_ms"])


def per_window(figures: Predict, windows: int = 2) -> Predict:
    """``figures`` simulating each configuration once per list of records (the same
    list object, held so that its id stays its own) for the last ``windows`` lists,
    however many scores read it: a decision's goodput, ITL p99 (on a longer span) and
    the cap's come from one run each."""
    last: list[tuple[Sequence[TrafficRecord], dict]] = []  # newest last

    def remembered(config: PoolConfig, records: Sequence[TrafficRecord]) -> Mapping:
        held = next((out for seen, out in last if seen is records), None)
        if held is None:
            held = {}
            last.append((records, held))
            del last[:-windows]
        if config not in held:
            held[config] = figures(config, records)
        return held[config]

    return remembered


def simulated(profile: Profile, threads: int, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None, seed: int = 0,
              slo_profile: Profile | None = None, window_s: float | None = None,
              load: float = 1.0) -> Predict:
    """The simulator's predicted figures (:func:`planner.predict.predicted`: goodput,
    latency percentiles) of a configuration on the window's requests, replayed at their
    arrival times with their prompt and output lengths, and prompts that share what the
    window says was cached (:func:`planner.window.window_prompts`): the simulated prefix
    cache and cache-aware routing then find those hits, or miss them, as the candidate
    would. A conversation's turns the routers linked follow one another
    (:func:`planner.window.window_requests`).

    SLOs not given are relative to the machine: TTFT 5x the unloaded prefill of the
    window's mean prompt, TPOT 2x an unloaded decode step at that context, both on
    ``slo_profile`` (default: ``profile``; a profile refitted from served steps keeps
    the saved one's SLOs, so that targets do not move with the machine's speed).

    ``window_s``: goodput is the requests served within the SLOs per second of it, the
    window the records arrived in (the live planner's, whose served floor is the share it
    measured of the window's requests over the same seconds); None: per second of the
    simulated run, as a benchmark reports it, whose drain tail differs by configuration.
    On that basis a configuration measured to serve a whole window scored 1-7% above the
    same one simulated to serve it whole (synthetic 15 s chat windows, a 2-core EPYC's
    profile): up to past rule 2b's 5% tolerance, for nothing.

    ``load``: the window's sessions start that many times as often (its seconds
    shrunk by it: :func:`planner.window.window_requests`), for rule 2c's heavier load."""
    if load <= 0:
        raise ValueError(f"load must be > 0, got {load}")
    step = (slo_profile or profile).step(threads)

    def figures(config: PoolConfig, records: Sequence[TrafficRecord]) -> dict:
        requests, starts = window_requests(records, random.Random(seed), load=load)
        result = run(profile, config, requests, starts)
        return predicted(result, window_slo(step, records, slo_ttft_ms, slo_tpot_ms),
                         units=config.units(), window_s=window_s and window_s / load)

    return figures
