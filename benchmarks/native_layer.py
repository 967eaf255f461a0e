"""Decode steps through one path against another, toggled step by step in one engine on
the default model, so a drifting VM moves both. The comparisons (``--compare``):

- ``native-layer`` (the default): each decoder layer as one native call
  (``kernels.decode_layer``) against the Python layer;
- ``row-walk``: the decode attention's row-order walk (a sequence's cache rows read
  whole, in memory order) against its per-head walk (``kernels.set_row_walk``);
- ``int8-rows`` (with ``--quantization int8``): the int8 GEMV up to the rows the model
  runner timed at load (``kernels.time_int8_gemv_rows``) against the fixed default
  (``kernels.INT8_GEMV_ROWS``), past which the kernel dequantizes and runs a GEMM;
- ``argmax``: the greedy sampler's argmax by the native kernel (``kernels.argmax_rows``)
  against torch's ``argmax``.

``python -m benchmarks.native_layer [--compare native-layer|row-walk|int8-rows|argmax] [--dtype
float32|bfloat16] [--quantization int8] [--threads N] [--batches 1,32,256] [--steps N]
[--model PATH]`` prints the machine, then per batch size the median decode step of each
path and their ratio; first it checks that both paths give the same greedy tokens (one
128-token prompt -> 32 tokens) and exits 1 if they do not.

Lifecycle: one :class:`~workers.engine.llm.LLM` -> the greedy check (path a, then b) ->
per batch size, requests put straight into decode
(:func:`benchmarks.step_profile.start_decoding`: no prefill), two warm-up steps, then
``steps`` rounds of (a step, b step) -> every request aborted -> the table.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from workers.engine import kernels
from workers.engine.llm import LLM
from workers.engine.model_runner import ModelRunner
from workers.engine.params import SamplingParams
from workers.model_store import resolve_model
from workers.models.linear import int8_linear

from .engine import random_prompts
from .machine import machine_line
from .step_profile import PROMPT_LEN, start_decoding


@dataclass(frozen=True)
class Switch:
    """Two paths of one engine: ``use(True)`` selects path ``a``, ``use(False)`` ``b``."""

    a: str
    b: str
    use: Callable[[bool], object]


def switch(compare: str, runner: ModelRunner) -> Switch | None:
    """The switch for ``compare`` on ``runner``'s model, or None where this build (or
    model) has only one path."""
    model = runner.model
    if compare == "argmax":
        sampler, native = runner.sampler, runner.sampler.argmax
        if native is None:
            return None
        return Switch("native", "torch",
                      lambda on: setattr(sampler, "argmax", native if on else None))
    if compare == "row-walk":
        return Switch("rows", "per head", kernels.set_row_walk) if kernels.available() else None
    if compare == "int8-rows":
        if runner.int8_rows is None or ", head" in model.linear_name:
            return None  # no int8 kernel, or an LM head the swap below would not cover
        rows = kernels.INT8_GEMV_ROWS
        measured = (model.linear, model.layer_op)
        fixed = (int8_linear(functools.partial(kernels.int8_linear, max_gemv_rows=rows)).apply,
                 functools.partial(kernels.decode_layer, int8_gemv_rows=rows)
                 if model.layer_op is not None else None)

        def use(on: bool) -> None:
            model.linear, model.layer_op = measured if on else fixed

        return Switch(f"<={runner.int8_rows.rows}", f"<={rows}", use)
    native = model.layer_op
    if native is None:
        return None
    return Switch("native", "Python", lambda on: setattr(model, "layer_op", native if on else None))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.native_layer",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", choices=("native-layer", "row-walk", "int8-rows", "argmax"),
                    default="native-layer")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--quantization", choices=("int8",), default=None,
                    help="int8 weights (the layers' and the LM head's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per path and batch")
    ap.add_argument("--model", default=None, help="a local model directory (default: the "
                    "default model, converted on first use)")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(str(resolve_model(args.model, None)), dtype=args.dtype, num_threads=args.threads,
              quantization=args.quantization,
              kv_cache_memory_gb=max(0.5, max(batches) * (PROMPT_LEN + 64) * 50e3 / 2**30))
    engine = llm.engine
    model = engine.runner.model
    sw = switch(args.compare, engine.runner)
    if sw is None:
        why = ("no int8 kernel here (int8-rows needs --quantization int8 and the native "
               "kernels)" if args.compare == "int8-rows" else "no native kernels here")
        print(f"only one path: {why}; nothing to compare", file=sys.stderr)
        return 0
    vocab = engine.runner.vocab_size
    [prompt] = random_prompts(1, PROMPT_LEN, vocab, 7)
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    tokens = []
    for on in (True, False):
        sw.use(on)
        tokens.append(list(llm.generate([prompt], greedy)[0].token_ids))
    sw.use(True)
    weights = f", {args.quantization} weights" if args.quantization else ""
    print(f"{machine_line()}; {args.threads} thread(s); {model.dtype}{weights}; "
          f"{args.compare}: decode steps of {PROMPT_LEN}-token contexts, greedy; each path "
          f"{args.steps} steps, alternated")
    print(f"greedy tokens (128 -> 32): {'equal' if tokens[0] == tokens[1] else 'DIFFER'}"
          + (" (int8-rows: the two paths sum in other orders, so a late token may differ)"
             if args.compare == "int8-rows" and tokens[0] != tokens[1] else ""))
    print(f"{'batch':>6}{sw.a + ' ms':>13}{sw.b + ' ms':>13}{'ratio':>8}")
    for batch in batches:
        ids = start_decoding(engine, random_prompts(batch, PROMPT_LEN, vocab, batch),
                             max_tokens=2 * args.steps + 8)
        try:
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(2):
                engine.step()
            for _ in range(args.steps):
                for on in (True, False):
                    sw.use(on)
                    t = time.perf_counter()
                    engine.step()
                    times[on].append(time.perf_counter() - t)
        finally:
            sw.use(True)
            for rid in ids:
                engine.abort_request(rid)
            engine.scheduler.block_manager.reset_prefix_cache()
        a, b = (statistics.median(times[on]) * 1e3 for on in (True, False))
        print(f"{batch:>6}{a:>13.2f}{b:>13.2f}{a / b:>8.3f}")
    return 0 if tokens[0] == tokens[1] or args.compare == "int8-rows" else 1


if __name__ == "__main__":
    sys.exit(main())
