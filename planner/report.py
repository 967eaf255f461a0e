"""``pdserve plan``'s outputs of a :class:`~planner.search.PlanResult`: the table (one
row per candidate, the recommendation marked ``*``) and the PNG (goodput, TTFT p90,
ITL p90 and p99 per candidate, the recommendation highlighted; matplotlib, no display needed).
The JSON is :meth:`PlanResult.as_json`."""

from __future__ import annotations

import math
from pathlib import Path

from .search import PlanResult

_COLUMNS = (("TTFT p50", "ttft_p50_ms", ".0f"), ("TTFT p90", "ttft_p90_ms", ".0f"),
            ("ITL p90", "itl_p90_ms", ".1f"), ("ITL p99", "itl_p99_ms", ".1f"),
            ("TPOT p90", "tpot_p90_ms", ".1f"), ("goodput", "goodput", ".3g"),
            ("tok/s", "throughput", ".4g"), ("$/Mtok", "cost_per_mtok", ".4g"))


def _cell(v: object, fmt: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, fmt)


def table(result: PlanResult) -> str:
    unit = result.resources.kind[:-1]
    width = max(len(c.config.label) for c in result.candidates) + 2
    head = (f"  {'configuration':<{width}}{'slice':>8}"
            + "".join(f"{name:>10}" for name, _, _ in _COLUMNS))
    lines = [f"{result.resources.units} {result.resources.kind}, "
             f"{result.resources.price_per_unit_hour:g} per {unit}-hour; "
             f"{result.workload['description']}",
             "latencies in ms, goodput in requests/s meeting the SLOs"
             + ("" if result.slo is not None else " (no SLO given: every completed request)"),
             head]
    for c in result.candidates:
        mark = "*" if c.config == result.recommended else " "
        lines.append(f"{mark} {c.config.label:<{width}}{c.slice.label:>8}" + "".join(
            f"{_cell(c.predicted.get(key), fmt):>10}" for _, key, fmt in _COLUMNS))
    best = result.best.predicted
    lines.append(f"recommended (*): {result.recommended.label} — goodput {best['goodput']:.3g} "
                 f"req/s, TTFT p90 {best['ttft_p90_ms']:.0f} ms, ITL p90 "
                 f"{best['itl_p90_ms']:.1f} ms, {_cell(best['cost_per_mtok'], '.4g')} per "
                 "million output tokens")
    lines += [f"note: {n}" for n in result.notes]
    lines.append(f"searched {len(result.candidates)} candidates in {result.search_s:.2f} s")
    return "\n".join(lines)


def plot(result: PlanResult, png: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cands = result.candidates
    labels = [c.config.label for c in cands]
    colors = ["tab:orange" if c.config == result.recommended else "tab:blue" for c in cands]
    panels = (("goodput (req/s)", "goodput"), ("TTFT p90 (ms)", "ttft_p90_ms"),
              ("ITL p90 (ms)", "itl_p90_ms"), ("ITL p99 (ms)", "itl_p99_ms"))
    fig, axes = plt.subplots(1, len(panels), figsize=(20, 1.2 + 0.35 * len(cands)),
                             sharey=True)
    for ax, (title, key) in zip(axes, panels, strict=True):
        ax.barh(range(len(cands)), [c.predicted[key] for c in cands], color=colors)
        ax.set(title=title)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(cands)), labels)
    axes[0].invert_yaxis()
    fig.suptitle(f"pdserve plan: {result.resources.units} {result.resources.kind}; "
                 f"recommended {result.recommended.label}", fontsize=10)
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
