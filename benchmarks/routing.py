"""``pdserve bench-routing``: cache-aware vs round-robin routing, and the routing cost.

One run, real processes on loopback, the default model:

1. **Shared-prefix workload.** ``--system-prompts`` system prompts of
   ``--system-tokens`` tokens (random ids, seeded), each followed by
   ``--questions`` unique questions of ``--question-tokens`` tokens, in a shuffled order,
   sent ``--concurrency`` at a time to a fresh cluster of 2 prefill + 1 decode workers
   (one thread each, Redis started by the cluster) per policy: ``round_robin`` then
   ``cache_aware``. Reported per policy: prefix hit rate (cached prompt tokens / prompt
   tokens, from the responses' usage) against the best possible for the workload (each
   system prompt computed once), TTFT p50/p99 and request throughput. Target: cache-aware
   TTFT p50 at least 2x lower than round-robin, hit rate within 10% of the best.
2. **Routing overhead.** Hash a ``--overhead-tokens`` prompt, look it up in an index
   of ``--workers`` registered workers, and score them with the cache-aware policy:
   p50/p99 over 300 runs, for a typical index (4 workers hold prefixes of the prompt, the
   rest other prompts) and the worst case (every worker holds a prefix of it, of every
   length). Target: under 1 ms p50. Reported with each phase's p50 (hash, lookup, score)
   and, as the floor of the same run, a Redis round trip (``PING``). ``--overhead-only``
   runs this part alone (seconds, no model).

Prints the workload, the machine and a table; ``--out`` writes the JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from benchmarks.machine import cpu_name
from cluster.local import LocalCluster, LocalClusterConfig, free_port
from cluster.redis_server import RedisServer
from common.hashing import block_hashes
from common.prefix_index import RedisPrefixIndex
from loadtest.metrics import percentile
from router.client import AsyncClient
from router.policies import CacheAware, Candidate
from workers.engine.params import default_block_size, resolve_block_size


@dataclass(frozen=True)
class RoutingBenchOptions:
    model: str
    system_prompts: int = 8
    system_tokens: int = 1024
    questions: int = 4
    question_tokens: int = 64
    concurrency: int = 2
    workers: int = 64
    overhead_tokens: int = 2048
    overhead_only: bool = False
    overhead_block_size: int = 0
    """Tokens per block of the timed decision; 0: the engine's CPU default (the block size
    the cluster's workers register, which the router hashes prompts with)."""
    out: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "overhead_block_size", resolve_block_size(
            self.overhead_block_size, name="overhead_block_size"))


def workload(o: RoutingBenchOptions) -> list[list[int]]:
    rng = random.Random(0)
    systems = [[rng.randrange(1000, 40000) for _ in range(o.system_tokens)]
               for _ in range(o.system_prompts)]
    prompts = [s + [rng.randrange(1000, 40000) for _ in range(o.question_tokens)]
               for s in systems for _ in range(o.questions)]
    rng.shuffle(prompts)
    return prompts


async def _drive(target: str, prompts: list[list[int]], concurrency: int) -> list[object]:
    sem = asyncio.Semaphore(concurrency)
    async with AsyncClient(target) as client:
        async def one(p: list[int]) -> object:
            async with sem:
                return await client.generate(p, max_tokens=4, temperature=0.0,
                                             ignore_eos=True)
        return await asyncio.gather(*(one(p) for p in prompts))


def run_policy(o: RoutingBenchOptions, policy: str, prompts: list[list[int]]) -> dict:
    cfg = LocalClusterConfig(model=o.model, prefill=2, decode=1, port=free_port(),
                             http_port=0, kv_cache_gb=1.0, threads_per_worker=1,
                             policy=policy, local_prefill_threshold=0, metrics_port=None)
    with LocalCluster(cfg) as cluster:
        cluster.wait_ready()
        start = time.perf_counter()
        served = asyncio.run(_drive(cluster.target, prompts, o.concurrency))
        wall = time.perf_counter() - start
    ttft = [s.ttft_s for s in served]
    cached = sum(s.usage["cached_tokens"] for s in served)
    total = sum(len(p) for p in prompts)
    return {"policy": policy, "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99),
            "hit_rate": cached / total, "requests_per_s": len(prompts) / wall,
            "reasons": sorted({s.routing["reason"] for s in served})}


def routing_overhead(o: RoutingBenchOptions) -> dict:
    server = RedisServer().wait_ready()
    try:
        client = redis.Redis.from_url(server.url)
        rng = random.Random(1)
        prompt = [rng.randrange(1000, 40000) for _ in range(o.overhead_tokens)]
        bs = o.overhead_block_size
        hashes = block_hashes(prompt, bs, "bench-model", None)
        workers = [f"10.0.{i // 250}.{i % 250}:50061" for i in range(o.workers)]
        out = {}
        for scenario in ("typical", "worst"):
            index = RedisPrefixIndex(client, f"bench-{scenario}")
            for i, w in enumerate(workers):
                if scenario == "worst":  # every worker holds a prefix, of every length
                    index.publish(w, hashes[: (i * len(hashes)) // len(workers)])
                elif i < 4:  # four hold a quarter, half, three quarters, all of it
                    index.publish(w, hashes[: ((i + 1) * len(hashes)) // 4])
                else:  # the others hold other prompts' blocks
                    other = [rng.randrange(1000, 40000) for _ in range(1024)]
                    index.publish(w, block_hashes(other, bs, "bench-model", None))
            out[scenario] = _time_decision(index, prompt, workers, bs)
        out["redis_round_trip"] = _time_round_trip(client)
        client.close()
        return out
    finally:
        server.stop()


def _time_decision(index: RedisPrefixIndex, prompt: list[int], workers: list[str],
                   block_size: int) -> dict:
    policy = CacheAware()
    times, phases = [], []
    for _ in range(300 + 20):
        t0 = time.perf_counter()
        h = block_hashes(prompt, block_size, "bench-model", None)
        t1 = time.perf_counter()
        counts = index.lookup(h)
        t2 = time.perf_counter()
        policy.choose([Candidate(w, 0, 0, counts.get(w, 0) * block_size) for w in workers],
                      len(prompt))
        t3 = time.perf_counter()
        times.append(t3 - t0)
        phases.append((t1 - t0, t2 - t1, t3 - t2))
    times, phases = times[20:], phases[20:]
    out = {"p50_ms": percentile(times, 50) * 1e3, "p99_ms": percentile(times, 99) * 1e3,
           "mean_ms": statistics.mean(times) * 1e3}
    for i, phase in enumerate(("hash", "lookup", "score")):
        out[f"{phase}_p50_ms"] = percentile([p[i] for p in phases], 50) * 1e3
    return out


def _time_round_trip(client: redis.Redis) -> dict:
    """The floor under any lookup: one ``PING`` to the same Redis, through redis-py."""
    times = []
    for _ in range(300 + 20):
        t0 = time.perf_counter()
        client.ping()
        times.append(time.perf_counter() - t0)
    return {"p50_ms": percentile(times[20:], 50) * 1e3}


def _print_overhead(o: RoutingBenchOptions, overhead: dict) -> None:
    floor = overhead["redis_round_trip"]["p50_ms"]
    for scenario in ("typical", "worst"):
        t = overhead[scenario]
        print(f"routing overhead (hash + lookup + score), {o.overhead_tokens}-token prompt in "
              f"blocks of {o.overhead_block_size}, "
              f"{o.workers} registered workers, {scenario} index: p50 {t['p50_ms']:.3f} ms, "
              f"p99 {t['p99_ms']:.3f} ms (target p50 < 1 ms); p50 by phase: hash "
              f"{t['hash_p50_ms']:.3f}, lookup {t['lookup_p50_ms']:.3f}, score "
              f"{t['score_p50_ms']:.3f} ms; {t['p50_ms'] / floor:.1f}x a Redis round trip")
    print(f"  Redis round trip (PING, redis-py) p50 {floor:.3f} ms; typical: 4 workers hold "
          f"1/4..all of the prompt, {o.workers - 4} hold other prompts; worst: all "
          f"{o.workers} hold a prefix of it, of every length")


def run(o: RoutingBenchOptions) -> dict:
    if o.overhead_only:
        return run_overhead(o)
    prompts = workload(o)
    load0 = os.getloadavg()
    n = len(prompts)
    bs = default_block_size("cpu")  # the cluster's workers take the default: hits are whole blocks
    best = (n - o.system_prompts) * (o.system_tokens // bs * bs) / sum(len(p) for p in prompts)
    print(f"workload: {o.system_prompts} system prompts x {o.system_tokens} tokens, "
          f"{o.questions} unique {o.question_tokens}-token questions each ({n} requests, "
          f"shuffled), {o.concurrency} at a time, max_tokens 4, 2 prefill + 1 decode workers "
          f"(1 thread each), model {Path(o.model).name} float32; best possible hit rate "
          f"{best:.1%}")
    _print_machine(load0)
    results = []
    for policy in ("round_robin", "cache_aware"):
        r = run_policy(o, policy, prompts)
        results.append(r)
        print(f"  {policy}: done", flush=True)
    overhead = routing_overhead(o)
    rr, ca = results
    print(f"\n{'policy':<14}{'hit rate':>10}{'vs best':>9}{'TTFT p50 ms':>13}"
          f"{'TTFT p99 ms':>13}{'req/s':>8}")
    for r in results:
        print(f"{r['policy']:<14}{r['hit_rate']:>10.1%}{r['hit_rate'] / best:>9.0%}"
              f"{r['ttft_p50_s'] * 1e3:>13.0f}{r['ttft_p99_s'] * 1e3:>13.0f}"
              f"{r['requests_per_s']:>8.2f}")
    speedup = rr["ttft_p50_s"] / ca["ttft_p50_s"]
    print(f"cache-aware TTFT p50 is {speedup:.2f}x lower than round-robin (target >= 2x); "
          f"hit rate {ca['hit_rate'] / best:.0%} of the best possible (target >= 90%)")
    _print_overhead(o, overhead)
    load1 = os.getloadavg()
    print(f"loadavg after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    result = {"workload": {k: v for k, v in vars(o).items() if k not in ("model", "out")},
              "model": Path(o.model).name, "best_hit_rate": best, "policies": results,
              "ttft_p50_speedup": speedup, "routing_overhead": overhead,
              "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "loadavg_before": load0,
                          "loadavg_after": load1}}
    _write(o, result)
    return result


def run_overhead(o: RoutingBenchOptions) -> dict:
    """Part 2 alone: the routing decision's cost, no cluster and no model."""
    load0 = os.getloadavg()
    print(f"workload: routing decisions for one {o.overhead_tokens}-token prompt, "
          f"{o.workers} registered workers, blocks of {o.overhead_block_size} tokens, 300 "
          f"timed runs per index")
    _print_machine(load0)
    overhead = routing_overhead(o)
    _print_overhead(o, overhead)
    load1 = os.getloadavg()
    print(f"loadavg after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    result = {"workload": {k: getattr(o, k) for k in ("workers", "overhead_tokens",
                                                      "overhead_block_size")},
              "routing_overhead": overhead,
              "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "loadavg_before": load0,
                          "loadavg_after": load1}}
    _write(o, result)
    return result


def _print_machine(load: tuple[float, float, float]) -> None:
    print(f"machine: {cpu_name()}, {platform.machine()} {os.cpu_count()} cpus, python "
          f"{platform.python_version()}, loadavg {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


def _write(o: RoutingBenchOptions, result: dict) -> None:
    if o.out:
        Path(o.out).parent.mkdir(parents=True, exist_ok=True)
        Path(o.out).write_text(json.dumps(result, indent=2))
