"""How a long-lived server's block tables slow the decode attention down.

The engine benchmarks decode over tables that are runs of consecutive blocks, an ideal
layout. A fresh engine comes close (each prompt's blocks in id order; blocks taken as
contexts grow interleave across the sequences decoding together). A server that has run
for a while hands out whatever its free queue holds: blocks come back in the order
sequences finish, and every decode step that fills a block takes the queue's head.

This benchmark drives the real :class:`~workers.engine.block_manager.BlockManager` (no
model: pure bookkeeping) through that churn, ``batch`` sequences decoding at once, each
replaced by a fresh one when its output is done, then runs the native decode attention
over the block tables it ended with against the same contexts in consecutive blocks,
alternated in one process, on a cache of the model's shape.

``python -m benchmarks.kv_layout [--block-size 16] [--batch 256] [--steps 3000]
[--kv-cache-gb 4] [--heads 9 --kv-heads 3 --head-dim 64 --layers 30] [--repeats 5]``
prints the machine, the churn (how many consecutive pairs of table entries are adjacent
blocks), and the median time of one decode step's attention over every layer for both
layouts and their ratio. The defaults are SmolLM2-135M in float32 with ``pdserve up``'s
block size.

Lifecycle: churn (seeded, no torch) -> the tables and lengths -> a float32 cache of
``kv-cache-gb`` -> ``repeats`` rounds of (server tables, consecutive tables), each timed
after one untimed pass -> the table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from itertools import pairwise

from workers.engine.block_manager import BlockManager
from workers.engine.params import SamplingParams
from workers.engine.sequence import Sequence

from .machine import machine_line

VOCAB = (100, 40000)  # token ids the churn draws prompts and outputs from


@dataclass(frozen=True)
class Churn:
    """What :func:`churn_tables` drives through the block manager."""

    num_blocks: int
    block_size: int
    batch: int = 256
    steps: int = 3000
    prompt_len: int = 128
    output_len: tuple[int, int] = (32, 256)  # each sequence's, drawn uniformly
    seed: int = 0


@dataclass(frozen=True)
class Tables:
    """The block tables and context lengths of the sequences running at the end."""

    tables: list[list[int]]
    lens: list[int]
    adjacent: float  # of consecutive table entries, the share that are adjacent blocks
    sequences: int  # how many sequences the churn started


def adjacent_share(tables: list[list[int]]) -> float:
    pairs = sum(len(t) - 1 for t in tables)
    return sum(b == a + 1 for t in tables for a, b in pairwise(t)) / pairs if pairs else 1.0


def churn_tables(c: Churn) -> Tables:
    """Run ``c.steps`` decode steps of ``c.batch`` sequences through a prefix-caching
    block manager as an engine does (each prompt's blocks allocated at once and cached,
    then one token per step, a block taken whenever one fills, a finished sequence's
    blocks freed and a fresh prompt started in its place). Random prompts share no prefix,
    so every block the churn takes comes from the free queue's head."""
    rng = random.Random(c.seed)
    bm = BlockManager(c.num_blocks, c.block_size)
    params = SamplingParams(max_tokens=c.output_len[1])
    running: list[tuple[Sequence, int]] = []
    started = 0

    def token() -> int:
        return rng.randrange(*VOCAB)

    def grow(seq: Sequence) -> None:  # compute the next token's slot, then sample it
        if not bm.allocate(seq, seq.num_tokens + 1):
            raise RuntimeError(f"{c.num_blocks} blocks cannot hold {c.batch} sequences: "
                               "raise --kv-cache-gb or lower --batch")
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_computed_blocks(seq)
        seq.append_token(token())

    for _ in range(c.steps):
        while len(running) < c.batch:
            started += 1
            seq = Sequence(f"s{started}", [token() for _ in range(c.prompt_len)], params,
                           started, c.block_size, "churn")
            bm.take_prefix(seq, bm.match_prefix(seq))
            grow(seq)
            running.append((seq, rng.randint(*c.output_len)))
        for seq, _ in running:
            grow(seq)
        for seq, target in running:
            if seq.num_output_tokens >= target:
                bm.free(seq)
        running = [(s, t) for s, t in running if s.num_output_tokens < t]
    tables = [list(s.block_table) for s, _ in running]
    return Tables(tables, [s.num_tokens for s, _ in running], adjacent_share(tables), started)


def consecutive(tables: list[list[int]]) -> list[list[int]]:
    """The same table lengths, each table a run of block ids, one after another."""
    out, start = [], 0
    for t in tables:
        out.append(list(range(start, start + len(t))))
        start += len(t)
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from workers.engine import kernels

    ap = argparse.ArgumentParser(prog="python -m benchmarks.kv_layout",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3000, help="decode steps of churn")
    ap.add_argument("--kv-cache-gb", type=float, default=4.0)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if kernels.load() is None:
        print(f"native kernels unavailable: {kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    B, KV, D, L = args.block_size, args.kv_heads, args.head_dim, args.layers
    block_bytes = 2 * L * B * KV * D * 4  # K and V of every layer, float32
    num_blocks = int(args.kv_cache_gb * 2**30 // block_bytes)
    t = churn_tables(Churn(num_blocks, B, args.batch, args.steps))
    width = max(len(x) for x in t.tables)
    lens = torch.tensor(t.lens, dtype=torch.int32)
    layouts = {name: torch.tensor([x + [0] * (width - len(x)) for x in tabs], dtype=torch.int32)
               for name, tabs in (("server", t.tables), ("consecutive", consecutive(t.tables)))}
    k = [torch.randn(num_blocks, B, KV, D) for _ in range(L)]
    v = [torch.randn(num_blocks, B, KV, D) for _ in range(L)]
    q = torch.randn(len(t.lens), args.heads, D)
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(args.repeats):
        for name, table in layouts.items():
            for timed in (False, True):
                start = time.perf_counter()
                for layer in range(L):
                    kernels.paged_decode_attention(q, k[layer], v[layer], table, lens)
                if timed:
                    times[name].append(time.perf_counter() - start)
    kv_gb = 2 * L * int(lens.sum()) * KV * D * 4 / 1e9
    print(f"{machine_line()}; {args.threads} thread(s); decode attention, float32, "
          f"{args.heads} heads / {KV} kv heads x {D}, {L} layers, block size {B}, "
          f"{num_blocks} blocks ({args.kv_cache_gb:g} GB)")
    print(f"churn: {args.steps} steps of {args.batch} sequences (prompts of 128, outputs of "
          f"32-256), {t.sequences} started; at the end {len(t.lens)} contexts of "
          f"{statistics.mean(t.lens):.0f} tokens on average, {kv_gb:.2f} GB of KV; adjacent "
          f"table entries: {t.adjacent:.0%} (consecutive layout: 100%)")
    server, base = (statistics.median(times[n]) * 1e3 for n in ("server", "consecutive"))
    print(f"{'layout':>12}{'ms':>10}{'GB/s':>8}")
    for name, ms in (("server", server), ("consecutive", base)):
        print(f"{name:>12}{ms:>10.1f}{kv_gb / ms * 1e3:>8.1f}")
    print(f"server / consecutive: {server / base:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
