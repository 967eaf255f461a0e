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
worker's batch) of each cluster, beside the colocated one's.
"""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.metrics import percentile
from loadtest.plots import plot_sweeps

HIGH, LOW = 0.85, 0.25
LETTERS = {"colocated": "C", "static": "S", "split": "P", "capped": "K", "adaptive": "A"}
"""The clusters a run may have swept, in the table's column order, and their columns'
letters."""
TURNS = {"mixed": 1, "chat": 3}
"""Requests per session of each workload (a chat session is a 3-turn conversation)."""


def _load(out: Path, workload: str, seed: int, name: str) -> list[dict] | None:
    path = out / f"{workload}-s{seed}-{name}-sweep.json"
    return json.loads(path.read_text()) if path.exists() else None


def first_gap_ms(out: Path, workload: str, seed: int, name: str, fraction: float
                 ) -> tuple[float, float] | None:
    """Median and p99 of the first -> second token gap at one point (ms); None when the
    point's per-request file is not kept (only sweeps were saved)."""
    path = out / f"{workload}-s{seed}-{name}-f{fraction:g}.json"
    if not path.exists():
        return None
    times = json.loads(path.read_text())["details"]["token_times"]
    gaps = [(t[1] - t[0]) * 1e3 for t in times if len(t) >= 2]
    return percentile(gaps, 50), percentile(gaps, 99)


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
                rows.append({"workload": workload, "seed": seed, "fraction": c["fraction"],
                             "rate": c["rate"], "first_gap_ms_p50_p99": gaps,
                             **{f"{k}_{n}": p[k] for n, p in at.items()
                                for k in ("request_goodput", "p99_itl_ms", "p90_ttft_ms",
                                          "failed")},
                             "adaptive_roles": a.get("roles_after") if a else None,
                             "checks": verdicts})
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
