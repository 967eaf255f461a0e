"""What the live planner would have predicted during a ``pdserve bench-headline`` run,
against what the run measured on the same requests.

The headline runs every load point's requests on a colocated cluster (2 mixed workers)
and on a static split (1 prefill + 1 decode, every prompt remote), and their workers
trace their engine steps (``WORKLOAD-sSEED-CLUSTER-steps/``). At times ``t`` through each
point (every ``--every`` s, from one window in) this does what the live planner
(:mod:`cluster.autoscale`) does at a decision:

- the serving calibration, fitted on the steps one cluster's workers traced in
  ``[t - span, t]`` (:func:`common.served_fit.fit_served_roles`; ``--spans``, default
  the headline's window), each step with the role its worker had then (the adaptive
  cluster's rebuilt from its decisions); a refused fit keeps the last accepted one as
  the planner does;
- the traffic: the point's requests that arrived in ``[t - window, t]``;
- each configuration's predicted goodput (:func:`planner.scores.simulated_goodput`,
  the headline's SLOs): 2 mixed, and 1P + 1D with every prompt remote as the static
  cluster runs.

It prints, per point, the predicted split / mixed goodput ratio (median over the
decisions) beside the measured static / colocated one. Fitted on colocated's steps, it
is the planner's view while all workers are mixed, before any switch (no prefill or
decode worker has stepped); fitted on static's, its view after a switch. Fitted on the
adaptive cluster's own steps and traffic, with the adaptive split (the router placing
each prompt live) against mixed: measured is adaptive / colocated, which is the split's
only where the adaptive cluster ran split through the point (column ``A ran``). A ratio
predicted above the measured one is a planner that splits where it should not.

View ``remembered`` is the adaptive cluster's again, each configuration scored as the
live planner now scores it (:class:`planner.autoscale.FitMemory`): with the calibration
of the last window it served whole (one that began after the last switch: its
decision's time here, the end of its role changes live, some 50 ms later), kept for
``AutoscaleConfig.memory_s`` through the seed's points, else with the window's. Column
``own`` says which of mixed (m) and the split (s) had their own. The traffic is every
request that arrived in the window, as the live planner reads it (the routers note a
request when admitted, :mod:`common.traffic`), but with each request's real output
where the planner takes a request in flight's as the median of those ended. Usage::

    python -m benchmarks.planner_replay DIR [--profile FILE] [--spans 15,60]

``DIR`` is the headline's ``--out``; ``--profile`` defaults to the one it ran with.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from cluster.autoscale import KEEP_FIT_WINDOWS
from cluster.deployment import DeploymentConfig
from common.cost_model import Profile, load_profile
from common.served_fit import ServedFitError, fit_served_roles
from common.traffic import TrafficRecord
from planner.autoscale import AutoscaleConfig, FitMemory
from planner.config import PoolConfig
from planner.moves import reachable, role_changes
from planner.scores import simulated_goodput
from workers.step_trace import TracedStep

from .headline import requests_of
from .served_replay import role_and_port, traced_steps

THREADS = 1  # the headline's workers
_D = DeploymentConfig()  # the headline's adaptive cluster runs the defaults
MIXED, ADAPTIVE = reachable(2, THREADS, _D.local_prefill_threshold, _D.itl_budget_ms,
                            _D.kv_offer)  # its planner's candidates
SPLIT = reachable(2, THREADS, 0)[1]  # every prompt remote: the static cluster
CANDIDATES = {c.label: c for c in (MIXED, ADAPTIVE)}
VIEWS = {"colocated": "before a switch", "static": "after a switch",
         "adaptive": "the planner's own", "remembered": "each its own"}


def pools_of(label: str) -> PoolConfig:
    """The candidate a decision names by its label."""
    return CANDIDATES[label]


def roles_over_time(decisions: Path, folder: Path) -> Callable[[str, float], str]:
    """Each adaptive worker's role at a time (by the port its trace file names): all
    mixed at first, then moved at every switch as the planner moves them
    (:func:`planner.moves.role_changes`, on the workers' ``HOST:PORT`` addresses;
    one host, so ports order them)."""
    roles = {role_and_port(f)[1]: "mixed" for f in folder.glob("*.steps.csv")}
    timeline: list[tuple[float, dict[str, str]]] = [(-math.inf, dict(roles))]
    for d in json.loads(decisions.read_text()):
        if d["action"] == "switch":
            for worker, role in role_changes(roles, pools_of(d["target"])):
                roles[worker] = role
            timeline.append((d["at"], dict(roles)))

    def role_at(port: str, at: float) -> str:
        return next(r for t, r in reversed(timeline) if t <= at)[port]

    return role_at


def traffic(root: Path, point: dict, workload: str, seed: int, k: int
            ) -> list[TrafficRecord]:
    """The point's requests as the routers log them (arrival, prompt and output tokens),
    from its run's per-request details (``WORKLOAD-sSEED-CLUSTER-fFRACTION.json``)."""
    if workload != "mixed":
        raise ValueError(f"the replay rebuilds the mixed workload's requests, not {workload}'s")
    run = root / f"{workload}-s{seed}-{point['cluster']}-f{point['fraction']:g}.json"
    d = json.loads(run.read_text())["details"]
    if point["failed"]:  # the details list the completed requests only
        raise ValueError(f"{run.name}: {point['failed']} requests failed; the replay needs "
                         "every request's send time")
    reqs = requests_of(workload, len(d["sent"]), seed * 1000 + k)
    return [TrafficRecord(point["started_unix_s"] + sent, len(r.prompt), 0, out)
            for r, sent, out in zip(reqs, d["sent"], d["output_tokens"], strict=True)]


def split_at(decisions: Path):  # noqa: ANN201 - (start, end) -> str
    """Whether the adaptive cluster ran split between two times, from its decisions:
    ``split``, ``mixed`` or ``both``."""
    ds = json.loads(decisions.read_text())

    def during(start: float, end: float) -> str:
        now = [d for d in ds if start <= d["at"] <= end]
        kinds = {"mixed" if pools_of(d["current"]).kind == "mixed" else "split" for d in now}
        kinds |= {"mixed" if pools_of(d["target"]).kind == "mixed" else "split"
                  for d in now if d["target"]}
        return "both" if len(kinds) > 1 else next(iter(kinds), "-")

    return during


def calibrated(profile: Profile, steps: list[tuple[str, TracedStep]], since: float,
               until: float) -> Profile | None:
    """``profile`` with the calibration fitted on the steps in ``[since, until]``; None:
    refused (the planner then keeps its last one, or the profile's)."""
    window = [(role, s.seconds, s.sums) for role, s in steps
              if since <= s.start_unix_s <= until]
    try:
        return fit_served_roles(profile.steps[THREADS], THREADS, window).apply(profile)
    except ServedFitError:
        return None


def switches_of(decisions: Path) -> tuple[list[float], Callable[[float], str]]:
    """The adaptive cluster's switch times, and the configuration it ran at a time."""
    ds = json.loads(decisions.read_text())
    moved = [(d["at"], d["target"]) for d in ds if d["action"] == "switch"]

    def running(at: float) -> str:
        return next((label for t, label in reversed(moved) if t <= at), MIXED.label)

    return [t for t, _ in moved], running


class Scores:
    """The headline's goodput score on a calibrated profile, one per profile."""

    def __init__(self, profile: Profile, cal: dict) -> None:
        self.profile, self.cal = profile, cal
        self._on: dict[int, tuple[Profile, Callable]] = {}

    def on(self, fitted: Profile | None) -> Callable:
        p = fitted or self.profile
        if id(p) not in self._on:
            self._on[id(p)] = (p, simulated_goodput(
                p, THREADS, self.cal["slo_ttft_ms"], self.cal["slo_tpot_ms"],
                slo_profile=self.profile))
        return self._on[id(p)][1]


def decisions_at(records: list[TrafficRecord], steps: list[tuple[str, TracedStep]],
                 times: list[float], window: float, span: float, scores: Scores,
                 split: PoolConfig, memory: FitMemory | None = None,
                 switches: tuple[list[float], Callable[[float], str]] | None = None
                 ) -> tuple[list[float], int, set[str]]:
    """The predicted split / mixed goodput at each decision time with enough traffic,
    the refused fits, and (``memory``: the remembered view) which of mixed (m) and the
    split (s) were scored with their own calibration."""
    ratios, refused, owns = [], 0, set()
    kept: tuple[float, Profile] | None = None  # the last accepted
    for t in times:
        recent = [r for r in records if t - window <= r.arrival < t]
        fitted = calibrated(scores.profile, steps, t - span, t)
        refused += fitted is None
        if fitted is not None:
            kept = (t, fitted)
            if memory is not None and switches is not None:
                last = max((a for a in switches[0] if a <= t), default=-math.inf)
                if t - max(span, window) >= last:  # steps the running one served alone
                    memory.note(switches[1](t), fitted, t)
        elif kept and t - kept[0] <= KEEP_FIT_WINDOWS * window:
            fitted = kept[1]  # as the live planner keeps it
        if len(recent) < 6:  # the headline planner's min_requests
            continue
        own = {c.label: memory.own(c.label, t) if memory else None for c in (MIXED, split)}
        owns.add("".join(k for k, c in (("m", MIXED), ("s", split)) if own[c.label]) or "-")
        mixed = scores.on(own[MIXED.label] or fitted)(MIXED, recent)
        ratio = scores.on(own[split.label] or fitted)(split, recent)
        ratios.append(ratio / mixed if mixed else math.inf)
    return ratios, refused, owns


def replay(root: Path, profile: Profile, spans: list[float], every: float) -> list[dict]:
    options = json.loads((root / "options.json").read_text())
    window = 3 * options["autoscale_interval_s"]
    keep_s = AutoscaleConfig(window_s=window).memory_s
    rows = []
    for workload in options["workloads"]:
        scores = Scores(profile, json.loads(
            (root / f"{workload}-calibration.json").read_text()))
        for seed in options["seeds"]:
            sweeps = {c: json.loads((root / f"{workload}-s{seed}-{c}-sweep.json").read_text())
                      for c in ("colocated", "static", "adaptive")}
            decisions = root / f"{workload}-s{seed}-adaptive-decisions.json"
            roles, switches = split_at(decisions), switches_of(decisions)
            measured = {c: {p["fraction"]: p for p in pts} for c, pts in sweeps.items()}
            memories = {span: FitMemory(keep_s) for span in spans}  # through the points
            for k, fraction in enumerate(sorted(measured["colocated"])):
                coloc = measured["colocated"][fraction]["request_goodput"]
                for view in VIEWS:
                    ran = "static" if view in ("colocated", "static") else "adaptive"
                    point = measured["adaptive" if view == "remembered" else view][fraction]
                    truth = (measured[ran][fraction]["request_goodput"] / coloc
                             if coloc else math.inf)
                    records = traffic(root, point, workload, seed, k)
                    cluster = "adaptive" if view == "remembered" else view
                    folder = root / f"{workload}-s{seed}-{cluster}-steps"
                    steps = traced_steps(folder, roles_over_time(decisions, folder)
                                         if cluster == "adaptive" else None)
                    start, end = point["started_unix_s"], records[-1].arrival
                    times, t = [], start + window
                    while t <= end + 1e-9:
                        times.append(t)
                        t += every
                    for span in spans:
                        remembered = view == "remembered"
                        ratios, refused, owns = decisions_at(
                            records, steps, times, window, span, scores,
                            ADAPTIVE if cluster == "adaptive" else SPLIT,
                            memories[span] if remembered else None,
                            switches if remembered else None)
                        rows.append({"workload": workload, "seed": seed,
                                     "fraction": fraction, "view": view, "span_s": span,
                                     "decisions": len(ratios), "refused": refused,
                                     "predicted": float(np.median(ratios)) if ratios else None,
                                     "predicted_min": min(ratios, default=None),
                                     "predicted_max": max(ratios, default=None),
                                     "measured": truth, "own": ",".join(sorted(owns)),
                                     "adaptive_split": roles(start, end)})
    return rows


def report(rows: list[dict]) -> str:
    lines = ["split / mixed goodput: predicted by the planner at its decisions (median, "
             "range) against measured static / colocated, the same requests",
             f"{'workload':9s}{'seed':>5s}{'load':>6s}  {'steps of (planner view)':30s}"
             f"{'span':>6s}{'n':>4s}{'refused':>8s}{'predicted':>11s}{'range':>15s}"
             f"{'measured':>10s}{'A ran':>7s}{'own':>6s}"]
    for r in rows:
        pred = "-" if r["predicted"] is None else f"{r['predicted']:.2f}"
        rng = ("-" if r["predicted"] is None
               else f"{r['predicted_min']:.2f}-{r['predicted_max']:.2f}")
        lines.append(f"{r['workload']:9s}{r['seed']:5d}{r['fraction']:6.0%}  "
                     f"{r['view'] + ' (' + VIEWS[r['view']] + ')':30s}{r['span_s']:5.0f}s"
                     f"{r['decisions']:4d}{r['refused']:8d}{pred:>11s}{rng:>15s}"
                     f"{r['measured']:10.2f}{r['adaptive_split']:>7s}"
                     f"{r['own'] if r['view'] == 'remembered' else '':>6s}")
    for view in VIEWS:
        for span in sorted({r["span_s"] for r in rows}):
            logs = [math.log(r["predicted"] / r["measured"]) for r in rows
                    if r["view"] == view and r["span_s"] == span and r["predicted"]
                    and r["measured"] and math.isfinite(r["predicted"] * r["measured"])
                    and (view in ("colocated", "static") or r["adaptive_split"] == "split")]
            if logs:
                lines.append(f"{view} steps, span {span:.0f}s: predicted / measured ratio, "
                             f"geometric mean x{math.exp(np.mean(logs)):.2f} over "
                             f"{len(logs)} points (1: unbiased; above: splits too eagerly)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--profile", default=None)
    p.add_argument("--spans", default=None,
                   help="comma-separated seconds of steps each calibration is fitted on "
                        "(default: the headline's window)")
    p.add_argument("--every", type=float, default=None,
                   help="seconds between decisions (default: the headline's interval)")
    a = p.parse_args(argv)
    options = json.loads((a.dir / "options.json").read_text())
    profile = load_profile(a.profile or options["profile"])
    window = 3 * options["autoscale_interval_s"]
    spans = [float(s) for s in a.spans.split(",")] if a.spans else [window]
    rows = replay(a.dir, profile, spans, a.every or options["autoscale_interval_s"])
    print(report(rows))
    (a.dir / "planner-replay.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
