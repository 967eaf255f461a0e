"""``pdserve eval-kv``: the accuracy of each quantized KV cache format against the
model-precision cache (``benchmarks/eval_kv.py``): perplexity, KL divergence, greedy
agreement on a fixed offline corpus; a table, JSON and a plot."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from .options import EXIT_INVALID, cache_dir


def register(sub: argparse._SubParsersAction) -> None:
    from common.kv_cache_dtype import KV_CACHE_DTYPES

    p = sub.add_parser("eval-kv", help="perplexity, KL and greedy agreement of each "
                                       "--kv-cache-dtype vs the model-precision cache")
    p.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--kv-cache-dtypes", default=",".join(KV_CACHE_DTYPES),
                   help="comma-separated; auto (the reference) is always first")
    p.add_argument("--dtype", default="auto", help="model dtype (auto: bf16 where native)")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window-tokens", type=int, default=512)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench-results/eval-kv")
    p.set_defaults(func=cmd_eval_kv)


def cmd_eval_kv(args: argparse.Namespace) -> int:
    from benchmarks.eval_kv import EvalOptions, markdown, plot, run_eval
    from benchmarks.machine import machine_line
    from common.kv_cache_dtype import KV_CACHE_DTYPES
    from workers.model_store import resolve_model

    names = [n for n in args.kv_cache_dtypes.split(",") if n and n != "auto"]
    bad = sorted(set(names) - set(KV_CACHE_DTYPES))
    if bad:
        print(f"pdserve eval-kv: unknown KV cache dtypes {bad}; choose from "
              f"{', '.join(KV_CACHE_DTYPES)}", file=sys.stderr)
        return EXIT_INVALID
    path = resolve_model(args.model, cache_dir(args))
    try:
        options = EvalOptions(model=str(path), kv_dtypes=("auto", *names), dtype=args.dtype,
                              windows=args.windows, window_tokens=args.window_tokens,
                              prompts=args.prompts, prompt_tokens=args.prompt_tokens,
                              gen_tokens=args.gen_tokens, threads=args.threads)
    except ValueError as e:
        print(f"pdserve eval-kv: {e}", file=sys.stderr)
        return EXIT_INVALID
    header = f"pdserve eval-kv on {path.name}, {machine_line()}"
    print(header, flush=True)
    report = run_eval(options, lambda line: print(line, flush=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(report, header)
    (out / "eval-kv.md").write_text(md + "\n")
    (out / "eval-kv.json").write_text(json.dumps(
        {"machine": machine_line(), **asdict(report)}, indent=2) + "\n")
    plot(report, str(out / "eval-kv.png"))
    print(md)
    print(f"wrote {out}/eval-kv.md, eval-kv.json, eval-kv.png")
    return 0
