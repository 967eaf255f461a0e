"""``pdserve plan --validate``'s second prediction of each candidate: from the steps it
served, as the live planner predicts.

The first prediction (:mod:`benchmarks.plan_validate`) uses the serving calibration
measured in three short waves right before the candidate runs. The live planner
(``pdserve up --autoscale``) instead refits that calibration on the steps the workers
served in the last minutes (:func:`common.served_fit.fit_served`) and predicts the next.
This does the same with a validation run: the candidate's own step traces of its first
``after_s`` seconds fit the calibration (every role's steps together, and each role's
own where they make one); the simulator then runs the whole workload with
it, and the requests sent after ``after_s`` are compared, predicted against measured,
beside the waves' prediction of those same requests. Both predictions see the same
requests and the same machine minutes, so their errors compare directly.

A window's figures: TTFT and ITL p90 of its requests, and its goodput, the requests
meeting the SLOs over the time from ``after_s`` to its last token.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.cost_model import Profile
from common.served_fit import ServedFitError, fit_served_roles
from loadtest.metrics import SLO, RequestRecord, compute_metrics
from planner.config import PoolConfig
from planner.predict import run as simulate_run
from workers.step_trace import TracedStep

FIGURES = ("ttft_p90_ms", "itl_p90_ms", "goodput")


def measured_records(run_json: str | Path) -> list[RequestRecord]:
    """The completed requests of a ``pdserve bench`` run file (its ``details``), times
    from the run's start."""
    d = json.loads(Path(run_json).read_text())["details"]
    return [RequestRecord(sent, token_times=list(times), output_tokens=n)
            for sent, times, n in zip(d["sent"], d["token_times"], d["output_tokens"],
                                      strict=True)]


def window_figures(records: list[RequestRecord], after_s: float, slo: SLO | None) -> dict:
    """TTFT and ITL p90 (ms) and goodput (requests/s meeting ``slo``; without one, every
    completed request) of the requests sent at or after ``after_s``."""
    later = [r for r in records if r.sent >= after_s and r.ok]
    if not later:
        return {k: float("nan") for k in FIGURES} | {"requests": 0}
    duration = max(r.token_times[-1] for r in later) - after_s
    m = compute_metrics(later, duration, slo)
    good = m["request_goodput"] if slo is not None else m["request_throughput"]
    return {"ttft_p90_ms": m["p90_ttft_ms"], "itl_p90_ms": m["p90_itl_ms"], "goodput": good,
            "requests": len(later)}


def _error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else float("nan")


def served_prediction(now: Profile, engine_only: Profile, config: PoolConfig, threads: int,
                      requests: list, arrivals: list[float], slo: SLO | None,
                      steps: list[tuple[str, TracedStep]], started: float,
                      run_json: str | Path,
                      after_s: float) -> dict:
    """The window after ``after_s`` of one validated candidate: measured, predicted with
    ``now`` (the waves' calibration) and with the calibration fitted on ``steps`` (every
    worker's, with its role; unix times) that started in the run's first ``after_s``
    (``started``: its start), each prediction's error."""
    measured = window_figures(measured_records(run_json), after_s, slo)
    if not measured["requests"]:
        return {"after_s": after_s, "started": started, "requests": 0, "fit": None,
                "refused": f"no request was sent after {after_s:g} s"}
    waves = window_figures(simulate_run(now, config, requests, arrivals).records, after_s, slo)
    out: dict = {"after_s": after_s, "started": started, "requests": measured.pop("requests"),
                 "measured": measured, "predicted_waves": waves,
                 "error_waves": {k: _error(waves[k], measured[k]) for k in FIGURES}}
    before = [(role, s.seconds, s.sums) for role, s in steps
              if s.start_unix_s < started + after_s]
    try:
        fit = fit_served_roles(engine_only.steps[threads], threads, before)
    except ServedFitError as e:
        return out | {"fit": None, "refused": str(e)}
    served = window_figures(simulate_run(fit.apply(now), config, requests, arrivals).records,
                            after_s, slo)
    return out | {"fit": fit.describe(), "predicted": served,
                  "error": {k: _error(served[k], measured[k]) for k in FIGURES}}


def table(rows: list[dict]) -> str:
    """Per candidate: the window's measured figures and both predictions' errors."""
    lines = [f"{'candidate':<40}{'reqs':>5}{'TTFT p90 meas':>14}{'waves':>8}{'served':>8}"
             f"{'ITL p90 meas':>13}{'waves':>8}{'served':>8}{'goodput':>9}{'waves':>8}"
             f"{'served':>8}"]
    for row in rows:
        s = row.get("served_window")
        if not s or not s["requests"]:
            continue
        m, w, e = s["measured"], s["error_waves"], s.get("error") or {}

        def pct(d: dict, k: str) -> str:
            return f"{d[k]:+.0%}" if k in d else "n/a"

        lines.append(f"{row['config']:<40}{s['requests']:>5}{m['ttft_p90_ms']:>12.0f}ms"
                     f"{pct(w, 'ttft_p90_ms'):>8}{pct(e, 'ttft_p90_ms'):>8}"
                     f"{m['itl_p90_ms']:>11.1f}ms{pct(w, 'itl_p90_ms'):>8}"
                     f"{pct(e, 'itl_p90_ms'):>8}{m['goodput']:>9.3f}{pct(w, 'goodput'):>8}"
                     f"{pct(e, 'goodput'):>8}")
    for row in rows:
        s = row.get("served_window")
        if s:
            lines.append(f"{row['config']}: served calibration "
                         f"{s['fit'] or 'refused: ' + s['refused']}")
    return "\n".join(lines)
