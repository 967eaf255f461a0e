"""Decode steps with each decoder layer as one native call (``kernels.decode_layer``)
against the same steps through the Python layer, on the default model, toggled step by
step in one engine, so a drifting VM moves both.

``python -m benchmarks.native_layer [--dtype float32|bfloat16] [--threads N]
[--batches 1,32,256] [--steps N] [--model PATH]`` prints the machine, then per batch
size the median decode step of each path and their ratio; first it checks that both
paths give the same greedy tokens (one 128-token prompt -> 32 tokens) and exits 1 if
they do not.

Lifecycle: one :class:`~workers.engine.llm.LLM` -> the greedy check (the model's
``layer_op`` set, then None) -> per batch size, requests put straight into decode
(:func:`benchmarks.step_profile.start_decoding`: no prefill), two warm-up steps, then
``steps`` rounds of (native step, Python step) -> every request aborted -> the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from workers.engine.llm import LLM
from workers.engine.params import SamplingParams
from workers.model_store import resolve_model

from .engine import random_prompts
from .machine import machine_line
from .step_profile import PROMPT_LEN, start_decoding


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.native_layer",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per path and batch")
    ap.add_argument("--model", default=None, help="a local model directory (default: the "
                    "default model, converted on first use)")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(str(resolve_model(args.model, None)), dtype=args.dtype, num_threads=args.threads,
              kv_cache_memory_gb=max(0.5, max(batches) * (PROMPT_LEN + 64) * 50e3 / 2**30))
    engine = llm.engine
    model = engine.runner.model
    native = model.layer_op
    if native is None:
        print("the engine runs no native layer here (no native kernels): nothing to compare",
              file=sys.stderr)
        return 0
    vocab = engine.runner.vocab_size
    [prompt] = random_prompts(1, PROMPT_LEN, vocab, 7)
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    tokens = []
    for op in (native, None):
        model.layer_op = op
        tokens.append(list(llm.generate([prompt], greedy)[0].token_ids))
    model.layer_op = native
    print(f"{machine_line()}; {args.threads} thread(s); {model.dtype}; decode steps of "
          f"{PROMPT_LEN}-token contexts, greedy; each path {args.steps} steps, alternated")
    print(f"greedy tokens (128 -> 32): {'equal' if tokens[0] == tokens[1] else 'DIFFER'}")
    print(f"{'batch':>6}{'native ms':>11}{'Python ms':>11}{'ratio':>8}")
    for batch in batches:
        ids = start_decoding(engine, random_prompts(batch, PROMPT_LEN, vocab, batch),
                             max_tokens=2 * args.steps + 8)
        try:
            times: dict[object, list[float]] = {native: [], None: []}
            for _ in range(2):
                engine.step()
            for _ in range(args.steps):
                for op in (native, None):
                    model.layer_op = op
                    t = time.perf_counter()
                    engine.step()
                    times[op].append(time.perf_counter() - t)
        finally:
            model.layer_op = native
            for rid in ids:
                engine.abort_request(rid)
            engine.scheduler.block_manager.reset_prefix_cache()
        a, b = (statistics.median(times[op]) * 1e3 for op in (native, None))
        print(f"{batch:>6}{a:>11.2f}{b:>11.2f}{a / b:>8.3f}")
    return 0 if tokens[0] == tokens[1] else 1


if __name__ == "__main__":
    sys.exit(main())
