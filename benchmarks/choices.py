"""``python -m benchmarks.choices``: n choices of one prompt through the split, against
one request per choice (what a server without n-aware disaggregation does).

One run, real processes on loopback: a 1 prefill + 1 decode cluster on the default
model, every prompt sent remote. ``--prompts`` distinct prompts of ``--tokens`` tokens,
each asked for ``--n`` seeded choices of ``--max-tokens`` tokens (temperature 1, all at
once), two ways on the same cluster:

- **choices**: one request with ``n``; the prompt is computed and its KV moved once,
  the decode worker forks its blocks.
- **per choice**: ``n`` requests per prompt, each with its own cache salt (so no choice
  reuses another's prefix, as when each choice is its own request on a server that
  prefills and transfers per choice; vLLM's n under P/D, by the issue).

Per way: wall time, prompt tokens the prefill worker computed, KV bytes the channel
moved, the decode worker's peak KV blocks in use (sampled), client TTFT p50 and output
tok/s; then the ratios. Prints the workload and the machine; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

from benchmarks.machine import machine_line
from cluster.local import LocalCluster, LocalClusterConfig, free_port
from router.client import AsyncClient, Client
from workers.model_store import resolve_model


def _totals(client: Client) -> dict[str, int]:
    """Prefill tokens computed, KV bytes moved, decode blocks in use, right now."""
    ws = client.status().workers
    p = [w for w in ws if w.role == "prefill"]
    d = [w for w in ws if w.role == "decode"]
    return {"computed": sum(w.prompt_tokens - w.cached_prompt_tokens for w in p),
            "bytes": sum(w.transfers.bytes_moved for w in p),
            "transfers": sum(w.transfers.entered["done"] for w in p),
            "blocks": sum(w.total_blocks - w.free_blocks for w in d)}


async def _choices(target: str, prompts: list[list[int]], n: int, kw: dict
                   ) -> list[float]:
    async with AsyncClient(target) as client:
        outs = await asyncio.gather(*(client.choices(p, n, **kw) for p in prompts))
    return [c.ttft_s for group in outs for c in group]


async def _per_choice(target: str, prompts: list[list[int]], n: int, kw: dict,
                      run: int) -> list[float]:
    seed = kw["seed"]
    async with AsyncClient(target) as client:
        outs = await asyncio.gather(*(
            client.generate(p, cache_salt=f"run{run}-prompt{j}-choice{i}",
                            **{**kw, "seed": seed + i})
            for j, p in enumerate(prompts) for i in range(n)))
    return [c.ttft_s for c in outs]


def _measure(cluster: LocalCluster, way: str, prompts: list[list[int]], n: int, kw: dict,
             run: int) -> dict[str, float]:
    with Client(cluster.target) as client:
        before = _totals(client)
        peak, stop = [0], threading.Event()

        def sample() -> None:
            with Client(cluster.target) as c:
                while not stop.is_set():
                    peak[0] = max(peak[0], _totals(c)["blocks"])
                    time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start = time.perf_counter()
        coro = (_choices(cluster.target, prompts, n, kw) if way == "choices"
                else _per_choice(cluster.target, prompts, n, kw, run))
        ttfts = asyncio.run(coro)
        wall = time.perf_counter() - start
        stop.set()
        sampler.join()
        after = _totals(client)
    tokens = len(prompts) * n * kw["max_tokens"]
    return {"wall_s": wall, "prefill_tokens": after["computed"] - before["computed"],
            "kv_bytes": after["bytes"] - before["bytes"],
            "transfers": after["transfers"] - before["transfers"],
            "peak_decode_blocks": peak[0], "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "output_tok_s": tokens / wall}


def run(args: argparse.Namespace) -> dict:
    model = str(args.model or resolve_model(None, None))
    rng = random.Random(0)
    cfg = LocalClusterConfig(model=model, port=free_port(), http_port=0, metrics_port=None,
                             prefill=1, decode=1, local_prefill_threshold=0,
                             kv_cache_gb=args.kv_cache_gb, threads_per_worker=1)
    kw = {"max_tokens": args.max_tokens, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    load = os.getloadavg()
    print(f"workload: {args.prompts} prompts x {args.tokens} random tokens, n={args.n} "
          f"seeded choices x {args.max_tokens} tokens each (temperature 1, ignore_eos), all "
          f"at once; 1 prefill + 1 decode worker (1 thread each), model {Path(model).name}, "
          f"dtype auto; best wall time of {args.repeats}")
    print(f"machine: {machine_line()}, loadavg {load[0]:.2f}")
    results: dict[str, dict[str, float]] = {}
    with LocalCluster(cfg) as cluster:
        cluster.wait_ready()
        for r in range(args.repeats):
            for way in ("choices", "per_choice"):
                prompts = [[rng.randrange(1000, 40000) for _ in range(args.tokens)]
                           for _ in range(args.prompts)]  # fresh: nothing cached
                got = _measure(cluster, way, prompts, args.n, kw, r)
                if way not in results or got["wall_s"] < results[way]["wall_s"]:
                    results[way] = got
    cols = ["wall_s", "prefill_tokens", "kv_bytes", "transfers", "peak_decode_blocks",
            "ttft_p50_ms", "output_tok_s"]
    print(f"{'':<12}" + "".join(f"{c:>20}" for c in cols))
    for way, got in results.items():
        print(f"{way:<12}" + "".join(f"{got[c]:>20.1f}" for c in cols))
    ratio = {c: results["choices"][c] / results["per_choice"][c]
             for c in cols if results["per_choice"][c]}
    print(f"{'ratio':<12}" + "".join(f"{ratio.get(c, float('nan')):>20.2f}" for c in cols))
    out = {"workload": vars(args), "model": model, "results": results, "ratio": ratio,
           "machine": machine_line()}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-gb", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    run(ap.parse_args())


if __name__ == "__main__":
    main()
