"""``pdserve chaos``: the fault harness (``benchmarks/chaos.py``): a cluster under
steady load, one fault type per scenario, every stream checked token for token, on the
process launcher (the default) or Ray (``--launcher ray``: one router, no Redis
supervision, so no ``kill-router`` nor ``kill-redis``). The network faults
(``delay-kv``, ``loss-kv``, ``partition-kv``, ``slow-redis``) spread the cluster over
test hosts, which need a private network namespace and root: by default they run where
those can be made and are skipped, with the reason, where not. Exit 0 when every target is
met, 1 when one is missed (the report says which), 2 on invalid options."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .options import EXIT_INVALID, cache_dir

QUICK = {"pre_s": 2.5, "post_s": 6.0, "stop_s": (1.0, 2.0), "prompts": 8, "max_tokens": 16}
"""``--quick``: shorter windows and stops (what ``make test`` runs, on a tiny model)."""


def register(sub: argparse._SubParsersAction) -> None:
    from benchmarks.chaos_faults import SCENARIOS
    from benchmarks.chaos_targets import LAUNCHERS, UNSUPPORTED

    p = sub.add_parser("chaos", help="inject faults (kills, stops, Redis loss, corrupted KV, "
                                     "cancellations, a slow, lossy or cut KV link, a slow "
                                     "Redis) under "
                                     "load; check every token")
    p.add_argument("--model", default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--scenarios", default=None,
                   help=f"comma-separated, of: {', '.join(SCENARIOS)} (default: every one "
                        "the launcher can run)")
    p.add_argument("--launcher", choices=LAUNCHERS, default="process",
                   help="process (two routers, supervised processes) or ray (a fresh local "
                        "Ray, one router; not: " + ", ".join(UNSUPPORTED["ray"]) + ")")
    p.add_argument("--faults", type=int, default=1,
                   help="faults per scenario (the README's long run: 10 and more)")
    p.add_argument("--load", type=float, default=0.7, help="fraction of measured capacity")
    p.add_argument("--pre-s", type=float, default=6.0, help="load before each fault")
    p.add_argument("--post-s", type=float, default=14.0, help="load after each fault")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32",
                   help="float32 by default: the oracle compares greedy tokens across "
                        "batch compositions")
    p.add_argument("--prefill-queue-limit", type=int, default=2,
                   help="the routers' overflow: a prompt goes to its decode worker when "
                        "every prefill worker has this many of the router's prompts in "
                        "flight (0: off)")
    p.add_argument("--quick", action="store_true",
                   help="short windows and stops (2.5 s + 6 s; 1-2 s stops)")
    p.add_argument("--out", default="bench-results/chaos")
    p.add_argument("--rescore", metavar="DIR", default=None,
                   help="run nothing: read DIR/chaos.json again with this version's "
                        "recovery rule and rewrite DIR's report")
    p.set_defaults(func=cmd_chaos)


def cmd_rescore(directory: str) -> int:
    from benchmarks.chaos import rescore
    from benchmarks.chaos_report import write

    old = Path(directory)
    try:
        report = json.loads((old / "chaos.json").read_text())
        header = (old / "chaos.md").read_text().splitlines()[0]
    except (OSError, ValueError, IndexError) as e:
        print(f"pdserve chaos: cannot read a report in {directory}: {e}", file=sys.stderr)
        return EXIT_INVALID
    report.pop("missed", None)
    md, missed = write(rescore(report), old, header + " (rescored)")
    print(md)
    return 1 if missed else 0


def cmd_chaos(args: argparse.Namespace) -> int:
    if args.rescore:
        return cmd_rescore(args.rescore)
    from benchmarks.chaos import ChaosOptions, run_chaos
    from benchmarks.chaos_faults import NETWORK, SCENARIOS
    from benchmarks.chaos_report import write
    from benchmarks.chaos_targets import UNSUPPORTED, refused
    from benchmarks.machine import machine_line
    from cluster.testhosts import unavailable
    from workers.model_store import resolve_model

    no_hosts = unavailable()
    scenarios = (tuple(s for s in args.scenarios.split(",") if s) if args.scenarios
                 is not None else tuple(s for s in SCENARIOS
                                        if s not in UNSUPPORTED[args.launcher]
                                        and not (no_hosts and s in NETWORK)))
    if args.scenarios is None and no_hosts and args.launcher == "process":
        print(f"pdserve chaos: skipping the network scenarios ({', '.join(NETWORK)}): "
              f"{no_hosts}", file=sys.stderr)
    bad = sorted(set(scenarios) - set(SCENARIOS))
    if bad or args.faults < 1 or not 0 < args.load <= 2:
        print(f"pdserve chaos: unknown scenarios {bad}; choose from {', '.join(SCENARIOS)}"
              if bad else "pdserve chaos: --faults must be >= 1 and --load in (0, 2]",
              file=sys.stderr)
        return EXIT_INVALID
    why = refused(args.launcher, scenarios)
    if no_hosts and set(scenarios) & set(NETWORK) and not why:
        why = [f"the network scenarios spread the cluster over test hosts, which cannot be "
               f"made here: {no_hosts}. Run as root in a private network namespace: "
               "unshare -n sh -c 'ip link set lo up && pdserve chaos ...'"]
    if why:
        for line in why:
            print(f"pdserve chaos: {line}", file=sys.stderr)
        return EXIT_INVALID
    path = resolve_model(args.model, cache_dir(args))
    settings = {"pre_s": args.pre_s, "post_s": args.post_s, "max_tokens": args.max_tokens,
                "prompts": args.prompts}
    if args.quick:
        settings.update(QUICK)
    options = ChaosOptions(model=str(path), out_dir=args.out, scenarios=scenarios,
                           faults=args.faults, load=args.load, seed=args.seed,
                           dtype=args.dtype, launcher=args.launcher,
                           prefill_queue_limit=args.prefill_queue_limit,
                           **settings)  # type: ignore[arg-type]
    header = (f"pdserve chaos on {path.name} ({args.dtype}), {machine_line()}: "
              f"{args.faults} fault(s) per scenario at {args.load:.0%} of capacity"
              + (f", prefill overflow at {args.prefill_queue_limit} queued"
                 if args.prefill_queue_limit else ""))
    parse = None
    if args.launcher == "ray":
        from .component import component_config

        parse = component_config  # how each actor reads its command line (pdserve up's)
        header += "; Ray launcher (one router)"
    print(header, flush=True)
    report = run_chaos(options, lambda line: print(line, flush=True), parse)
    md, missed = write(report, args.out, header)
    print(md)
    print(f"wrote {args.out}/chaos.json, chaos.md, chaos-ttft.png")
    return 1 if missed else 0
