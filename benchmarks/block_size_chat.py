"""What a KV block size costs a multi-turn chat: prefix-cache hits land on whole blocks.

A conversation's next turn is its history (the last prompt, a reply, a new user message)
and finds that history in the prefix cache, but only up to the last whole block: the
rest of it is computed again. Larger blocks leave more over (half a block on average);
:mod:`benchmarks.kv_layout` measures what they save the decode attention. This runs the
real engine (the default model, or ``--model``) at each block size asked for, one engine
per size in one process, and sends every turn of ``--conversations`` seeded
conversations to each engine in turn (alternated, one prompt at a time, ``max_tokens``
1, so a turn's time is its prefill), then prints per size the prompt tokens the cache
served, those computed, and the mean and median time of the turns after the first, with
their ratio to the first size's.

``python -m benchmarks.block_size_chat [--block-sizes 16,64,128] [--conversations 8]
[--turns 3] [--dtype float32] [--threads 2]`` (~2 minutes on 2 cores).

Lifecycle: conversations (seeded) -> one engine per size -> turn by turn, every
conversation, every engine -> the table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from .kv_layout import parse_block_sizes
from .machine import machine_line

VOCAB = (100, 40000)
USER = (96, 288)  # tokens of each user message, drawn uniformly
REPLY = (32, 96)  # tokens of each reply the next turn carries


def conversations(n: int, turns: int, seed: int = 0) -> list[list[list[int]]]:
    """``n`` conversations of ``turns`` prompts; turn k's prompt is turn k-1's, a reply and
    a new user message (random ids: the reply stands in for what a server answered)."""
    rng = random.Random(seed)

    def ids(span: tuple[int, int]) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(rng.randint(*span))]

    out = []
    for _ in range(n):
        history: list[int] = []
        prompts = []
        for t in range(turns):
            history = history + (ids(REPLY) if t else []) + ids(USER)
            prompts.append(list(history))
        out.append(prompts)
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from workers.engine.llm import LLM
    from workers.engine.params import SamplingParams
    from workers.model_store import resolve_model

    ap = argparse.ArgumentParser(prog="python -m benchmarks.block_size_chat",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-sizes", default="16,64,128")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="a local model directory (default: the "
                    "default model, converted on first use)")
    args = ap.parse_args(argv)
    try:
        sizes = parse_block_sizes(args.block_sizes)
    except ValueError as e:
        ap.error(f"--block-sizes: {e}")
    if args.turns < 2 or args.conversations < 1:
        ap.error("--turns must be at least 2 and --conversations at least 1")
    torch.set_num_threads(args.threads)
    path = str(resolve_model(args.model, None))
    llms = {b: LLM(path, dtype=args.dtype, kv_cache_memory_gb=2.0, num_threads=args.threads,
                   block_size=b) for b in sizes}
    chats = conversations(args.conversations, args.turns)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = {b: 0 for b in sizes}
    cached = {b: 0 for b in sizes}
    later: dict[int, list[float]] = {b: [] for b in sizes}
    for turn in range(args.turns):
        for chat in chats:
            for b, llm in llms.items():
                start = time.perf_counter()
                out = llm.generate([chat[turn]], params)[0]
                elapsed = time.perf_counter() - start
                prompt[b] += len(chat[turn])
                cached[b] += out.num_cached_tokens
                if turn:
                    later[b].append(elapsed)
    print(f"{machine_line()}; {args.threads} thread(s); {path.rstrip('/').split('/')[-1]} "
          f"{args.dtype}")
    print(f"workload: {args.conversations} conversations x {args.turns} turns (user messages "
          f"of {USER[0]}-{USER[1]} tokens, replies of {REPLY[0]}-{REPLY[1]}), one prompt at "
          f"a time, max_tokens 1, every turn sent to each block size's engine in turn")
    first = statistics.mean(later[sizes[0]])
    print(f"{'block size':>10}{'cache served':>14}{'computed':>10}{'later turns mean ms':>21}"
          f"{'median ms':>11}{f'vs {sizes[0]}':>8}")
    for b in sizes:
        mean = statistics.mean(later[b])
        print(f"{b:>10}{cached[b] / prompt[b]:>14.1%}{prompt[b] - cached[b]:>10}"
              f"{mean * 1e3:>21.0f}{statistics.median(later[b]) * 1e3:>11.0f}"
              f"{mean / first:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
