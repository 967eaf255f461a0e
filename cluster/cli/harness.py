"""``pdserve bench-harness``: ``pdserve bench`` against the external load testers
(guidellm, aiperf, ``vllm bench serve``) on one server and one workload
(``benchmarks/external_harness.py``). Where each tool is comes from its flag, else the
environment (``PDSERVE_GUIDELLM``, ``PDSERVE_AIPERF``: the executables;
``PDSERVE_VLLM_PYTHON``: a python with vLLM), read here; else ``PATH``."""

from __future__ import annotations

import argparse
import os
import sys

from .options import EXIT_INVALID, add_setting, cache_dir


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-harness",
                       help="pdserve bench vs guidellm, aiperf and vllm bench serve on the "
                            "same server and workload: their figures side by side")
    p.add_argument("--target", default=None, metavar="http://HOST:PORT",
                   help="a running OpenAI-compatible server (pdserve's HTTP front); "
                        "default: start a local cluster on --model")
    p.add_argument("--model", default=None,
                   help="checkpoint directory of the cluster started here, and the default "
                        "--tokenizer (default: SmolLM2)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the served model's tokenizer directory, which the external tools "
                        "count tokens with (default: --model's directory)")
    p.add_argument("--topology", choices=("mixed", "disagg"), default="mixed",
                   help="the cluster started here: 1 mixed worker, or 1 prefill + 1 decode")
    add_setting(p, "dtype")
    add_setting(p, "threads_per_worker")
    add_setting(p, "kv_cache_gb")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tools", default="guidellm,aiperf,vllm",
                   help="comma-separated, of: guidellm, aiperf, vllm")
    p.add_argument("--guidellm", default=None, metavar="PATH",
                   help="guidellm's executable (default: $PDSERVE_GUIDELLM, else PATH)")
    p.add_argument("--aiperf", default=None, metavar="PATH",
                   help="aiperf's executable (default: $PDSERVE_AIPERF, else PATH)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="a python with vLLM, for vllm bench serve (default: "
                        "$PDSERVE_VLLM_PYTHON; neither: skipped)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per external tool")
    p.add_argument("--work-dir", default="bench-results/external-harness",
                   help="each tool's own output and console log go below it")
    p.add_argument("--out", default="bench-results/external-harness/external-harness.json")
    p.set_defaults(func=cmd_bench_harness)


def cmd_bench_harness(args: argparse.Namespace) -> int:
    from benchmarks.external_harness import HarnessOptions, run
    from benchmarks.external_tools import ENV_VARS, TOOLS, Workload
    from workers.model_store import resolve_model

    given = {"guidellm": args.guidellm, "aiperf": args.aiperf, "vllm": args.vllm_python}
    names = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = [t for t in names if t not in TOOLS]
    if unknown:
        print(f"pdserve bench-harness: unknown --tools {unknown}; choose among "
              f"{', '.join(TOOLS)}", file=sys.stderr)
        return EXIT_INVALID
    try:
        model = (None if args.target and args.tokenizer
                 else str(resolve_model(args.model, cache_dir(args))))
        opts = HarnessOptions(
            workload=Workload(args.num_requests, args.input_len, args.output_len,
                              args.max_concurrency, args.seed),
            target=args.target, model=None if args.target else model,
            tokenizer=args.tokenizer or model, topology=args.topology, dtype=args.dtype,
            threads=args.threads_per_worker, kv_cache_gb=args.kv_cache_gb,
            tools={t: given[t] or os.environ.get(ENV_VARS[t]) for t in names},
            timeout_s=args.timeout_s, work_dir=args.work_dir, out=args.out)
    except ValueError as e:
        print(f"pdserve bench-harness: {e}", file=sys.stderr)
        return EXIT_INVALID
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run(opts, lambda line: print(line, flush=True))
    failed = [r["harness"] for r in result["runs"] if r["error"]]
    if failed:
        print(f"pdserve bench-harness: {', '.join(failed)} failed (see the table); exit 1",
              file=sys.stderr)
        return 1
    return 0
