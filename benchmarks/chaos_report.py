"""``pdserve chaos``'s report: the table per fault type, the targets it is held to, the
JSON and a plot of TTFT around each fault.

Targets (issue 17): no wrong, missing or duplicated token anywhere; no client-visible
failure for worker and Redis faults (the cluster has a spare of each worker role) nor
for a router's death (the client resumes on the other router); TTFT p99 back within
20% of its pre-fault value in at most 10 s (pooled over the scenario's faults:
:func:`benchmarks.chaos_oracle.pooled_recovery_s`); no leaked KV block.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .chaos_faults import REDIS_FAULTS, WORKER_FAULTS

RECOVERY_TARGET_S = 10.0
NO_FAILURES = (*WORKER_FAULTS, *REDIS_FAULTS, "kill-router", "flip-kv", "none", "cancel")

HEADER = ("| fault | faults | requests | failures | wrong / missing / dup. streams | "
          "cancelled | migrations | resumes | TTFT p99 before (pooled) | recovery s "
          "(pooled; per fault median / worst) | back s (median / worst) | leaked blocks | "
          "restarts | KV transfers refused |\n" + "|---" * 14 + "|")


def _median_worst(values: list[float]) -> str:
    """``median / worst`` seconds; one value alone as itself."""
    ordered = sorted(values)
    worst = f"{ordered[-1]:.1f}"
    return f"{ordered[len(ordered) // 2]:.1f} / {worst}" if len(ordered) > 1 else worst


def _pooled(row: dict) -> str:
    """The scenario's recovery (pooled over its faults)."""
    pooled = row.get("pooled_recovery_s")
    return "not back" if pooled is None else f"{pooled:.1f}"


def _recovery(row: dict) -> str:
    """The pooled recovery; then per fault the median / worst of those measured, and
    how many were not back when their load ended."""
    per = row.get("recovery_s") or []
    got = [r for r in per if r is not None]
    text = _pooled(row) + (f"; {_median_worst(got)}" if got else "")
    missing = len(per) - len(got)
    return text + (f", {missing} not back" if missing else "")


def _restored(row: dict) -> str:
    """Median / worst seconds from a kill until the component serves again ("-" when
    the scenario kills nothing)."""
    done = row.get("restored_s") or []
    if not done:
        return "-"
    if any(r is None for r in done):
        return f"{sum(r is None for r in done)} not back"
    return _median_worst(done)


def _baseline(row: dict) -> str:
    b = row.get("baseline_ttft_s")
    return "-" if b is None else f"{b * 1e3:.0f} ms"


def table(report: dict) -> str:
    lines = [HEADER]
    for shape in report["shapes"]:
        for r in shape["rows"]:
            lines.append(
                f"| {r['scenario']} | {r['faults']} | {r['sent']} | {r['failures']} | "
                f"{r['wrong']} / {r['missing']} / {r['duplicated']} | {r['cancelled']} | "
                f"{r['migrations']} | {r['resumes']} | {_baseline(r)} | {_recovery(r)} | "
                f"{_restored(r)} | "
                f"{r['leaked_blocks']} | {r['restarts']} | {r['failed_transfers']} |")
    return "\n".join(lines)


def failed_checks(report: dict) -> list[str]:
    """Every target missed, one line each ([] when all are met)."""
    out = []
    for shape in report["shapes"]:
        for r in shape["rows"]:
            s = r["scenario"]
            if r["bad_tokens"]:
                out.append(f"{s}: {r['bad_tokens']} streams with wrong, missing or "
                           "duplicated tokens")
            if r["leaked_blocks"]:
                out.append(f"{s}: {r['leaked_blocks']} KV blocks leaked")
            if s in NO_FAILURES and r["failures"]:
                out.append(f"{s}: {r['failures']} client-visible failures {r['errors']}")
            if any(x is None for x in r.get("restored_s") or []):
                out.append(f"{s}: {_restored(r)} (the killed component did not serve "
                           "again within 120 s)")
            pooled = r.get("pooled_recovery_s")
            if r["faults"] and (pooled is None or pooled > RECOVERY_TARGET_S):
                out.append(f"{s}: TTFT p99 recovered in {_pooled(r)} s, pooled over its "
                           f"faults (target {RECOVERY_TARGET_S:.0f} s)")
    return out


def plot(report: dict, png: Path) -> Path:
    """TTFT by arrival time relative to the fault, one panel per scenario; failures
    drawn at the top in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(shape["shape"], s, pts) for shape in report["shapes"]
              for s, pts in shape["outcomes"].items()]
    cols = min(3, len(panels)) or 1
    rows = math.ceil(len(panels) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, (shape, scenario, pts) in zip(axes.flat, panels, strict=False):
        ok = [(p["t"], p["ttft_s"] * 1e3) for p in pts if p["ttft_s"] is not None]
        top = max((v for _, v in ok), default=1.0) * 1.1
        ax.scatter([t for t, _ in ok], [v for _, v in ok], s=6)
        bad = [p["t"] for p in pts if p["error"] and not p["cancelled"]]
        ax.scatter(bad, [top] * len(bad), s=14, color="red", marker="x", label="failed")
        ax.axvline(0.0, color="grey", linestyle="--")
        ax.set_title(f"{scenario} ({shape})")
        ax.set_xlabel("arrival - fault (s)")
        ax.set_ylabel("TTFT (ms)")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def write(report: dict, out_dir: str | Path, header: str) -> tuple[str, list[str]]:
    """``chaos.json``, ``chaos.md`` and ``chaos-ttft.png`` under ``out_dir``; returns the
    markdown and the missed targets."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    missed = failed_checks(report)
    lines = [header, ""]
    for shape in report["shapes"]:
        lines.append(f"- {shape['shape']}: capacity {shape['capacity_rps']:.2f} req/s, load "
                     f"{shape['rate_rps']:.2f} req/s")
    lines += ["", table(report), "",
              "Targets: " + ("all met" if not missed else "MISSED:\n- " + "\n- ".join(missed))]
    notes = [f"- {r['scenario']}: {n}" for shape in report["shapes"] for r in shape["rows"]
             for n in r["notes"]]
    if notes:
        lines += ["", "Notes:", *notes]
    md = "\n".join(lines) + "\n"
    (out / "chaos.md").write_text(md)
    (out / "chaos.json").write_text(json.dumps({**report, "missed": missed}, indent=1))
    plot(report, out / "chaos-ttft.png")
    return md, missed
