"""The first -> second token gap of a disaggregated request, with and without early KV
offers, against colocated serving on the same cores (issue 16, item 5).

``python -m benchmarks.token_gap [--rounds N] [--probes N] [--background N]
[--prompt-len N] [--link-rate RATE] [--variants ...] [--model PATH] [--dtype D]
[--out FILE]`` starts, round after round, three clusters from
:mod:`cluster.local` (the code ``pdserve up`` runs), one thread per worker, and measures
each the same way:

- **layers**: 1 prefill + 1 decode worker, every prompt sent remote, the KV offered while
  the prefill's last step computes it and each layer's KV sent as soon as it is done
  (the default, ``--kv-offer layers``);
- **step**: the same, the KV sent when the step ends (``--kv-offer step``);
- **after**: the KV offered once the step ended (``--kv-offer after``, as before);
- **colocated**: 2 mixed workers.

In each, ``background`` clients keep decoding (64-token prompts, 200 tokens out, back to
back) so a decode worker is mid-step when a probe's KV lands, and ``probes`` probes
(``prompt_len`` random tokens, 128 by default, 3 out, greedy) go one at a time, 0.3-0.6 s
apart, after one warm-up. ``--link-rate`` (e.g. ``1gbit``) puts a token bucket
(``tc tbf``) on ``lo`` for the whole run, as a slower link between the workers would be
(all the cluster's traffic crosses it; the KV is nearly all of its bytes): only inside a
private network namespace (``unshare -n sh -c 'ip link set lo up && python -m
benchmarks.token_gap ...'``), never on a machine's own loopback. The gap
is the client's time between its first and second token. Variants alternate within each
round, so a drifting VM moves all three. Prints the machine, each variant's gap p50 / p90
/ p99 / max and TTFT p50 over all rounds, and the ratios early / after and each split
against colocated; ``--out`` writes the samples as JSON.

Lifecycle per variant and round: cluster up -> background clients -> warm-up probe, 2 s
-> probes -> background stopped -> cluster down.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.local import LocalCluster, LocalClusterConfig, free_port
from cluster.testhosts import interfaces
from router.client import Client
from workers.model_store import resolve_model

from .machine import machine_line

VARIANTS: dict[str, dict[str, Any]] = {
    **{offer: dict(prefill=1, decode=1, local_prefill_threshold=0, kv_offer=offer)
       for offer in ("layers", "step", "after")},
    "colocated": dict(mixed=2),
}


@dataclass
class Samples:
    gaps_ms: list[float] = field(default_factory=list)
    ttfts_ms: list[float] = field(default_factory=list)


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile, linear between order statistics (``statistics.quantiles``'
    inclusive method); the one value of a single sample."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary_rows(results: dict[str, Samples]) -> list[str]:
    """The table: one row per variant, then the ratios of the medians and p90s."""
    rows = [f"{'variant':<10} {'n':>4} {'gap p50':>9} {'p90':>8} {'p99':>8} {'max':>8} "
            f"{'TTFT p50':>9}   (ms)"]
    for name, s in results.items():
        g = s.gaps_ms
        rows.append(f"{name:<10} {len(g):>4} {quantile(g, 0.5):>9.1f} {quantile(g, 0.9):>8.1f} "
                    f"{quantile(g, 0.99):>8.1f} {max(g):>8.1f} "
                    f"{quantile(s.ttfts_ms, 0.5):>9.1f}")
    pairs = [("layers", "after"), ("step", "after"), ("layers", "step"),
             ("layers", "colocated"), ("after", "colocated")]
    for a, b in pairs:
        if a in results and b in results:
            ga, gb = results[a].gaps_ms, results[b].gaps_ms
            rows.append(f"{a} / {b}: gap p50 {quantile(ga, 0.5) / quantile(gb, 0.5):.2f}x, "
                        f"p90 {quantile(ga, 0.9) / quantile(gb, 0.9):.2f}x")
    return rows


def shape_loopback(rate: str | None) -> None:
    """Put (``rate``) or take off (None) a token bucket on ``lo``; only in a private
    network namespace (``lo`` its only interface)."""
    if rate is None:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        return
    if interfaces() != ["lo"]:
        raise SystemExit("--link-rate shapes lo, so it runs only in a private network "
                         "namespace: unshare -n sh -c 'ip link set lo up && python -m "
                         "benchmarks.token_gap ...'")
    r = subprocess.run(["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate,
                        "burst", "256kb", "latency", "200ms"], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"tc could not shape lo to {rate}: {r.stderr.strip()}")


def _probe(client: Client, prompt: list[int]) -> tuple[float, float]:
    """(TTFT, first -> second token gap) in seconds."""
    t0 = time.perf_counter()
    times: list[float] = []
    for msg in client.stream(prompt, max_tokens=3, temperature=0.0, ignore_eos=True):
        times += [time.perf_counter() - t0] * len(msg.token_ids)
    if len(times) < 2:
        raise RuntimeError(f"a probe streamed {len(times)} tokens, not 3")
    return times[0], times[1] - times[0]


def run_variant(name: str, model: Path, dtype: str, background: int, probes: int,
                prompt_len: int, rng: random.Random, into: Samples) -> None:
    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    cfg = LocalClusterConfig(model=str(model), port=free_port(), http_port=0,
                             metrics_port=None, kv_cache_gb=0.5, threads_per_worker=1,
                             dtype=dtype, **VARIANTS[name])
    with LocalCluster(cfg) as cluster:
        cluster.wait_ready()
        stop = threading.Event()
        bg_prompts = [prompt(64) for _ in range(64)]

        def decode_forever(k: int) -> None:
            with Client(cluster.target) as c:
                i = k
                while not stop.is_set():
                    c.generate(bg_prompts[i % len(bg_prompts)], max_tokens=200,
                               temperature=0.0, ignore_eos=True)
                    i += background

        threads = [threading.Thread(target=decode_forever, args=(k,), daemon=True)
                   for k in range(background)]
        for t in threads:
            t.start()
        try:
            with Client(cluster.target) as client:
                _probe(client, prompt(prompt_len))
                time.sleep(2.0)
                for _ in range(probes):
                    ttft, gap = _probe(client, prompt(prompt_len))
                    into.ttfts_ms.append(ttft * 1e3)
                    into.gaps_ms.append(gap * 1e3)
                    time.sleep(0.3 + rng.random() * 0.3)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--probes", type=int, default=20, help="per variant and round")
    ap.add_argument("--background", type=int, default=4, help="clients decoding meanwhile")
    ap.add_argument("--prompt-len", type=int, default=128, help="each probe's prompt tokens")
    ap.add_argument("--link-rate", default=None,
                    help="shape lo to this rate (tc's units: 1gbit, 100mbit); private "
                         "network namespaces only")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the samples here as JSON")
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    model = resolve_model(args.model)
    rng = random.Random(args.seed)
    print(f"machine: {machine_line()}", flush=True)
    print(f"workload: {args.background} background decodes (64 -> 200 tokens), "
          f"{args.probes} probes of {args.prompt_len} -> 3 tokens per variant and round, "
          f"{args.rounds} rounds; model {model.name}, --dtype {args.dtype}, 1 thread a "
          f"worker; link: {args.link_rate or 'loopback, unshaped'}", flush=True)
    results = {n: Samples() for n in names}
    if args.link_rate:
        shape_loopback(args.link_rate)
    try:
        for r in range(args.rounds):
            for name in names:
                before = len(results[name].gaps_ms)
                started = time.monotonic()
                run_variant(name, model, args.dtype, args.background, args.probes,
                            args.prompt_len, rng, results[name])
                new = results[name].gaps_ms[before:]
                print(f"round {r + 1}/{args.rounds} {name:<10} gap p50 "
                      f"{quantile(new, 0.5):7.1f} ms  max {max(new):7.1f}  "
                      f"({time.monotonic() - started:.0f} s)", flush=True)
    finally:
        if args.link_rate:
            shape_loopback(None)
    print("\n".join(summary_rows(results)))
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"machine": machine_line(), "args": vars(args),
             "samples": {n: vars(s) for n, s in results.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
