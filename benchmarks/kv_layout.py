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
alternated in one process, on a cache of the model's shape; and does so at each block
size asked for (the same sequences, the same cache rows seen as blocks of that size), so
the sizes compare in one run.

``python -m benchmarks.kv_layout [--block-sizes 64,16] [--batch 256] [--steps 3000]
[--kv-cache-gb 4] [--heads 9 --kv-heads 3 --head-dim 64 --layers 30] [--repeats 5]``
prints the machine, and per block size the churn (how many consecutive pairs of table
entries are adjacent blocks), the median time of one decode step's attention over every
layer for both layouts, their ratio, and the server tables' time against the first
size's. The defaults are SmolLM2-135M in float32 with the engine's CPU block size
(:data:`~workers.engine.params.DEFAULT_BLOCK_SIZES`) against 16, the size it had before.

Lifecycle: churn each size (seeded, no torch) -> the tables and lengths -> float32 cache
rows of ``kv-cache-gb`` -> ``repeats`` rounds of every (size, layout), each timed after
one untimed pass -> the table.
"""

from __future__ import annotations

import argparse
import math
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


def parse_block_sizes(text: str) -> list[int]:
    """``"64,16"`` -> ``[64, 16]``; ValueError unless every size is a positive integer."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"block sizes are positive integers like 64,16, got {text!r}")
    return sizes


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
    from workers.engine.params import default_block_size

    default = default_block_size("cpu")
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kv_layout",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-sizes", default=f"{default},16", help="tokens per block, "
                    "comma-separated; each is churned with the same sequences (default: "
                    f"the engine's CPU default {default}, then 16)")
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
    try:
        sizes = parse_block_sizes(args.block_sizes)
    except ValueError as e:
        ap.error(f"--block-sizes: {e}")
    if kernels.load() is None:
        print(f"native kernels unavailable: {kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    KV, D, L = args.kv_heads, args.head_dim, args.layers
    # One pool of cache rows per layer (K and V), seen as blocks of each size in turn.
    unit = math.lcm(*sizes)
    rows = int(args.kv_cache_gb * 2**30 // (2 * L * KV * D * 4)) // unit * unit
    k = [torch.randn(rows, KV, D) for _ in range(L)]
    v = [torch.randn(rows, KV, D) for _ in range(L)]
    cases: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    churned: dict[int, Tables] = {}
    for B in sizes:
        t = churned[B] = churn_tables(Churn(rows // B, B, args.batch, args.steps))
        width = max(len(x) for x in t.tables)
        lens = torch.tensor(t.lens, dtype=torch.int32)
        for name, tabs in (("server", t.tables), ("consecutive", consecutive(t.tables))):
            cases[B, name] = (torch.tensor([x + [0] * (width - len(x)) for x in tabs],
                                           dtype=torch.int32), lens)
    views = {B: ([x.view(rows // B, B, KV, D) for x in k], [x.view(rows // B, B, KV, D) for x in v])
             for B in sizes}
    q = torch.randn(max(len(t.lens) for t in churned.values()), args.heads, D)
    times: dict[tuple[int, str], list[float]] = {case: [] for case in cases}
    for _ in range(args.repeats):
        for (B, name), (table, lens) in cases.items():
            kb, vb = views[B]
            for timed in (False, True):
                start = time.perf_counter()
                for layer in range(L):
                    kernels.paged_decode_attention(q[:len(lens)], kb[layer], vb[layer],
                                                   table, lens)
                if timed:
                    times[B, name].append(time.perf_counter() - start)
    t0 = churned[sizes[0]]
    kv_gb = 2 * L * sum(t0.lens) * KV * D * 4 / 1e9
    print(f"{machine_line()}; {args.threads} thread(s); decode attention, float32, "
          f"{args.heads} heads / {KV} kv heads x {D}, {L} layers, "
          f"{args.kv_cache_gb:g} GB of cache")
    print(f"churn: {args.steps} steps of {args.batch} sequences (prompts of 128, outputs of "
          f"32-256), {t0.sequences} started; at the end {len(t0.lens)} contexts of "
          f"{statistics.mean(t0.lens):.0f} tokens on average, {kv_gb:.2f} GB of KV; the "
          f"median of {args.repeats} timed passes over every layer, alternated")
    first = statistics.median(times[sizes[0], "server"])
    print(f"{'block size':>10}{'adjacent':>10}{'server ms':>11}{'GB/s':>7}"
          f"{'consecutive ms':>16}{'server/consec':>15}{f'server vs {sizes[0]}':>15}")
    for B in sizes:
        server, base = (statistics.median(times[B, n]) for n in ("server", "consecutive"))
        print(f"{B:>10}{churned[B].adjacent:>10.0%}{server * 1e3:>11.1f}"
              f"{kv_gb / server:>7.1f}{base * 1e3:>16.1f}{server / base:>14.2f}x"
              f"{server / first:>14.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
