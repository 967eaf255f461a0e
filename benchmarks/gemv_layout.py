"""The decode GEMV on its tiles against the same kernel on row-major weights:
single-stream decode (one 128-token prompt -> 64 tokens, greedy) on the default model,
both layouts in one process, alternated run by run, so a drifting VM moves both.

``python -m benchmarks.gemv_layout [--dtype float32|bfloat16] [--threads N] [--runs N]
[--model PATH]`` prints the machine, the layout the engine chose at load (and the
timings it chose by), each layout's ITL per run and median, each against the bandwidth
floor (the model's weight bytes at a measured copy bandwidth), the ratio, and for how
many tokens the two layouts' greedy outputs agree; it exits 1 if even the first differs.

Lifecycle: one :class:`~workers.engine.llm.LLM` (the engine's own weights, in the layout
:func:`workers.engine.kernels.time_gemv_tiles` chose) -> a second set of the same
:class:`~workers.models.linear.DualWeight` objects with the GEMV's weight in the other
layout -> ``runs`` rounds of (tiles, row-major) generations, swapping the model's layer
list and LM head between them -> the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Callable

from workers.engine import kernels
from workers.engine.llm import LLM
from workers.engine.params import SamplingParams
from workers.model_store import resolve_model
from workers.models.decoder import DecoderModel
from workers.models.linear import DualWeight

from .engine import copy_bandwidth_gbs, random_prompts
from .machine import machine_line


def row_major(d: DualWeight) -> DualWeight:
    """``d`` with its GEMV weight as plain ``[out, in]`` rows (the tiles' padding cut)."""
    g = d.gemv
    if not isinstance(g, kernels.GemvTiles):
        return d
    plain = g.data.permute(0, 2, 1, 3).reshape(-1, g.shape[1])[:g.n].contiguous()
    return DualWeight(plain, d.packed)


def tiled(d: DualWeight) -> DualWeight:
    """``d`` with its GEMV weight in tiles (where K is whole chunks)."""
    if isinstance(d.gemv, kernels.GemvTiles):
        return d
    return DualWeight(kernels.gemv_tiles_where_whole(d.gemv), d.packed)


def _swap(model: DecoderModel, to: Callable[[DualWeight], DualWeight]) -> tuple[list, object]:
    return ([dataclasses.replace(lw, **{k: to(v) for k, v in vars(lw).items()
                                        if isinstance(v, DualWeight)})
             for lw in model.layers], to(model.lm_head))


def _layouts(model: DecoderModel) -> dict[str, tuple[list, object]]:
    return {"tiles": _swap(model, tiled), "row-major": _swap(model, row_major)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gemv_layout",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", default=None, help="a local model directory (default: the "
                    "default model, converted on first use)")
    args = ap.parse_args(argv)
    llm = LLM(str(resolve_model(args.model, None)), dtype=args.dtype, kv_cache_memory_gb=0.5,
              num_threads=args.threads)
    model = llm.engine.runner.model
    timing = llm.engine.runner.gemv_tiling
    if not isinstance(model.lm_head, DualWeight) or timing is None:
        print("the engine runs no native GEMV here (no native kernels, or no room for its "
              "copy of the weights): nothing to compare", file=sys.stderr)
        return 0
    chose = "tiles" if timing.tiles else "row-major"
    layouts = _layouts(model)
    [prompt] = random_prompts(1, 128, llm.engine.runner.vocab_size, 7)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    itl: dict[str, list[float]] = {name: [] for name in layouts}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.runs):
        for name, (layers, head) in layouts.items():
            model.layers[:] = layers
            model.lm_head = head
            out = llm.generate([prompt], params)[0]
            tokens.setdefault(name, list(out.token_ids))
            itl[name].append((out.finish_time - out.first_token_time)
                             / (len(out.token_ids) - 1) * 1e3)
    model.layers[:], model.lm_head = layouts[chose]
    bw = copy_bandwidth_gbs()
    floor = model.weight_bytes() / (bw * 1e9) * 1e3
    print(f"{machine_line()}; {args.threads} thread(s); single stream 128 -> 64 tokens, "
          f"greedy, {model.dtype}; bandwidth floor {floor:.1f} ms ({bw:.1f} GB/s copy)")
    print(f"the engine chose {chose} at load (one row through {timing.weight_bytes >> 20} MB "
          f"of layer weights: row-major {timing.row_major_s * 1e3:.2f} ms, tiles "
          f"{timing.tiles_s * 1e3:.2f} ms)")
    print(f"{'layout':<10}{'ITL median ms':>14}{'x floor':>9}  runs (ms)")
    for name, v in itl.items():
        m = statistics.median(v)
        print(f"{name:<10}{m:>14.2f}{m / floor:>9.2f}  {', '.join(f'{x:.1f}' for x in v)}")
    ratio = statistics.median(itl["tiles"]) / statistics.median(itl["row-major"])
    a, b = tokens["tiles"], tokens["row-major"]
    agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    print(f"tiles / row-major ITL: {ratio:.3f}; greedy tokens equal for {agree} of {len(a)}")
    # The layouts sum in different orders on an AVX-512 build (tiles: 8 lanes, row-major:
    # 16), so a near-tie can flip a later token (bf16 rounds each output); never the first.
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
