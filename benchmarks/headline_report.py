"""The headline's tables, target checks and plots, from the files a run wrote (so
``--report-only`` re-tabulates a run without serving anything).

Per workload and seed, one row per rate: goodput (requests/s meeting both SLOs), ITL
p99, TTFT p90 of colocated (C), static 1P+1D (S), and where they ran, the split with
live placement (P) and capped (K) (:data:`benchmarks.headline.CLUSTERS`), and adaptive
(A), and the adaptive cluster's roles when the point ended. Then the issue's targets,
each row marked:

- goodput(A) >= max(C, S) - 5%, at every rate;
- where colocated saturates (a high load, fraction >= 0.85, where its goodput is below
  80% of the offered rate: the capacity measured in a closed loop is a floor, so a
  fraction above 1 need not saturate it; and at a low load a few long prompts past the
  TTFT SLO among 20 requests put goodput below 80% of a rate nothing saturates at):
  goodput(A) >= 1.5 x C;
- decode ITL p99 of A <= 0.5 x C at high load (fraction >= 0.85) and <= 1.1 x C at low
  load (fraction <= 0.25).

And the first -> second token gap (median and p99 over the point's requests; a
disaggregated request's includes its KV transfer and its admission into the decode
worker's batch) of each cluster, beside the colocated one's; and the ITL p99 ratio
A/C with a bootstrap interval (:func:`itl_p99_ratio`): a target is checked on the
ratio itself, the interval says how far one run can be trusted.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from loadtest.metrics import percentile
from loadtest.plots import plot_sweeps

HIGH, LOW = 0.85, 0.25
LETTERS = {"colocated": "C", "static": "S", "split": "P", "capped": "K", "adaptive": "A"}
"""The clusters a run may have swept, in the table's column order, and their columns'
letters."""
ITL_RATIOS = "ITL p99 A/C, 90% interval (requests resampled)"
"""The line after each seed's table that gives the ratios and their intervals."""
TURNS = {"mixed": 1, "chat": 3}
"""Requests per session of each workload (a chat session is a 3-turn conversation)."""


def _load(out: Path, workload: str, seed: int, name: str) -> list[dict] | None:
    path = out / f"{workload}-s{seed}-{name}-sweep.json"
    return json.loads(path.read_text()) if path.exists() else None


def first_gap_ms(out: Path, workload: str, seed: int, name: str, fraction: float
                 ) -> tuple[float, float] | None:
    """Median and p99 of the first -> second token gap at one point (ms); None when the
    point's per-request file is not kept (only sweeps were saved)."""
    per_request = _gaps(out, workload, seed, name, fraction)
    if per_request is None:
        return None
    firsts = [float(g[0]) for g in per_request]
    return percentile(firsts, 50), percentile(firsts, 99)


def _gaps(out: Path, workload: str, seed: int, name: str, fraction: float
          ) -> list[np.ndarray] | None:
    """Each request's inter-token gaps (ms) at one point; None: no per-request file."""
    path = out / f"{workload}-s{seed}-{name}-f{fraction:g}.json"
    if not path.exists():
        return None
    times = json.loads(path.read_text())["details"]["token_times"]
    return [np.diff(np.asarray(t, dtype=float)) * 1e3 for t in times if len(t) >= 2]


def itl_p99_ratio(out: Path, workload: str, seed: int, name: str, fraction: float,
                  base: str = "colocated", draws: int = 1000, level: float = 0.9,
                  rng_seed: int = 0) -> tuple[float, float, float] | None:
    """``name``'s decode ITL p99 over ``base``'s at one point, and a ``level`` bootstrap
    interval of that ratio: each draw resamples each cluster's requests with
    replacement (a request's gaps stay together) and takes the p99 of the gaps drawn.
    One run per point cannot tell a ratio from run-to-run spread otherwise: on a 2-core
    EPYC, two mixed workers alone served the chat headline's 25% point at 23-29 ms ITL
    p99 in turn (``loadtest/results/planner-priority-ab-epyc-1206/``). It is narrower
    than that spread, as requests that overlap in time share their stalls and a
    request-level draw treats them as independent: a floor on the uncertainty, not its
    measure. None: a point's per-request file is missing, or it has no gaps."""
    ours, theirs = (_gaps(out, workload, seed, n, fraction) for n in (name, base))
    if not ours or not theirs:
        return None

    def p99(reqs: list[np.ndarray], pick: np.ndarray | None = None) -> float:
        chosen = reqs if pick is None else [reqs[i] for i in pick]
        return float(np.percentile(np.concatenate(chosen), 99))

    rng = np.random.default_rng(rng_seed)
    ratios = []
    for _ in range(draws):
        below = p99(theirs, rng.integers(0, len(theirs), len(theirs)))
        ratios.append(p99(ours, rng.integers(0, len(ours), len(ours))) / below
                      if below > 0 else math.inf)
    lo, hi = np.percentile(ratios, [50 * (1 - level), 50 * (1 + level)])
    mid = p99(theirs)
    return (p99(ours) / mid if mid > 0 else math.inf), float(lo), float(hi)


def checks(c: dict, s: dict, a: dict, turns: int = 1) -> dict[str, bool | None]:
    """The targets of one rate point (None: does not apply at this load); ``turns``:
    requests per session (the rate is of sessions, goodput of requests)."""
    f = c["fraction"]
    offered = c["rate"] * turns
    best = max(c["request_goodput"], s["request_goodput"])
    out: dict[str, bool | None] = {
        "goodput >= best - 5%": a["request_goodput"] >= 0.95 * best,
        "goodput >= 1.5 x colocated (saturated)": (
            a["request_goodput"] >= 1.5 * c["request_goodput"])
        if f >= HIGH and c["request_goodput"] < 0.8 * offered else None,
        "ITL p99 <= 0.5 x colocated (high load)": (
            a["p99_itl_ms"] <= 0.5 * c["p99_itl_ms"]) if f >= HIGH else None,
        "ITL p99 <= 1.1 x colocated (low load)": (
            a["p99_itl_ms"] <= 1.1 * c["p99_itl_ms"]) if f <= LOW else None,
    }
    return out


def report(out: Path, workloads: tuple[str, ...], seeds: tuple[int, ...],
           options: dict | None = None) -> dict:
    """Tabulate, check and plot the run in ``out`` (``options``: saved beside it)."""
    rows, met, total = [], 0, 0
    for workload in workloads:
        cal_path = out / f"{workload}-calibration.json"
        if not cal_path.exists():
            print(f"{workload}: no calibration in {out}; skipped")
            continue
        cal = json.loads(cal_path.read_text())
        print(f"\n### {workload}: capacity {cal['capacity_req_s']:.3f} req/s "
              f"({cal['capacity_sessions_s']:.3f} sessions/s); SLOs TTFT <= "
              f"{cal['slo_ttft_ms']:.0f} ms, TPOT <= {cal['slo_tpot_ms']:.1f} ms")
        for seed in seeds:
            sweeps = {n: pts for n in LETTERS
                      if (pts := _load(out, workload, seed, n)) is not None}
            if "colocated" not in sweeps:
                print(f"seed {seed}: no colocated sweep, nothing to compare with")
                continue
            missing = [n for n in ("static", "adaptive") if n not in sweeps]
            if missing:
                print(f"seed {seed}: missing sweeps ({', '.join(missing)}): "
                      + ("no targets checked" if "adaptive" in missing else
                         "the better baseline is colocated's"))
            names = list(sweeps)
            letters = " / ".join(LETTERS[n] for n in names)
            width = len(names)
            print(f"\nseed {seed}\n{'load':>5} {'rate/s':>7} | "
                  f"{'goodput ' + letters:>{7 * width - 1}} | "
                  f"{'ITL p99 ms ' + letters:>{7 * width + 1}} | "
                  f"{'TTFT p90 ms ' + letters:>{8 * width}} | "
                  f"{'A roles':>16} | targets")
            fractions = [p["fraction"] for p in sweeps["colocated"]]
            ratios: list[str] = []
            by = {n: {p["fraction"]: p for p in pts} for n, pts in sweeps.items()}
            for f in fractions:
                if any(f not in by[n] for n in names):
                    print(f"{f:>5.0%} not swept by "
                          + ", ".join(n for n in names if f not in by[n]))
                    continue
                points = [by[n][f] for n in names]
                at = dict(zip(names, points, strict=True))
                c, a = at["colocated"], at.get("adaptive")
                verdicts = checks(c, at.get("static", c), a, TURNS[workload]) if a else {}
                applicable = {k: v for k, v in verdicts.items() if v is not None}
                met += sum(applicable.values())
                total += len(applicable)
                marks = " ".join("ok" if v else "MISS" for v in applicable.values())
                roles = "+".join(sorted(a.get("roles_after", []))) + (
                    f" c{a['prefill_cap_after']}" if a.get("prefill_cap_after") else ""
                ) if a else "-"
                last = len(points) - 1
                print(f"{c['fraction']:>5.0%} {c['rate']:>7.3f} | "
                      + " ".join(f"{p['request_goodput']:>6.3f}" for p in points) + " | "
                      + " ".join(f"{p['p99_itl_ms']:>{6 + (i == last)}.0f}"
                                 for i, p in enumerate(points)) + " | "
                      + " ".join(f"{p['p90_ttft_ms']:>{7 + (i == last)}.0f}"
                                 for i, p in enumerate(points))
                      + f" | {roles:>16} | {marks}")
                gaps = {n: first_gap_ms(out, workload, seed, n, c["fraction"]) for n in names}
                if all(g is not None for g in gaps.values()):
                    print(f"{'':>14}first->second token gap p50/p99 ms: " + ", ".join(
                        f"{n} {g[0]:.0f}/{g[1]:.0f}" for n, g in gaps.items()))
                ratio = (itl_p99_ratio(out, workload, seed, "adaptive", c["fraction"])
                         if a else None)
                if ratio is not None:
                    ratios.append(f"{c['fraction']:.0%} {ratio[0]:.2f}x "
                                  f"({ratio[1]:.2f}-{ratio[2]:.2f})")
                rows.append({"workload": workload, "seed": seed, "fraction": c["fraction"],
                             "rate": c["rate"], "first_gap_ms_p50_p99": gaps,
                             **{f"{k}_{n}": p[k] for n, p in at.items()
                                for k in ("request_goodput", "p99_itl_ms", "p90_ttft_ms",
                                          "failed")},
                             "adaptive_roles": a.get("roles_after") if a else None,
                             "itl_p99_ratio_interval": list(ratio[1:]) if ratio else None,
                             "checks": verdicts})
            if ratios:
                print(f"{ITL_RATIOS}: " + ", ".join(ratios))
            for pts in sweeps.values():
                for p in pts:
                    p["request_rate"] = p["rate"]
            plot_sweeps(sweeps, out / f"headline-{workload}-s{seed}.png")
    print(f"\ntargets met: {met} of {total}")
    summary = {"options": options or {}, "rows": rows,
               "targets_met": met, "targets": total}
    (out / "headline.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {out / 'headline.json'} and headline-*.png")
    return summary
