"""``pdserve bench-harness``: pdserve's own load tester (``pdserve bench``, ``loadtest/``)
against the field's (guidellm, aiperf, ``vllm bench serve``) on the same server, one
after the other, with the same workload; one table of their figures and ratios.

Lifecycle: a running OpenAI-compatible server (``target``), or a local cluster started
here (``cluster.local``: one mixed worker, or 1 prefill + 1 decode; a core left to the
load testers) -> the served model's name (``/v1/models``) -> a warm-up: one whole
pdserve bench run with other prompts, not compared (a fresh server's first batches
run slower) -> pdserve bench #1 (:mod:`loadtest.runner`, in this process; random ids
of the served vocabulary, :mod:`loadtest.vocab`) -> for each external tool found
(:mod:`benchmarks.external_tools`): the tool, as its own process (its output and its
console, ``tool.log``, in ``work_dir/<tool>``), then pdserve bench again -> the table:
every run in the order they ran, each external figure also as a ratio to the mean of
the pdserve bench runs just before and after it (they saw the same load on the
machine: another job's, the last tool's leftovers) -> ``out``: the JSON of it all ->
the cluster, if started here, stops. A tool not found is listed as skipped with the
reason; one that fails, with its log's last line.

The harnesses share the server, never the time: each runs alone. Their prompts differ
(pdserve bench sends token ids, the others text cut to ``input_len`` tokens by the
model's tokenizer), their shape does not; every run gets fresh prompts (seeds differ),
so none finds another's in the prefix cache.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.machine import cpu_name
from cluster.local import LocalCluster, LocalClusterConfig, free_port
from loadtest import vocab
from loadtest.metrics import compute_metrics
from loadtest.runner import RunOptions, drive
from loadtest.workloads import random_workload
from workers.engine.dtype_choice import resolve_dtype

from .external_tools import ENV_VARS, TOOLS, Figures, Target, Workload, locate
from .vllm_server import models

TOPOLOGIES: dict[str, dict[str, int]] = {"mixed": {"mixed": 1},
                                         "disagg": {"prefill": 1, "decode": 1}}
PDSERVE = "pdserve bench"


@dataclass(frozen=True)
class HarnessOptions:
    """Checked at construction. ``tools``: name -> the executable given (CLI flag or
    environment), None to look on ``PATH``; tools left out are not run."""

    workload: Workload
    target: str | None = None
    """http://HOST:PORT of a running server; None: start a local cluster on ``model``."""
    model: str | None = None
    """The checkpoint directory of the cluster started here."""
    tokenizer: str | None = None
    """What the external tools count tokens with; default ``model``."""
    topology: str = "mixed"
    dtype: str = "auto"
    threads: int | None = None
    """Per worker of the cluster started here; None: the cores less one, split among
    the workers (the load testers get a core of their own: on 2 cores, a server using
    both ran 5x slower per token under aiperf, whose processes took its cores)."""
    kv_cache_gb: float = 1.0
    tools: dict[str, str | None] = field(default_factory=lambda: {
        "guidellm": None, "aiperf": None, "vllm": None})
    timeout_s: float = 1800.0
    """Per external tool."""
    work_dir: str = "bench-results/external-harness"
    out: str | None = None

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {', '.join(TOPOLOGIES)}, got "
                             f"{self.topology!r}")
        if self.target is None and self.model is None:
            raise ValueError("give a target (http://HOST:PORT) or a model to start")
        if self.target is not None and not self.target.startswith(("http://", "https://")):
            raise ValueError(f"target must be an OpenAI-compatible http(s):// URL (the "
                             f"external tools speak only HTTP), got {self.target!r}")
        unknown = sorted(set(self.tools) - set(TOOLS))
        if unknown:
            raise ValueError(f"unknown tools {unknown}; known: {', '.join(TOOLS)}")


@dataclass
class HarnessRun:
    """One harness's entry: its figures, or why there are none."""

    harness: str
    figures: Figures | None = None
    version: str | None = None
    skipped: str | None = None
    error: str | None = None
    command: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    client_cpu_s: float | None = None
    """CPU seconds the harness itself spent (a tool: its process tree, start-up
    included; pdserve bench: this process during its run): what it took from the
    server's cores."""
    ratio: dict[str, float | None] = field(default_factory=dict)
    """External tools: each figure over the mean of the pdserve bench runs just before
    and just after it (``baseline``), which share its load on the machine."""
    baseline: list[str] = field(default_factory=list)


# -- pdserve bench ------------------------------------------------------------------------

def _pdserve_bench(w: Workload, url: str, model: str, token_ids: list[int], seed: int,
                   n: int, output_len: int) -> Figures:
    reqs = random_workload(n, w.input_len, output_len, 0.0, seed, token_ids)
    opts = RunOptions(url, tuple(reqs), tuple(0.0 for _ in reqs), w.max_concurrency,
                      progress=False, model=model)
    trace = asyncio.run(drive(opts))
    m = compute_metrics(trace.records, trace.duration, percentiles=(50, 90))
    done = max(1, m["completed"])
    return Figures(completed=m["completed"], failed=m["failed"], duration_s=m["duration"],
                   output_throughput=m["output_throughput"],
                   mean_input_tokens=m["total_input_tokens"] / done,
                   mean_output_tokens=m["total_output_tokens"] / done,
                   ttft_p50_ms=m["median_ttft_ms"], ttft_p90_ms=m["p90_ttft_ms"],
                   tpot_p50_ms=m["median_tpot_ms"], e2el_p50_ms=m["median_e2el_ms"])


class PdserveBench:
    """pdserve bench's runs, in this process, on ``url``: a warm-up, then one measured
    run before the first tool and one after each (fresh prompts every time: no run
    finds another's in the prefix cache)."""

    def __init__(self, w: Workload, url: str, model: str) -> None:
        self.w, self.url, self.model = w, url, model
        self.token_ids = list(vocab.server_token_ids(url, model=model))
        self.runs = 0

    def warm_up(self) -> Figures:
        """A whole run of the workload's shape with other prompts, not compared: a
        fresh server's first batches run slower (seen: 4x on the tiny test model)."""
        w = self.w
        return _pdserve_bench(w, self.url, self.model, self.token_ids, w.seed + 1_000_003,
                              w.num_requests, w.output_len)

    def measure(self) -> HarnessRun:
        self.runs += 1
        start, cpu = time.monotonic(), time.process_time()
        w = self.w
        figures = _pdserve_bench(w, self.url, self.model, self.token_ids,
                                 w.seed + self.runs - 1, w.num_requests, w.output_len)
        return HarnessRun(f"{PDSERVE} #{self.runs}", figures,
                          command=["(in process) loadtest.runner.drive"],
                          wall_s=time.monotonic() - start,
                          client_cpu_s=time.process_time() - cpu)


# -- the external tools -------------------------------------------------------------------

def _run_tool(name: str, exe: str | None, why: str, w: Workload, t: Target, work: Path,
              timeout_s: float, log: Callable[[str], None]) -> HarnessRun:
    tool = TOOLS[name]
    if exe is None:
        log(f"{tool.name}: skipped ({why})")
        return HarnessRun(tool.name, skipped=why)
    out_dir = work / name
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = tool.command(exe, w, t, out_dir)
    run = HarnessRun(tool.name, command=cmd)
    log(f"{tool.name}: {w.num_requests} requests ({exe}; console in {out_dir / 'tool.log'})")
    start, cpu = time.monotonic(), _children_cpu_s()
    try:
        with open(out_dir / "tool.log", "wb") as console:
            done = subprocess.run(cmd, env=tool.env(dict(os.environ)), stdout=console,
                                  stderr=subprocess.STDOUT, timeout=timeout_s,
                                  stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        run.error = f"did not finish within {timeout_s:.0f} s; see {out_dir / 'tool.log'}"
        return run
    except OSError as e:
        run.error = f"could not start {exe}: {e}"
        return run
    finally:
        run.wall_s = time.monotonic() - start
        run.client_cpu_s = _children_cpu_s() - cpu
    if done.returncode != 0:
        run.error = (f"exited with {done.returncode}: {_last_line(out_dir / 'tool.log')} "
                     f"(all of it: {out_dir / 'tool.log'})")
        return run
    try:
        run.figures, run.version = tool.parse(out_dir)
    except ValueError as e:
        run.error = str(e)
    return run


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's waited-for children so far (a
    tool's whole process tree, once it has exited and been waited for)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines()]
    except OSError:
        return "(no output)"
    return next((ln for ln in reversed(lines) if ln), "(no output)")[:300]


# -- the table ----------------------------------------------------------------------------

COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("output_throughput", "out tok/s", "{:.1f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p90_ms", "TTFT p90 ms", "{:.0f}"),
    ("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"),
    ("e2el_p50_ms", "E2E p50 ms", "{:.0f}"),
)


def ratios(runs: list[HarnessRun]) -> None:
    """Fill each external run's ``ratio`` and ``baseline``: its figures over the mean of
    the pdserve bench runs on either side of it in ``runs`` (the order they ran in)."""
    for i, r in enumerate(runs):
        if r.harness.startswith(PDSERVE) or r.figures is None:
            continue
        around = [b for b in (_pdserve_near(runs, i, -1), _pdserve_near(runs, i, 1))
                  if b is not None and b.figures is not None]
        if not around:
            continue
        r.baseline = [b.harness for b in around]
        for k, _, _ in COLUMNS:
            base = sum(getattr(b.figures, k) for b in around) / len(around)
            r.ratio[k] = getattr(r.figures, k) / base if base else None


def _pdserve_near(runs: list[HarnessRun], i: int, step: int) -> HarnessRun | None:
    j = i + step
    while 0 <= j < len(runs):
        if runs[j].harness.startswith(PDSERVE):
            return runs[j]
        j += step
    return None


def table(runs: list[HarnessRun]) -> str:
    """harness | ok | failed | in/out tok per request | the COLUMNS, each external
    figure with its ratio to pdserve bench's in parentheses; skipped and failed
    harnesses on a line of their own."""
    width = max(len(r.harness) for r in runs) + 2
    head = (f"{'harness':<{width}}{'ok':>5}{'failed':>7}{'in/req':>8}{'out/req':>8}"
            + "".join(f"{title:>20}" for _, title, _ in COLUMNS) + f"{'client CPU s':>14}")
    lines = [head]
    for r in runs:
        f = r.figures
        if f is None:
            status = f"skipped: {r.skipped}" if r.skipped else f"FAILED: {r.error}"
            lines.append(f"{r.harness:<{width}}{status}")
            continue
        cells = []
        for key, _, fmt in COLUMNS:
            cell = fmt.format(getattr(f, key))
            q = r.ratio.get(key)
            cells.append(cell + (f" ({q:.2f}x)" if q is not None else " " * 8))
        lines.append(f"{r.harness:<{width}}{f.completed:>5}{f.failed:>7}"
                     f"{f.mean_input_tokens:>8.1f}{f.mean_output_tokens:>8.1f}"
                     + "".join(f"{c:>20}" for c in cells)
                     + (f"{r.client_cpu_s:>14.1f}" if r.client_cpu_s is not None else ""))
    lines.append("In the order they ran. (x): the figure over the mean of the pdserve bench "
                 "runs just before and after it. TPOT: (E2E - TTFT) / (tokens - 1) per "
                 "request, vLLM's definition (guidellm and aiperf name it ITL). Client "
                 "CPU s: the harness's own CPU time (a tool's with its start-up), taken "
                 "from the cores the server runs on.")
    return "\n".join(lines)


# -- the run ------------------------------------------------------------------------------

def _compare(o: HarnessOptions, url: str, log: Callable[[str], None]) -> list[HarnessRun]:
    """pdserve bench, then each tool found followed by pdserve bench again; the tools
    not found listed at the end."""
    model = models(url)[0]
    tokenizer = o.tokenizer or o.model
    target = Target(url, model, tokenizer or "")
    ours = PdserveBench(o.workload, url, model)
    log(f"{PDSERVE}: warm-up, {o.workload.num_requests} requests")
    warm = ours.warm_up()
    log(f"{PDSERVE}: warm-up done, {warm.output_throughput:.1f} output tok/s")
    runs: list[HarnessRun] = []
    skipped: list[HarnessRun] = []

    def measure() -> None:
        log(f"{PDSERVE} #{ours.runs + 1}: {o.workload.num_requests} requests")
        runs.append(ours.measure())

    measure()
    for name, given in o.tools.items():
        exe, why = locate(name, given, ENV_VARS[name])
        if exe is not None and not tokenizer:
            exe, why = None, ("the external tools count tokens with the model's tokenizer: "
                              "give --tokenizer DIR (the served model's directory)")
        r = _run_tool(name, exe, why, o.workload, target, Path(o.work_dir), o.timeout_s, log)
        if r.skipped:
            skipped.append(r)
            continue
        runs.append(r)
        measure()
    runs += skipped
    ratios(runs)
    return runs


def run(o: HarnessOptions, log: Callable[[str], None] = print) -> dict:
    """The comparison; prints the table, writes ``o.out``; returns what it writes."""
    w = o.workload
    log(f"workload: {w.num_requests} requests, {w.input_len} tokens in -> {w.output_len} "
        f"out (ignore_eos), closed loop at concurrency {w.max_concurrency}, streamed "
        f"through /v1/completions; seed {w.seed}")
    load_before = os.getloadavg()
    log(f"machine: {cpu_name()}, {os.cpu_count()} cpus; loadavg "
        f"{' '.join(f'{x:.2f}' for x in load_before)}")
    started = time.time()
    if o.target is not None:
        server = f"{o.target} (already running)"
        runs = _compare(o, o.target, log)
    else:
        assert o.model is not None
        workers = sum(TOPOLOGIES[o.topology].values())
        threads = o.threads or max(1, ((os.cpu_count() or 1) - 1) // workers)
        cfg = LocalClusterConfig(model=o.model, port=free_port(), http_port=free_port(),
                                 metrics_port=0, dtype=o.dtype, threads_per_worker=threads,
                                 kv_cache_gb=o.kv_cache_gb,
                                 log_dir=str(Path(o.work_dir) / "cluster-logs"),
                                 **TOPOLOGIES[o.topology])  # type: ignore[arg-type]
        with LocalCluster(cfg) as cluster:
            cluster.wait_ready()
            assert cluster.http_url is not None
            dtype, _ = resolve_dtype(o.dtype, "cpu")
            server = (f"local pdserve cluster on {Path(o.model).name}, {o.topology} "
                      f"({cluster.threads} thread(s) per worker, dtype {o.dtype} -> {dtype})")
            log(f"server: {server}, {cluster.http_url}")
            runs = _compare(o, cluster.http_url, log)
    log(f"\n{table(runs)}")
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
              "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(),
                          "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
              "server": server, "options": asdict(o), "runs": [asdict(r) for r in runs]}
    if o.out:
        Path(o.out).parent.mkdir(parents=True, exist_ok=True)
        Path(o.out).write_text(json.dumps(result, indent=1) + "\n")
        log(f"wrote {o.out}")
    return result
