"""``pdserve bench-startup``: how long the process launcher takes to serve, and to bring
a killed component back, with the fork server (:mod:`cluster.forkserver`) and without
it (every component a fresh interpreter), in the same run.

Per repeat and mode, alternating so both see the same machine: start the cluster
(``pdserve up --launcher process``'s code: Redis, prefill and decode workers, two
routers) and time until every router serves; then, idle, SIGKILL a prefill worker, a
decode worker and a router in turn and time each from the signal until the component
runs again and every router lists every worker as serving (the chaos harness's
"back" figure, :func:`benchmarks.chaos_faults.wait_restored`). Medians per mode, the
ratio, the machine.
"""

from __future__ import annotations

import json
import signal
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.chaos_faults import wait_restored
from benchmarks.chaos_targets import ProcessTarget
from benchmarks.machine import machine_line
from cluster.local import LocalCluster, LocalClusterConfig, free_port

MODES = {"fork server": True, "fresh interpreters": False}
VICTIMS = ("prefill-0", "decode-0", "router-1")


@dataclass(frozen=True)
class StartupOptions:
    model: str
    prefill: int = 2
    decode: int = 2
    repeats: int = 3
    out: str | None = None


@dataclass
class Sample:
    mode: str
    up_s: float
    back_s: dict[str, float | None]


def _once(opts: StartupOptions, fork_server: bool, mode: str) -> Sample:
    config = LocalClusterConfig(model=opts.model, prefill=opts.prefill, decode=opts.decode,
                                port=free_port(), http_port=0, metrics_port=None,
                                kv_cache_gb=0.25, dtype="float32")
    start = time.monotonic()
    target = ProcessTarget(LocalCluster(config, routers=2, fork_server=fork_server))
    try:
        target.start()
        target.wait_ready(600)
        up = time.monotonic() - start
        back: dict[str, float | None] = {}
        for name in VICTIMS:
            before = target.cluster.restarts(name)
            target.cluster.proc(name).send_signal(signal.SIGKILL)
            back[name] = wait_restored(target, name, before)
        return Sample(mode, up, back)
    finally:
        target.stop()


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if len(got) == len(values) and got else None


def _fmt(v: float | None) -> str:
    return "never" if v is None else f"{v:.1f} s"


def report(samples: list[Sample], opts: StartupOptions) -> str:
    """A markdown table: per mode, median time to serve and to come back per victim,
    and fresh / fork-server ratios. Pure."""
    lines = [f"Machine: {machine_line()}. Model {Path(opts.model).name} fp32, "
             f"{opts.prefill} prefill + {opts.decode} decode workers, two routers, idle; "
             f"{opts.repeats} repeats per mode, alternating; medians.", "",
             "| mode | up (start -> serving) | " + " | ".join(
                 f"{v} back (kill -> listed)" for v in VICTIMS) + " |",
             "| --- " * (2 + len(VICTIMS)) + "|"]
    medians: dict[str, list[float | None]] = {}
    for mode in MODES:
        mine = [s for s in samples if s.mode == mode]
        row = [_median([s.up_s for s in mine])]
        row += [_median([s.back_s[v] for s in mine]) for v in VICTIMS]
        medians[mode] = row
        lines.append(f"| {mode} | " + " | ".join(map(_fmt, row)) + " |")
    fork, fresh = medians["fork server"], medians["fresh interpreters"]
    ratios = [f"{b / a:.1f}x" if a and b else "-" for a, b in zip(fork, fresh, strict=True)]
    lines.append("| fresh / fork server | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def run(opts: StartupOptions) -> str:
    samples = []
    for i in range(opts.repeats):
        for mode, fork_server in MODES.items():
            s = _once(opts, fork_server, mode)
            samples.append(s)
            print(f"[{i + 1}/{opts.repeats}] {mode}: up {s.up_s:.1f} s, back "
                  + ", ".join(f"{k} {_fmt(v)}" for k, v in s.back_s.items()), flush=True)
    table = report(samples, opts)
    print(table)
    if opts.out:
        out = Path(opts.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "startup.md").write_text(table + "\n")
        (out / "startup.json").write_text(json.dumps(
            {"machine": machine_line(), "options": asdict(opts),
             "samples": [asdict(s) for s in samples]}, indent=2))
    return table
