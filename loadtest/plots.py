"""PNG plots of runs and sweeps (matplotlib, no display needed).

- :func:`plot_run`: one run's latency CDFs (TTFT, TPOT, ITL, E2EL), output throughput
  over time (1 s bins) and queue depth over time (the server's waiting / running /
  reserved requests where the backend reports them, else requests in flight as the
  client sees them);
- :func:`plot_sweeps`: goodput (or throughput), ITL p99, TPOT p99 and TTFT p99 against
  request rate, one line per sweep;
- :func:`compare`: ``pdserve bench --compare A.json B.json ...``: runs side by side (CDFs
  overlaid, and a table of the headline figures with each run's ratio to the first), or
  sweeps side by side.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_CDFS = (("ttfts", "TTFT"), ("tpots", "TPOT"), ("itls", "ITL"), ("e2els", "E2E latency"))


def _cdf(ax, seconds: list[float], label: str) -> None:  # noqa: ANN001 - an Axes
    ms = sorted(v * 1e3 for v in seconds if v is not None)
    if ms:
        ax.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], label=label)


def _finish(fig, png: Path) -> Path:  # noqa: ANN001 - a Figure
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def plot_run(result: dict, png: str | Path, label: str = "") -> Path:
    d = result["details"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title) in zip(axes.flat[:4], _CDFS, strict=True):
        _cdf(ax, d[key], label or "run")
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of requests"
               if key != "itls" else "fraction of gaps")
        ax.grid(alpha=0.3)
    ax = axes.flat[4]
    times = [t for ts in d["token_times"] for t in ts]
    if times:
        bins = max(1, math.ceil(max(times)))
        counts = [0] * bins
        for ts, n in zip(d["token_times"], d["output_tokens"], strict=True):
            per = n / len(ts) if ts else 0  # a message may carry several tokens
            for t in ts:
                counts[min(int(t), bins - 1)] += per
        ax.step(range(bins), counts, where="post")
    ax.set(title="Output throughput over time", xlabel="s", ylabel="tokens / s")
    ax.grid(alpha=0.3)
    ax = axes.flat[5]
    if d["queue"]:
        t = [q[0] for q in d["queue"]]
        for i, name in ((1, "waiting"), (2, "running"), (3, "reserved")):
            ax.plot(t, [q[i] for q in d["queue"]], label=name)
        ax.set(title="Server queue depth (all workers)")
    else:
        edges = sorted([(s, 1) for s in d["sent"]]
                       + [(ts[-1], -1) for ts in d["token_times"] if ts])
        level, xs, ys = 0, [], []
        for x, step in edges:
            level += step
            xs.append(x)
            ys.append(level)
        ax.step(xs, ys, where="post", label="in flight")
        ax.set(title="Requests in flight (client view)")
    ax.set(xlabel="s", ylabel="requests")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.suptitle(f"{label or Path(png).stem}: {result.get('completed')} requests, "
                 f"{result.get('request_throughput', 0):.2f} req/s, "
                 f"{result.get('output_throughput', 0):.1f} tok/s")
    return _finish(fig, Path(png))


def plot_sweeps(sweeps: dict[str, list[dict]], png: str | Path) -> Path:
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    goodput = all("request_goodput" in p for pts in sweeps.values() for p in pts)
    panels = (("request_goodput" if goodput else "request_throughput",
               "Goodput (req/s meeting the SLOs)" if goodput else "Throughput", "req/s"),
              ("p99_itl_ms", "ITL p99", "ms"), ("p99_tpot_ms", "TPOT p99", "ms"),
              ("p99_ttft_ms", "TTFT p99", "ms"))
    for ax, (key, title, unit) in zip(axes, panels, strict=True):
        for label, pts in sweeps.items():
            pts = sorted(pts, key=lambda p: p["request_rate"])
            ax.plot([p["request_rate"] for p in pts], [p[key] for p in pts], marker="o",
                    label=label)
        ax.set(title=title, xlabel="request rate (req/s)", ylabel=unit)
        if unit == "ms":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    return _finish(fig, Path(png))


def compare(paths: list[str], png: str | Path) -> tuple[Path, str]:
    """Plot runs (or sweeps) side by side; returns the PNG and a text table."""
    loaded = {Path(p).stem: json.loads(Path(p).read_text()) for p in paths}
    if all(isinstance(v, list) for v in loaded.values()):
        out = plot_sweeps(loaded, png)
        keys = ("request_throughput", "request_goodput", "p99_itl_ms", "p99_tpot_ms",
                "p99_ttft_ms")
        lines = [f"{'run':24}{'rate':>7}" + "".join(f"{k:>20}" for k in keys)]
        for label, pts in loaded.items():
            for p in sorted(pts, key=lambda p: p["request_rate"]):
                lines.append(f"{label:24}{p['request_rate']:>7g}" + "".join(
                    f"{p.get(k, float('nan')):>20.2f}" for k in keys))
        return out, "\n".join(lines)
    if any(isinstance(v, list) or "details" not in v for v in loaded.values()):
        raise ValueError("compare runs written by `pdserve bench --out` (with details) with "
                         "each other, or sweep files (*-sweep.json) with each other")
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    for ax, (key, title) in zip(axes, _CDFS, strict=True):
        for label, run in loaded.items():
            _cdf(ax, run["details"][key], label)
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    out = _finish(fig, Path(png))
    keys = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "request_goodput")
    first = next(iter(loaded.values()))
    names = list(loaded)
    lines = [f"{'metric':22}" + "".join(f"{n[:18]:>20}" for n in names)]
    for k in keys:
        if k not in first:
            continue
        cells = []
        for n in names:
            v = loaded[n].get(k, float("nan"))
            ratio = v / first[k] if first[k] else float("nan")
            cells.append(f"{v:>11.2f}" + (f" ({ratio:4.2f}x)" if n != names[0] else " " * 8))
        lines.append(f"{k:22}" + "".join(f"{c:>20}" for c in cells))
    return out, "\n".join(lines)
