"""``pdserve plan``: which pool configuration serves a workload best on given resources,
predicted by the planner's simulator (``planner/``) from a machine profile
(``pdserve profile --out FILE``); nothing is started.

The workload is ``pdserve bench``'s (same flags: ``--workload``, lengths,
``--num-requests``, ``--request-rate``, ``--burstiness``, ``--seed``, ``--trace``), a
recorded run (``--details FILE``, what ``pdserve bench --out FILE`` wrote), or a
stationary synthetic trace sized to the resources (``--workload synthetic``). Prints a
table (the recommendation marked ``*``) or, with ``--json``, one JSON object on stdout;
``--plot FILE.png`` draws goodput, TTFT p90 and ITL p90 per candidate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from cluster.deployment import KV_OFFERS

from .options import EXIT_INVALID, cache_dir

WORKLOAD_CHOICES = ("random", "shared-prefix", "mixed", "multi-turn", "trace", "synthetic")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="predict TTFT/ITL/goodput/cost of every pool configuration "
                                    "for a workload on some cores or GPUs, and recommend one")
    p.add_argument("--profile", required=True, metavar="FILE",
                   help="the machine profile (pdserve profile --out FILE)")
    res = p.add_mutually_exclusive_group()
    res.add_argument("--cores", type=int, default=None,
                     help="CPU cores to spend: a worker of t threads takes t (default: this "
                          "machine's)")
    res.add_argument("--gpus", type=int, default=None,
                     help="GPUs to spend: one worker each, on the profile's 1-thread model")
    p.add_argument("--price-per-core-hour", type=float, default=0.05)
    p.add_argument("--price-per-gpu-hour", type=float, default=2.0)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--thresholds", default="0,64,256,1024",
                   help="local-prefill thresholds to try for disaggregated candidates")
    p.add_argument("--prefill-caps", default="0", metavar="CAPS",
                   help="stall-free caps to try, each candidate once per cap: comma-"
                        "separated `--prefill-tokens-while-decoding` values (0: none), or "
                        "auto: the live planner's (none, and the chunks of 3 and 6 "
                        "unloaded decode steps on the profile)")
    p.add_argument("--policy", default="cache_aware",
                   choices=("cache_aware", "least_loaded", "round_robin"))
    p.add_argument("--no-adaptive", action="store_true",
                   help="leave out the adaptive (live placement) candidates")
    p.add_argument("--itl-budget-ms", type=float, default=None,
                   help="adaptive: the longest step a local prefill may cause (default: "
                        "the TPOT SLO, else 200)")
    p.add_argument("--kv-offer", choices=KV_OFFERS, default="layers",
                   help="the prefill workers' `pdserve up --kv-offer` the split candidates "
                        "run: when a remote prompt's KV moves (layers: during its prefill "
                        "step; step, after: once it ended)")
    p.add_argument("--max-slice-workers", type=int, default=4,
                   help="larger configurations are simulated as a symmetric slice of this "
                        "many workers")
    p.add_argument("--max-requests", type=int, default=2000,
                   help="synthetic trace: requests per simulation (a window of the trace)")
    w = p.add_argument_group("workload (as pdserve bench)")
    w.add_argument("--workload", choices=WORKLOAD_CHOICES, default="random")
    w.add_argument("--num-requests", "--num-prompts", type=int, default=100,
                   help="requests (multi-turn: conversations)")
    w.add_argument("--request-rate", type=float, default=None,
                   help="requests/s, open loop (default inf; synthetic: sized to the "
                        "resources at --utilization)")
    w.add_argument("--burstiness", type=float, default=1.0)
    w.add_argument("--input-len", type=int, default=None, help="default 256 (synthetic 512)")
    w.add_argument("--output-len", type=int, default=None, help="default 64 (synthetic 128)")
    w.add_argument("--range-ratio", type=float, default=None)
    w.add_argument("--long-fraction", type=float, default=None)
    w.add_argument("--long-input-len", type=int, default=None)
    w.add_argument("--long-output-len", type=int, default=None)
    w.add_argument("--turns", type=int, default=4)
    w.add_argument("--think-time-s", type=float, default=0.0)
    w.add_argument("--prefix-len", type=int, default=512)
    w.add_argument("--groups", type=int, default=8)
    w.add_argument("--trace", default=None, help="JSONL: timestamp, input_length, "
                                                 "output_length, prefix_group")
    w.add_argument("--details", default=None, metavar="FILE",
                   help="replay a recorded run (pdserve bench --out FILE) instead")
    w.add_argument("--duration-s", type=float, default=3600.0, help="synthetic trace length")
    w.add_argument("--utilization", type=float, default=0.6,
                   help="synthetic: the rate as a share of the resources' estimated capacity")
    w.add_argument("--seed", type=int, default=0)
    v = p.add_argument_group("validation: run the candidates for real on this machine")
    v.add_argument("--validate", action="store_true",
                   help="start each candidate as a local cluster, drive it with the same "
                        "requests, and report prediction errors and the decision regret; "
                        "exit 1 when one passes its bound")
    v.add_argument("--model", default=None, help="the model the profile measured")
    v.add_argument("--cache-dir", default=None)
    v.add_argument("--configs", default="",
                   help="--validate: only these candidates (labels as the table prints them, "
                        "separated by ';')")
    v.add_argument("--max-regret", type=float, default=0.05)
    v.add_argument("--max-latency-error", type=float, default=0.10)
    v.add_argument("--max-goodput-error", type=float, default=0.05)
    v.add_argument("--saturation", type=float, default=0.85,
                   help="--validate: judge TTFT and ITL errors only for candidates whose "
                        "load (offered rate / simulated capacity) is below this")
    v.add_argument("--no-recalibrate", action="store_true",
                   help="--validate: predict every candidate from the profile as saved, "
                        "instead of measuring its serving calibration again (~30 s) right "
                        "before it runs")
    v.add_argument("--served-after-s", type=float, default=60.0,
                   help="--validate: also predict each candidate's requests sent after this "
                        "many seconds from the steps its workers served before, as the live "
                        "planner does (0: off)")
    v.add_argument("--out", default="bench-results/plan-validate")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--plot", default=None, metavar="FILE.png")
    p.set_defaults(func=cmd_plan)


def _workload(args: argparse.Namespace, profile, resources):  # noqa: ANN001, ANN202
    """The workload the flags describe, and notes about it (to stderr)."""
    from planner import synthetic, workload

    def given(name: str, default: object) -> object:
        v = getattr(args, name)
        return default if v is None else v

    if args.details:
        return workload.from_details(args.details, args.input_len, args.seed)
    if args.workload == "synthetic":
        base = synthetic.SyntheticTrace(
            1.0, args.duration_s, given("input_len", 512), given("output_len", 128),
            given("long_fraction", 0.1), given("long_input_len", 2048),
            given("long_output_len", 64), given("range_ratio", 0.5), args.seed)
        rate = args.request_rate
        if rate is None:
            workers = resources.units if resources.kind == "gpus" else resources.units // min(
                profile.steps)
            threads = 1 if resources.kind == "gpus" else min(profile.steps)
            rate = synthetic.rate_for(profile, workers, base, args.utilization, threads)
        trace = synthetic.SyntheticTrace(**{**base.__dict__, "rate": rate})
        return workload.SyntheticWorkload(trace), []
    from loadtest.workloads import WorkloadShape

    shape = WorkloadShape(
        args.workload, args.num_requests, given("input_len", 256), given("output_len", 64),
        given("range_ratio", 0.0), given("long_fraction", 0.25), given("long_input_len", 1536),
        given("long_output_len", 16), args.turns, args.prefix_len, args.groups, args.trace)
    rate = math.inf if args.request_rate is None else args.request_rate
    return workload.explicit(shape, rate, args.burstiness, args.seed), []


def _caps(spec: str, profile):  # noqa: ANN001, ANN202 - Profile -> caps by threads, or None
    """``--prefill-caps``: None for 0 alone (no cap candidates), else caps by threads."""
    from planner.caps import prefill_caps

    if spec.strip() == "auto":
        return lambda threads: prefill_caps(profile, threads)
    try:
        caps = tuple(sorted({int(c) for c in spec.split(",") if c.strip()}))
    except ValueError:
        raise ValueError(f"--prefill-caps {spec!r}: comma-separated token counts "
                         "(0: no cap) or auto") from None
    if any(c < 0 for c in caps) or not caps:
        raise ValueError(f"--prefill-caps {spec!r}: token counts >= 0, or auto")
    return None if caps == (0,) else (lambda threads: caps)


def cmd_plan(args: argparse.Namespace) -> int:
    from common.cost_model import load_profile
    from loadtest.metrics import SLO
    from planner.config import Resources
    from planner.report import plot, table
    from planner.search import plan_workload

    try:
        profile = load_profile(args.profile)
        thresholds = tuple(int(t) for t in args.thresholds.split(",") if t.strip())
        caps = _caps(args.prefill_caps, profile)
        if args.gpus is not None:
            resources = Resources(args.gpus, "gpus", args.price_per_gpu_hour)
        else:
            resources = Resources(args.cores or os.cpu_count() or 1, "cores",
                                  args.price_per_core_hour)
        work, notes = _workload(args, profile, resources)
    except (OSError, ValueError, KeyError) as e:
        print(f"pdserve plan: {e}", file=sys.stderr)
        return EXIT_INVALID
    slo = (SLO(args.slo_ttft_ms, args.slo_tpot_ms)
           if args.slo_ttft_ms is not None or args.slo_tpot_ms is not None else None)
    if args.validate:
        if args.kv_offer != "layers":
            print("pdserve plan --validate: its clusters run the default --kv-offer layers; "
                  "leave --kv-offer out", file=sys.stderr)
            return EXIT_INVALID
        return _validate(args, work, resources, thresholds)
    print(f"pdserve plan: {resources.units} {resources.kind}, profile {profile.model} "
          f"({profile.dtype}, threads {sorted(profile.steps)}); {work.description}",
          file=sys.stderr)
    try:
        result = plan_workload(profile, work, resources, slo, thresholds=thresholds,
                               policy=args.policy, adaptive=not args.no_adaptive,
                               itl_budget_ms=args.itl_budget_ms,
                               max_slice_workers=args.max_slice_workers,
                               max_requests=args.max_requests, think_time_s=args.think_time_s,
                               kv_offer=args.kv_offer, prefill_caps=caps)
    except ValueError as e:
        print(f"pdserve plan: {e}", file=sys.stderr)
        return EXIT_INVALID
    result.notes[:0] = notes
    if args.plot:
        png = plot(result, args.plot)
        print(f"pdserve plan: wrote {png}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.as_json(), allow_nan=False))
    else:
        print(table(result))
    return 0


def _validate(args: argparse.Namespace, work, resources, thresholds) -> int:  # noqa: ANN001
    from planner.workload import ExplicitWorkload
    from workers.model_store import resolve_model

    if resources.kind != "cores" or resources.units > (os.cpu_count() or 1):
        print(f"pdserve plan --validate: runs on this machine's {os.cpu_count()} cores; "
              "give --cores N within them", file=sys.stderr)
        return EXIT_INVALID
    if not isinstance(work, ExplicitWorkload):
        print("pdserve plan --validate: needs a workload it can send (not synthetic)",
              file=sys.stderr)
        return EXIT_INVALID
    path = resolve_model(args.model, cache_dir(args))
    try:
        summary = _run_validation(args, work, resources, thresholds, str(path))
    except ValueError as e:
        print(f"pdserve plan --validate: {e}", file=sys.stderr)
        return EXIT_INVALID
    return 1 if summary["verdict"] else 0


def _run_validation(args: argparse.Namespace, work, resources, thresholds,  # noqa: ANN001
                    model: str) -> dict:
    from benchmarks.plan_validate import Bounds, ValidateOptions, validate

    return validate(ValidateOptions(
        model=model, profile=args.profile, workload=work, cores=resources.units,
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
        configs=tuple(c.strip() for c in args.configs.split(";") if c.strip()),
        thresholds=thresholds, bounds=Bounds(args.max_regret, args.max_latency_error,
                                             args.max_goodput_error, args.saturation),
        out=args.out, recalibrate=not args.no_recalibrate,
        served_after_s=args.served_after_s))
