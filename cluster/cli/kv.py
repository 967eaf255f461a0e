"""``pdserve eval-kv``: the accuracy of each quantized KV cache format against the
model-precision cache (``benchmarks/eval_kv.py``): perplexity, KL divergence, greedy
agreement on a fixed offline corpus; a table, JSON and a plot.

``pdserve bench-kv``: the other side (``benchmarks/kv_capacity.py``): concurrent
sequences at a fixed KV budget, decode throughput at a large batch and long context, and
KV bytes and time per request through a real prefill -> decode transfer; runs itself in
a private network namespace (``unshare -n``) when it can."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
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
    p.add_argument("--ablate", action="store_true",
                   help="also score each format with only K or only V quantized, "
                        "without the rotation, and without (parts of) the key transform")
    p.add_argument("--weights", default="", metavar="FORMATS",
                   help="comma-separated weight formats to compare too, with the "
                        "model-precision KV cache: int8 (--quantization int8), bfloat16, "
                        "float32 (the whole model in that dtype)")
    p.add_argument("--out", default="bench-results/eval-kv")
    p.set_defaults(func=cmd_eval_kv)
    register_bench_kv(sub)


def cmd_eval_kv(args: argparse.Namespace) -> int:
    from benchmarks.eval_kv import EvalOptions, markdown, plot, run_eval
    from benchmarks.machine import machine_line
    from common.kv_cache_dtype import compared_kv_dtypes
    from workers.model_store import resolve_model

    try:
        kv_dtypes = compared_kv_dtypes(args.kv_cache_dtypes)
    except ValueError as e:
        print(f"pdserve eval-kv: {e}", file=sys.stderr)
        return EXIT_INVALID
    path = resolve_model(args.model, cache_dir(args))
    try:
        options = EvalOptions(model=str(path), kv_dtypes=kv_dtypes, dtype=args.dtype,
                              windows=args.windows, window_tokens=args.window_tokens,
                              prompts=args.prompts, prompt_tokens=args.prompt_tokens,
                              gen_tokens=args.gen_tokens, threads=args.threads,
                              ablate=args.ablate,
                              weights=tuple(w for w in args.weights.split(",") if w))
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


# ``pdserve bench-kv``: (flag, type, default, help); the namespace re-exec rebuilds the
# command line from the same table.
_BENCH_KV_FLAGS: list[tuple[str, type, object, str]] = [
    ("--model", str, None, "checkpoint directory (default: SmolLM2)"),
    ("--cache-dir", str, None, "model cache directory"),
    ("--kv-cache-dtypes", str, None, "comma-separated (default: all); auto (the "
                                     "reference) is always first"),
    ("--dtype", str, "auto", "model dtype: auto (bf16 where native), float32, bfloat16"),
    ("--kv-cache-gb", float, 0.25, "KV budget of the capacity run and the clusters (GiB)"),
    ("--seq-tokens", int, 512, "capacity: tokens per sequence, prompt + generated"),
    ("--output-tokens", int, 64, "capacity: generated tokens of each sequence"),
    ("--max-num-seqs", int, 1024, "capacity: the engine's max_num_seqs (far above what fits)"),
    ("--decode-batch", int, 32, "decode: sequences in the batch"),
    ("--decode-context", int, 1024, "decode: prompt tokens of each sequence"),
    ("--decode-steps", int, 4, "decode: timed steps per round"),
    ("--decode-rounds", int, 5, "decode: rounds, each timing every dtype's steps in turn"),
    ("--warmup-steps", int, 4, "decode: untimed steps of each engine before the rounds"),
    ("--requests", int, 8, "transfer: requests per KV dtype (after one warm-up)"),
    ("--request-tokens", int, 512, "transfer: prompt tokens of each request"),
    ("--request-max-tokens", int, 2, "transfer: max_tokens of each request"),
    ("--threads", int, 2, "torch threads of the offline engine (capacity, decode)"),
    ("--worker-threads", int, 1, "transfer: threads of each cluster worker"),
    ("--parts", str, "capacity,decode,transfer", "comma-separated subset"),
    ("--seed", int, 0, "prompts' random seed"),
    ("--out", str, "bench-results/bench-kv", "folder for bench-kv.json, .md, .png"),
]


def register_bench_kv(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-kv", help="capacity, decode speed and transfer bytes of each "
                                        "--kv-cache-dtype vs the model-precision cache")
    for flag, kind, default, text in _BENCH_KV_FLAGS:
        p.add_argument(flag, type=kind, default=default, help=text)
    p.add_argument("--full-forward", action="store_true",
                   help="run the model in the capacity run and the decode batch's prefill "
                        "too (same counts and step times; NVFP4's prefill takes minutes)")
    p.add_argument("--no-netns", action="store_true",
                   help="run the clusters in this network namespace (loopback only) instead "
                        "of re-running in a private one (unshare -n)")
    p.set_defaults(func=cmd_bench_kv)


def _bench_kv_argv(args: argparse.Namespace) -> list[str]:
    argv = ["bench-kv"]
    for flag, _, _, _ in _BENCH_KV_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--full-forward"] if args.full_forward else [])


def _netns(args: argparse.Namespace) -> tuple[str, bool]:
    """(where the clusters run, whether to re-exec under ``unshare -n`` first)."""
    from benchmarks.kv_capacity import NETNS_ENV, interfaces, isolated, lo_up

    if "transfer" not in args.parts.split(","):
        return "no cluster started", False
    if isolated(interfaces()):
        if os.environ.get(NETNS_ENV):
            lo_up()
        return "private network namespace (only lo)", False
    if args.no_netns:
        return "this host's network namespace (--no-netns; servers bind 127.0.0.1)", False
    if os.environ.get(NETNS_ENV) or shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-n", "true"], capture_output=True).returncode:
        return ("this host's network namespace (unshare -n is not available; servers "
                "bind 127.0.0.1)"), False
    return "", True


def cmd_bench_kv(args: argparse.Namespace) -> int:
    from benchmarks import kv_capacity as bench
    from benchmarks.machine import machine_line
    from common.kv_cache_dtype import compared_kv_dtypes
    from workers.model_store import resolve_model

    netns, reexec = _netns(args)
    if reexec:
        print("pdserve bench-kv: re-running inside a private network namespace (unshare -n)",
              flush=True)
        argv = bench.netns_argv(sys.executable, _bench_kv_argv(args))
        os.execvpe(argv[0], argv, {**os.environ, bench.NETNS_ENV: "1"})
    try:
        kv_dtypes = compared_kv_dtypes(args.kv_cache_dtypes)
    except ValueError as e:
        print(f"pdserve bench-kv: {e}", file=sys.stderr)
        return EXIT_INVALID
    path = resolve_model(args.model, cache_dir(args))
    try:
        options = bench.BenchKVOptions(
            model=str(path), kv_dtypes=kv_dtypes, dtype=args.dtype,
            kv_cache_gb=args.kv_cache_gb, seq_tokens=args.seq_tokens,
            output_tokens=args.output_tokens, max_num_seqs=args.max_num_seqs,
            decode_batch=args.decode_batch, decode_context=args.decode_context,
            decode_steps=args.decode_steps, decode_rounds=args.decode_rounds,
            warmup_steps=args.warmup_steps,
            requests=args.requests, request_tokens=args.request_tokens,
            request_max_tokens=args.request_max_tokens, threads=args.threads,
            worker_threads=args.worker_threads, full_forward=args.full_forward,
            parts=tuple(x for x in args.parts.split(",") if x), seed=args.seed)
    except ValueError as e:
        print(f"pdserve bench-kv: {e}", file=sys.stderr)
        return EXIT_INVALID
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    header = f"pdserve bench-kv on {path.name}, {machine_line()}"
    print(header, flush=True)
    print(f"workload: {bench.workload_line(asdict(options))}", flush=True)
    print(f"network: {netns}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = bench.run_bench(options, out, machine_line(), netns,
                             lambda line: print(line, flush=True))
    md = bench.markdown(report, header)
    (out / "bench-kv.md").write_text(md + "\n")
    (out / "bench-kv.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    bench.plot(report, str(out / "bench-kv.png"))
    print(md)
    print(f"wrote {out}/bench-kv.md, bench-kv.json, bench-kv.png")
    return 0
