"""``pdserve bench-disagg``: the KV transfer on the serving path, and disaggregated TTFT.

One run, real processes on loopback, the default model (``pdserve up``'s code):

1. **Transfer rate.** A 1 prefill + 1 decode cluster (one thread each, every prompt sent
   remote). Lone prompts of ``--tokens`` tokens (unique, so nothing is cached) go one at
   a time; the prefill worker's transfer counters give, per request, the KV bytes and
   the time from KV ready (the gather out of the paged cache) to landed in the decode
   worker's reserved blocks. Interleaved with each request, the same number of bytes is
   copied over a raw TCP socket between two processes (``benchmarks.transfer``'s
   child: ``sendall`` into ``recv_into`` a preallocated buffer), the loopback link's
   practical limit. Target: at least 80% of the raw rate.
2. **TTFT.** Lone prompts of ``--ttft-tokens`` tokens through that disaggregated cluster
   and through a colocated one with the same resources (2 mixed workers, one thread
   each), client-measured time to first token. Target: disaggregated within 10%.

Prints the workload, the machine and its load, a table and the ratios; ``--out`` writes
the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.local import LocalCluster, LocalClusterConfig, free_port
from router.client import Client


@dataclass(frozen=True)
class DisaggBenchOptions:
    model: str
    tokens: int = 2048
    ttft_tokens: int = 1024
    iters: int = 5
    out: str | None = None


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


@contextmanager
def _cluster(opts: DisaggBenchOptions, **kw: object) -> Iterator[LocalCluster]:
    cfg = LocalClusterConfig(model=opts.model, port=free_port(), http_port=0, metrics_port=None,
                             kv_cache_gb=0.5, threads_per_worker=1, **kw)  # type: ignore[arg-type]
    with LocalCluster(cfg) as cluster:
        cluster.wait_ready()
        yield cluster


def _prefill_stats(client: Client) -> tuple[int, float, dict[str, int]]:
    [w] = [w for w in client.status().workers if w.role == "prefill"]
    return w.transfers.bytes_moved, w.transfers.busy_s, dict(w.transfers.entered)


class _RawLink:
    """A raw TCP copy into another process (the transfer bench's child)."""

    def __init__(self) -> None:
        from benchmarks.transfer import Child

        self.child = Child(argparse.Namespace(chunk_bytes=8 << 20, window=4, dest="paged"))
        self.sock = socket.create_connection(("127.0.0.1", self.child.raw_port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def copy(self, nbytes: int) -> float:
        payload = memoryview(torch.randn(nbytes // 4).view(torch.uint8).numpy()).cast("B")
        start = time.perf_counter()
        self.child.say(f"raw {nbytes}")
        self.sock.sendall(payload)
        if self.child.read() != "done":
            raise RuntimeError("raw copy failed")
        return time.perf_counter() - start

    def close(self) -> None:
        self.child.say("exit")
        self.child.proc.wait(30)
        self.sock.close()


def _ttft(client: Client, prompt: list[int]) -> float:
    c = client.generate(prompt, max_tokens=2, temperature=0.0, ignore_eos=True)
    return c.ttft_s


def run(opts: DisaggBenchOptions) -> dict:
    rng = random.Random(0)
    load0 = os.getloadavg()
    print(f"workload: {opts.iters} lone {opts.tokens}-token prompts for the transfer, "
          f"{opts.iters} lone {opts.ttft_tokens}-token prompts for TTFT (after 1 warm-up "
          f"each), random token ids (nothing cached), max_tokens 2, model "
          f"{Path(opts.model).name} float32")
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"python {platform.python_version()}, loadavg {load0[0]:.2f} {load0[1]:.2f} "
          f"{load0[2]:.2f}; every worker 1 thread")
    rates, raw_rates, sizes, disagg_ttft, mixed_ttft = [], [], [], [], []
    link = _RawLink()
    try:
        with _cluster(opts, prefill=1, decode=1, local_prefill_threshold=0) as cluster, \
                Client(cluster.target) as client:
            for i in range(opts.iters + 1):
                b0, s0, _ = _prefill_stats(client)
                client.generate(_prompt(rng, opts.tokens), max_tokens=2, temperature=0.0,
                                ignore_eos=True)
                time.sleep(0.2)  # the counters are final once the transfer is done
                b1, s1, entered = _prefill_stats(client)
                raw_s = link.copy(b1 - b0)
                if i == 0:
                    continue
                sizes.append(b1 - b0)
                rates.append((b1 - b0) / (s1 - s0))
                raw_rates.append((b1 - b0) / raw_s)
                print(f"  transfer {i}: {(b1 - b0) / 1e6:.1f} MB in {(s1 - s0) * 1e3:.1f} ms "
                      f"= {rates[-1] / 1e9:.2f} GB/s; raw TCP {raw_rates[-1] / 1e9:.2f} GB/s",
                      flush=True)
            failed = entered.get("failed", 0) + entered.get("timed_out", 0)
            for i in range(opts.iters + 1):
                t = _ttft(client, _prompt(rng, opts.ttft_tokens))
                if i:
                    disagg_ttft.append(t)
        with _cluster(opts, mixed=2) as cluster, Client(cluster.target) as client:
            for i in range(opts.iters + 1):
                t = _ttft(client, _prompt(rng, opts.ttft_tokens))
                if i:
                    mixed_ttft.append(t)
    finally:
        link.close()
    med = statistics.median
    rate, raw = med(rates), med(raw_rates)
    td, tm = med(disagg_ttft), med(mixed_ttft)
    load1 = os.getloadavg()
    print(f"\n{'measure':<44}{'ours':>12}{'baseline':>12}{'ratio':>8}  target")
    print(f"{'KV transfer GB/s (median), vs raw TCP':<44}{rate / 1e9:>12.2f}{raw / 1e9:>12.2f}"
          f"{rate / raw:>8.0%}  >= 80%")
    print(f"{'TTFT ms (median), disagg 1P+1D vs 2 mixed':<44}{td * 1e3:>12.1f}{tm * 1e3:>12.1f}"
          f"{td / tm:>8.2f}  <= 1.10")
    print(f"transfer GB/s per request: min {min(rates) / 1e9:.2f}, max {max(rates) / 1e9:.2f}; "
          f"raw TCP min {min(raw_rates) / 1e9:.2f}, max {max(raw_rates) / 1e9:.2f}")
    print(f"transfers failed or timed out: {failed}; loadavg after {load1[0]:.2f} "
          f"{load1[1]:.2f} {load1[2]:.2f}")
    result = {
        "workload": {"tokens": opts.tokens, "ttft_tokens": opts.ttft_tokens,
                     "iters": opts.iters, "model": Path(opts.model).name},
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                    "loadavg_before": load0, "loadavg_after": load1},
        "kv_bytes": sizes, "transfer_Bps": rates, "raw_tcp_Bps": raw_rates,
        "transfer_vs_raw": rate / raw, "ttft_disagg_s": disagg_ttft,
        "ttft_mixed_s": mixed_ttft, "ttft_ratio": td / tm, "transfers_failed": failed,
    }
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(json.dumps(result, indent=2))
    return result
