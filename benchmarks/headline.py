"""``pdserve bench-headline``: disaggregated vs colocated serving under the same load.

The experiment that justifies disaggregation (DistServe), sized to this machine: the
same model and the same total resources, two ways.

- **disaggregated**: 1 prefill + 1 decode worker, one thread (one core) each; every
  prompt is prefilled on the prefill worker (``local_prefill_threshold`` 0);
- **colocated**: 2 mixed workers, one thread each, the router balancing them.

Workload (``loadtest.workloads.mixed_workload``): long prompts among ongoing decodes:
a ``long_fraction`` of requests bring ``long_input_len``-token prompts (short outputs),
the rest ``input_len``-token prompts with ``output_len``-token outputs. Poisson
arrivals at each rate of the sweep, ``duration_s`` worth of requests per point (at
least 12), the same seeded requests for both clusters at a rate. Colocated, a long
prefill chunk shares the batch with the decodes on that worker and stalls them;
disaggregated, decodes never wait for a prefill, but the one prefill worker saturates
first.

Reports per rate and cluster: ITL, TPOT and TTFT percentiles, throughput and goodput
at the SLOs given (``--slo-tpot-ms`` tight, ``--slo-ttft-ms`` loose), the ratio of ITL
p99 (target: colocated / disaggregated >= 2) and of goodput; writes every run's JSON
(with per-request details and its plot), both sweeps and ``headline.png`` (goodput,
ITL p99, TPOT p99, TTFT p99 against rate) under ``--out``.
"""

from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.local import LocalCluster, LocalClusterConfig, free_port
from loadtest.metrics import SLO
from loadtest.plots import plot_sweeps
from loadtest.runner import RunOptions, run
from loadtest.workloads import arrival_times, mixed_workload
from router.client import Client


@dataclass(frozen=True)
class HeadlineOptions:
    model: str
    rates: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    duration_s: float = 40.0
    input_len: int = 128
    output_len: int = 96
    long_fraction: float = 0.25
    long_input_len: int = 1536
    long_output_len: int = 16
    slo_ttft_ms: float = 10000.0
    slo_tpot_ms: float = 100.0
    seed: int = 0
    out: str = "bench-results/headline"


CLUSTERS = {
    "disaggregated": {"prefill": 1, "decode": 1, "local_prefill_threshold": 0},
    "colocated": {"mixed": 2},
}


def _workload(o: HeadlineOptions, rate: float, i: int) -> tuple[list, list[float]]:
    """Point ``i``'s requests: seeded by the point, so no point reuses another's prompts
    (the prefix cache would serve them), and the same for both clusters."""
    n = max(12, math.ceil(rate * o.duration_s))
    requests = mixed_workload(n, o.input_len, o.output_len, o.long_fraction,
                              o.long_input_len, o.long_output_len, 0.2, o.seed + i)
    return requests, arrival_times(n, rate, 1.0, o.seed + i)


def _sweep(o: HeadlineOptions, name: str, out: Path) -> list[dict]:
    """Start ``name``'s cluster, warm it, run every rate; writes the sweep's JSON."""
    cfg = LocalClusterConfig(model=o.model, port=free_port(), http_port=0, metrics_port=None,
                             kv_cache_gb=1.0, threads_per_worker=1,
                             log_dir=str(out / f"{name}-logs"),
                             **CLUSTERS[name])  # type: ignore[arg-type]
    points = []
    with LocalCluster(cfg) as cluster:
        cluster.wait_ready()
        with Client(cluster.target) as client:  # warm both workers' first forward
            for i in range(4):
                client.generate(list(range(1000 + i, 1064 + i)), max_tokens=4,
                                ignore_eos=True, temperature=0.0)
        for i, rate in enumerate(o.rates):
            requests, times = _workload(o, rate, i)
            print(f"\n== {name}: {len(requests)} requests at {rate:g} req/s ==", flush=True)
            opts = RunOptions(cluster.target, tuple(requests), tuple(times),
                              slo=SLO(o.slo_ttft_ms, o.slo_tpot_ms), progress=True)
            m = run(opts, str(out / f"{name}-rate{rate:g}.json"),
                    {"cluster": name, "request_rate": rate})
            if m["cached_token_ratio"] > 0.01:
                print(f"warning: {m['cached_token_ratio']:.1%} of prompt tokens came from "
                      "the prefix cache", flush=True)
            points.append({"cluster": name, "request_rate": rate, **m})
    (out / f"{name}-sweep.json").write_text(json.dumps(points, indent=2))
    return points


TPOT_SLOS_MS = (75.0, 100.0, 150.0, 200.0)


def _goodput(run: dict, ttft_ms: float | None, tpot_ms: float) -> float:
    """Requests/s of ``run`` that met the SLOs (from its per-request details)."""
    d, slo = run["details"], SLO(ttft_ms, tpot_ms)
    good = sum(slo.met(*latencies) for latencies in zip(d["ttfts"], d["tpots"], d["e2els"],
                                                        strict=True))
    return good / run["duration"]


def run_headline(o: HeadlineOptions, report_only: bool = False) -> dict:
    """Run both sweeps (unless ``report_only``: tabulate the files already in ``out``)."""
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    print(f"pdserve bench-headline: {Path(o.model).name} fp32; 1 prefill + 1 decode vs 2 "
          f"mixed workers, one thread each; workload: {o.long_fraction:.0%} of requests "
          f"{o.long_input_len} -> {o.long_output_len} tokens, the rest {o.input_len} -> "
          f"{o.output_len} (lengths +-20%), Poisson at {', '.join(f'{r:g}' for r in o.rates)}"
          f" req/s, ~{o.duration_s:g} s of arrivals per point; SLOs: TTFT <= "
          f"{o.slo_ttft_ms:g} ms, TPOT <= {o.slo_tpot_ms:g} ms")
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"loadavg {load0[0]:.2f} {load0[1]:.2f}")
    if not report_only:
        for name in CLUSTERS:
            _sweep(o, name, out)
    sweeps = {name: json.loads((out / f"{name}-sweep.json").read_text()) for name in CLUSTERS}
    runs = {name: {p["request_rate"]: json.loads(
        (out / f"{name}-rate{p['request_rate']:g}.json").read_text()) for p in pts}
        for name, pts in sweeps.items()}
    load1 = os.getloadavg()
    rows = []
    print(f"\n{'rate':>6} | {'ITL p99 ms (D / C)':>22} {'C/D':>6} | "
          f"{'TPOT p99 ms (D / C)':>22} | {'TTFT p99 ms (D / C)':>22} | "
          f"{'goodput req/s (D / C)':>22} | {'throughput (D / C)':>20}")
    for d, c in zip(sweeps["disaggregated"], sweeps["colocated"], strict=True):
        ratio = c["p99_itl_ms"] / d["p99_itl_ms"] if d["p99_itl_ms"] else float("nan")
        rate = d["request_rate"]
        rows.append({"request_rate": rate, "itl_p99_ms": [d["p99_itl_ms"], c["p99_itl_ms"]],
                     "itl_p99_ratio_c_over_d": ratio,
                     "tpot_p99_ms": [d["p99_tpot_ms"], c["p99_tpot_ms"]],
                     "ttft_p99_ms": [d["p99_ttft_ms"], c["p99_ttft_ms"]],
                     "goodput": {f"tpot<={t:g}" + ("" if ttft is None else f",ttft<={ttft:g}"):
                                 [_goodput(runs[n][rate], ttft, t) for n in CLUSTERS]
                                 for t in TPOT_SLOS_MS for ttft in (o.slo_ttft_ms, None)}})
        print(f"{rate:>6g} | {d['p99_itl_ms']:>10.0f} / {c['p99_itl_ms']:>9.0f} "
              f"{ratio:>6.1f} | {d['p99_tpot_ms']:>10.0f} / {c['p99_tpot_ms']:>9.0f} | "
              f"{d['p99_ttft_ms']:>10.0f} / {c['p99_ttft_ms']:>9.0f} | "
              f"{d['request_goodput']:>10.2f} / {c['request_goodput']:>9.2f} | "
              f"{d['request_throughput']:>9.2f} / {c['request_throughput']:>8.2f}")
    print("\ngoodput (req/s, disaggregated / colocated) at TPOT SLOs, with the TTFT SLO "
          f"({o.slo_ttft_ms:g} ms) and without one:")
    print(f"{'rate':>6} | " + " | ".join(f"{f'TPOT<={t:g}':>12}{'(no TTFT)':>14}"
                                          for t in TPOT_SLOS_MS))
    for row in rows:
        g = row["goodput"]
        print(f"{row['request_rate']:>6g} | " + " | ".join(
            "{:>5.2f}/{:<5.2f}  {:>5.2f}/{:<5.2f} ".format(
                *g[f"tpot<={t:g},ttft<={o.slo_ttft_ms:g}"], *g[f"tpot<={t:g}"])
            for t in TPOT_SLOS_MS))
    png = plot_sweeps(sweeps, out / "headline.png")
    summary = {"options": o.__dict__, "machine": {"cpus": os.cpu_count(),
               "arch": platform.machine(), "torch": torch.__version__,
               "loadavg_before": load0, "loadavg_after": load1}, "rows": rows}
    (out / "headline.json").write_text(json.dumps(summary, indent=2))
    print(f"loadavg after {load1[0]:.2f}; wrote {out / 'headline.json'} and {png}")
    return summary
