"""``pdserve plan --validate``: the planner's predictions against the same candidates run
for real, and the regret of its decision.

Lifecycle: the workload (``pdserve bench``'s generators, built by the CLI)
-> :func:`planner.search.plan` predicts every candidate the local launcher can start
(threads per worker are one number per cluster, so splits with different prefill and
decode threads are left out, with a note) -> each candidate in turn: a
:class:`~cluster.local.LocalCluster` of that shape (adaptive: with the profile, the
router's live placement on), warmed, driven by :func:`loadtest.runner.run` with the very
same requests and arrival times, after the serving calibration of its thread count was
measured again and the candidate predicted anew with it (``recalibrate``; see
:mod:`benchmarks.profile_serving`: a VM's speed drifts by more than the 10% the
latency target allows within one validation), its workers tracing their steps
(:mod:`workers.step_trace`) -> per candidate, prediction error of TTFT p90, ITL p90 and
goodput, ``(predicted - measured) / measured`` (and, beside it, the error of the plan's
own prediction, made from the profile as saved), and per worker role how its steps ran
against the step model that predicted them (``step_speed``,
:func:`~benchmarks.profile_serving.step_speed`: the machine moving since its
calibration, or work the model leaves out) -> the **decision regret**:
``1 - goodput(recommended) / max goodput`` over the measured candidates -> a table and
``validation.json`` under ``out``, and :func:`verdict`, what the bounds say.

**Load.** Each candidate's row carries its *load*: the workload's offered session rate
over the candidate's capacity, the sessions per second the simulator says it serves when
every session arrives at once (:func:`capacity`). The issue's latency target holds
"below 85% of saturation", where a queue's wait is a smooth function of the service
time: near and past saturation a 5% error in a step's time becomes an unbounded error in
TTFT. So the TTFT and ITL bounds judge only rows under ``Bounds.saturation``; the others
are printed and saved with their errors but marked not judged.

**Placement.** A split's row also counts the placements on the decode worker (the
static threshold's and the live rule's) as the simulator predicted them and as the
router decided them (its ``GetStatus`` decision counts, read before and after the run,
so the warm-up is left out), and apart from those the prompts the router moved to the
decode worker because their prefill worker failed or stalled (``local_fallback``), which
the simulator never does. Net of those, a static rule's two counts agree exactly (the
small validation in ``make test`` holds them to it), the live rule's within the timing
of its inputs: how a copy of the router's placement that drifted from the router's own
would show. A request the client resumed elsewhere counts once per attempt.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cluster.local import LocalCluster, LocalClusterConfig, free_port
from common.cost_model import Profile, load_profile, save_profile
from loadtest.metrics import SLO
from loadtest.runner import RunOptions, run
from planner.config import PoolConfig, Resources
from planner.predict import run as simulate_run
from planner.predict import simulate
from planner.search import DEFAULT_THRESHOLDS, candidates, plan
from planner.workload import ExplicitWorkload
from workers.step_trace import read_step_trace

from .machine import machine_line
from .profile_serving import calibrate, engine_only_of, step_speed
from .validate_served import served_prediction
from .validate_served import table as served_table

COMPARED = (("ttft_p90_ms", "p90_ttft_ms"), ("itl_p90_ms", "p90_itl_ms"),
            ("goodput", "request_goodput"))
"""(planner's figure, the harness's) compared per candidate."""


@dataclass(frozen=True)
class Bounds:
    """What ``--validate`` fails on (the issue's targets by default)."""

    regret: float = 0.05
    latency_error: float = 0.10
    """TTFT and ITL p90, relative."""
    goodput_error: float = 0.05
    saturation: float = 0.85
    """Latency errors are judged only for candidates whose load is below this."""


@dataclass(frozen=True)
class ValidateOptions:
    model: str
    profile: str
    workload: ExplicitWorkload
    """Requests and their arrivals (``pdserve bench``'s generators, built by the CLI)."""
    cores: int = 2
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    configs: tuple[str, ...] = ()
    """Labels of the candidates to run (empty: every one the launcher can start)."""
    thresholds: tuple[int, ...] = DEFAULT_THRESHOLDS
    kv_cache_gb: float = 1.0
    dtype: str = "auto"
    bounds: Bounds = field(default_factory=Bounds)
    out: str = "bench-results/plan-validate"
    recalibrate: bool = True
    """Measure the serving calibration again before each candidate (its thread count)
    and predict that candidate with it; the plan's own predictions
    (``predicted_at_plan``, ``error_at_plan``) are kept beside."""
    served_after_s: float = 60.0
    """Also predict each candidate's requests sent after this many seconds from the
    steps its workers served before (:mod:`benchmarks.validate_served`, the live
    planner's calibration), beside the waves' prediction of the same requests; 0: off."""


def launchable(c: PoolConfig) -> bool:
    """Whether the local launcher can start it (one thread count per cluster)."""
    threads = {c.mixed_threads} if c.kind == "mixed" else {c.prefill_threads, c.decode_threads}
    return len(threads) == 1


def cluster_config(o: ValidateOptions, c: PoolConfig, log_dir: Path, engine: Profile,
                   profile_path: str | None = None) -> LocalClusterConfig:
    """The local cluster of ``c``, its KV block size and step token budget those of
    ``engine`` (the validation's profile, which the simulator copies); an adaptive router
    reads ``profile_path`` (default: the validation's profile)."""
    t = c.mixed_threads or c.prefill_threads
    pools: dict = ({"mixed": c.mixed_workers} if c.kind == "mixed" else
                   {"prefill": c.prefill_workers, "decode": c.decode_workers,
                    "local_prefill_threshold": c.local_prefill_threshold})
    if c.kind == "adaptive":
        pools |= {"profile": profile_path or o.profile, "itl_budget_ms": c.itl_budget_ms}
    return LocalClusterConfig(model=o.model, port=free_port(), http_port=0, metrics_port=None,
                              kv_cache_gb=o.kv_cache_gb, threads_per_worker=t, dtype=o.dtype,
                              policy=c.policy, launcher="process", log_dir=str(log_dir),
                              block_size=engine.block_size,
                              max_num_batched_tokens=engine.max_num_batched_tokens, **pools)


def _measure(o: ValidateOptions, c: PoolConfig, requests: list, arrivals: list[float],
             slo: SLO | None, out: Path, engine: Profile, profile: Profile | None = None
             ) -> dict:
    """Run ``c`` for real, sized as ``engine`` (:func:`cluster_config`); an adaptive
    router gets ``profile`` (saved under ``out``) when given, else the validation's
    profile file. The result has the harness's metrics, the router's placements and
    ``steps``: every worker's engine steps that started while the requests ran (their
    step traces, warm-up left out)."""
    name = run_name(c.label)
    path = None
    if profile is not None and c.kind == "adaptive":
        path = str(out / f"{name}-profile.json")
        save_profile(profile, path)
    traces = out / f"{name}-steps"
    shutil.rmtree(traces, ignore_errors=True)  # a rerun into the same directory
    config = dataclasses.replace(cluster_config(o, c, out / f"{name}-logs", engine, path),
                                 step_trace_dir=str(traces))
    with LocalCluster(config) as cluster:
        cluster.wait_ready()
        cluster.warm()
        ca = cluster.config.client_tls_ca
        before = local_placements(cluster.target, ca)
        started = time.time()
        m = run(RunOptions(cluster.target, tuple(requests), tuple(arrivals), slo=slo,
                           progress=True), str(out / f"{name}.json"), {"config": c.label})
        ended = time.time()
        m["started"], m["run_json"] = started, str(out / f"{name}.json")
        after = local_placements(cluster.target, ca)
        m["local_placements"] = (None if before is None or after is None else
                                 {k: n - before.get(k, 0) for k, n in after.items()})
    m["steps"] = {}
    for f in sorted(traces.glob("*.steps.csv")):  # ROLE-PORT.steps.csv
        role = f.name.split("-", 1)[0]
        try:
            steps = read_step_trace(str(f), started, ended)
        except (OSError, ValueError) as e:  # a worker killed while it wrote the header
            print(f"step trace left out: {e}", flush=True)
            continue
        m["steps"].setdefault(role, []).extend(steps)
    return m


def run_name(label: str) -> str:
    """What a candidate's files under ``out`` are named after: its label, letters and
    digits kept (``NAME.json``, ``NAME-steps/``, ``NAME-logs/``)."""
    return "".join(ch if ch.isalnum() else "-" for ch in label).strip("-")


def local_placements(target: str, tls_ca: str | None = None) -> dict[str, int] | None:
    """The router's decisions so far to compute a prompt on its decode worker, by reason
    (``router.dispatch``: ``local``, the worker's own static threshold; ``local_<rule's
    reason>``; ``local_fallback``, its prefill worker failed or stalled); None when the
    router does not answer (the run's own failures are counted elsewhere)."""
    import grpc

    from router.client import Client

    try:
        with Client(target, tls_ca) as client:
            decisions = client.status().routing_decisions
    except grpc.RpcError:
        return None
    out: dict[str, int] = {}
    for key, n in decisions.items():
        reason = key.split("/", 1)[1]
        if reason.startswith("local"):
            out[reason] = out.get(reason, 0) + n
    return out


def offered_rate(arrivals: list[float]) -> float:
    """Sessions per second the workload offers (inf: a burst)."""
    span = max(arrivals, default=0.0) - min(arrivals, default=0.0)
    return (len(arrivals) - 1) / span if len(arrivals) > 1 and span > 0 else math.inf


def capacity(profile: Profile, config: PoolConfig, workload: ExplicitWorkload) -> float:
    """Sessions per second ``config`` serves with every session of ``workload`` arriving
    at once (simulated). The drain of the burst's last requests is in it, so it is a
    slight underestimate of the steady-state capacity."""
    result = simulate_run(profile, config, workload.requests, [0.0] * len(workload.arrivals))
    return len(workload.arrivals) / result.duration_s if result.duration_s > 0 else math.inf


class _Calibrations:
    """The serving calibration of each thread count as last measured: a candidate is
    predicted with one at most :data:`FRESH_S` old, else a new one. (Whether the machine
    kept that speed while the candidate ran is its step traces' to say:
    :func:`~benchmarks.profile_serving.step_speed`.)"""

    def __init__(self, profile: Profile, o: ValidateOptions) -> None:
        self.profile, self.o = profile, o
        self.latest: dict[int, tuple[Profile, dict, float]] = {}

    def recent(self, threads: int) -> tuple[Profile, dict]:
        got = self.latest.get(threads)
        if got is None or time.monotonic() - got[2] > FRESH_S:
            got = self.measure(threads)
        return got[0], got[1]

    def measure(self, threads: int) -> tuple[Profile, dict, float]:
        now, facts = calibrate(self.profile, self.o.model,
                               lambda line: print(line, flush=True), (threads,))
        self.latest[threads] = (now, facts[threads], time.monotonic())
        return self.latest[threads]


FRESH_S = 90.0


def _error(predicted: float, measured: float) -> float:
    if not (math.isfinite(predicted) and math.isfinite(measured)) or measured == 0:
        return math.inf if predicted != measured else 0.0
    return (predicted - measured) / measured


def validate(o: ValidateOptions, profile: Profile | None = None) -> dict:
    profile = profile or load_profile(o.profile)
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    workload = o.workload
    slo = (SLO(o.slo_ttft_ms, o.slo_tpot_ms)
           if o.slo_ttft_ms is not None or o.slo_tpot_ms is not None else None)
    resources = Resources(o.cores)
    every = candidates(profile, resources, o.thresholds)
    notes = [f"{c.label}: not started (prefill and decode threads differ)"
             for c in every if not launchable(c)]
    configs = [c for c in every if launchable(c) and (not o.configs or c.label in o.configs)]
    missing = sorted(set(o.configs) - {c.label for c in configs})
    if missing or not configs:
        raise ValueError(f"no candidate labelled {missing or list(o.configs)}; the candidates "
                         f"are {[c.label for c in every]}")
    # The recommendation among what is run, so that its regret can be measured.
    predicted = plan(profile, workload.requests, workload.arrivals, resources, slo,
                     thresholds=o.thresholds, configs=configs)
    chosen = predicted.candidates
    print(f"pdserve plan --validate: {workload.description}; {o.cores} cores; "
          f"{len(chosen)} candidates; machine: {machine_line()}, loadavg "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    offered = offered_rate(workload.arrivals)
    calibrations = _Calibrations(profile, o)
    for r in chosen:
        row: dict = {"config": r.config.label,
                     "recommended": r.config == predicted.recommended,
                     "predicted_at_plan": {k: r.predicted[k] for k, _ in COMPARED}}
        t = r.config.mixed_threads or r.config.prefill_threads
        now, fig, cal = profile, r.predicted, None
        if o.recalibrate:  # this minute's machine speed, for this candidate's threads
            now, cal = calibrations.recent(t)
            fig = simulate(now, r.config, workload.requests, workload.arrivals, slo)
        load = offered / capacity(now, r.config, workload)
        print(f"\n== {r.config.label}: load {load:.0%} of its simulated capacity; "
              f"predicted TTFT p90 {fig['ttft_p90_ms']:.0f} ms, ITL p90 "
              f"{fig['itl_p90_ms']:.0f} ms, goodput {fig['goodput']:.3f}/s ==", flush=True)
        m = _measure(o, r.config, workload.requests, workload.arrivals, slo, out,
                     profile, now if o.recalibrate else None)
        if slo is None:
            m["request_goodput"] = m["request_throughput"]
        measured = {k: m[h] for k, h in COMPARED}
        row.update({"predicted": {k: fig[k] for k, _ in COMPARED}, "measured": measured,
                    "error": {k: _error(fig[k], measured[k]) for k, _ in COMPARED},
                    "error_at_plan": {k: _error(r.predicted[k], measured[k])
                                      for k, _ in COMPARED},
                    "load": load, "serving": cal, "failed": m["failed"]})
        # How the steps ran against the model that predicted them, per role.
        row["step_speed"] = {role: step_speed(now, t, steps)
                             for role, steps in sorted(m["steps"].items())}
        print(f"steps against the calibration it was predicted with: {_speeds(row)}",
              flush=True)
        if r.config.kind != "mixed":
            placed = m["local_placements"]
            whole = fig["completed"] + fig["failed"] == len(workload.requests)  # not a slice
            row["local_prefills"] = {
                "predicted": fig["local_prefills"] if whole else None,
                "measured": None if placed is None else sum(
                    n for k, n in placed.items() if k != "local_fallback"),
                "fallback": None if placed is None else placed.get("local_fallback", 0),
                "requests": len(workload.requests)}
        if o.served_after_s > 0:
            row["served_window"] = served_prediction(
                now, engine_only_of(profile), r.config, t, workload.requests,
                workload.arrivals, slo,
                [(role, s) for role, steps in m["steps"].items() for s in steps],
                m["started"], m["run_json"], o.served_after_s)
        rows.append(row)
    best = max((row["measured"]["goodput"] for row in rows), default=0.0)
    rec = next((row for row in rows if row["recommended"]), None)
    regret = (1 - rec["measured"]["goodput"] / best) if rec and best > 0 else None
    summary = {"workload": workload.description, "cores": o.cores, "machine": machine_line(),
               "slo": None if slo is None else asdict(slo),
               "recommended": predicted.recommended.label, "search_s": predicted.search_s,
               "rows": rows, "regret": regret, "notes": notes + predicted.notes,
               "bounds": asdict(o.bounds)}
    summary["verdict"] = verdict(summary, o.bounds)
    _print(summary)
    (out / "validation.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def verdict(summary: dict, b: Bounds) -> list[str]:
    """What broke a bound (empty: the validation passed)."""
    out = []
    regret = summary["regret"]
    if regret is None:
        out.append("no regret: the recommended candidate was not run")
    elif regret > b.regret:
        out.append(f"decision regret {regret:.1%} > {b.regret:.0%}")
    for row in summary["rows"]:
        judged = [("goodput", b.goodput_error)]
        if judged_latency(row, b):
            judged += [("ttft_p90_ms", b.latency_error), ("itl_p90_ms", b.latency_error)]
        for key, bound in judged:
            e = row["error"][key]
            if abs(e) > bound:
                out.append(f"{row['config']}: {key} off by {e:+.0%} (bound {bound:.0%})")
    return out


def judged_latency(row: dict, b: Bounds) -> bool:
    """Whether the row's TTFT and ITL errors are held to the bound: its load is below
    saturation (rows saved before this column are judged)."""
    return row.get("load", 0.0) < b.saturation


def _unjudged(row: dict, b: Bounds) -> str:
    return "" if judged_latency(row, b) else "  (latency not judged: load)"


def _speeds(row: dict) -> str:
    """Each role's traced steps against the model that predicted them (empty: none)."""
    return "; ".join(f"{role} {v['steps']} steps {v['drift']:+.0%} (median step "
                     f"{v['median_ratio']:.2f}x)"
                     for role, v in (row.get("step_speed") or {}).items()
                     if v and v["drift"] is not None)


def _or_na(n: int | None) -> str:
    return "n/a" if n is None else str(n)


def _print(s: dict) -> None:
    b = Bounds(**s["bounds"])
    print(f"\n{'candidate':<34}{'load':>6}{'TTFT p90 pred/meas ms':>24}{'ITL p90 pred/meas':>20}"
          f"{'goodput pred/meas':>20}")
    for row in s["rows"]:
        p, m, e = row["predicted"], row["measured"], row["error"]
        mark = " *" if row["recommended"] else ""
        note = _unjudged(row, b)
        print(f"{row['config'] + mark:<34}{row.get('load', math.nan):>6.0%}"
              f"{p['ttft_p90_ms']:>9.0f}/{m['ttft_p90_ms']:<6.0f}{e['ttft_p90_ms']:>+7.0%} "
              f"{p['itl_p90_ms']:>7.0f}/{m['itl_p90_ms']:<5.0f}{e['itl_p90_ms']:>+6.0%} "
              f"{p['goodput']:>7.3f}/{m['goodput']:<6.3f}{e['goodput']:>+6.0%}{note}")
    for row in s["rows"]:
        if speeds := _speeds(row):
            print(f"{row['config']}: its steps against the calibration it was predicted "
                  f"with: {speeds}")
    for row in s["rows"]:
        if "local_prefills" in row:
            lp = row["local_prefills"]
            fallback = f" (+ {lp['fallback']} after a prefill failure)" if lp["fallback"] else ""
            print(f"{row['config']}: prompts placed on the decode worker, predicted "
                  f"{_or_na(lp['predicted'])} / measured {_or_na(lp['measured'])}{fallback} "
                  f"of {lp['requests']}")
    if any(row.get("served_window") for row in s["rows"]):
        after = next(row["served_window"]["after_s"] for row in s["rows"]
                     if row.get("served_window"))
        print(f"\nrequests sent after {after:.0f} s, predicted with the waves' calibration "
              f"and with one fitted on the steps served before (errors):\n"
              f"{served_table(s['rows'])}")
    regret = "n/a" if s["regret"] is None else f"{s['regret']:.1%}"
    print(f"\nrecommended (*): {s['recommended']}; decision regret {regret}; search "
          f"{s['search_s']:.2f} s")
    for note in s["notes"]:
        print(f"note: {note}")
    print("validation " + ("passed" if not s["verdict"] else "FAILED: " + "; ".join(
        s["verdict"])))
