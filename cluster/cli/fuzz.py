"""``pdserve fuzz``: hostile requests against a running cluster's HTTP and gRPC fronts
while a victim request runs (``loadtest/fuzz.py``); a table per endpoint, exit 1 on any
5xx, exception text, bad answer, hurt victim or leaked block.

Run it against a cluster nothing else is using: the leak check waits for every worker to
be idle, and the victim's reference assumes greedy output is reproducible there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .options import EXIT_INVALID, read_key_file


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fuzz", help="throw hostile requests at a running cluster's fronts "
                                     "while a victim runs; exit 1 on any 5xx or leak")
    p.add_argument("--target", default="127.0.0.1:50051", help="router gRPC HOST:PORT")
    p.add_argument("--http", default="http://127.0.0.1:8000",
                   help="router HTTP front, http://HOST:PORT")
    p.add_argument("--examples", type=int, default=10_000, help="per endpoint")
    p.add_argument("--endpoints", default="completions,chat,grpc-generate,grpc-tokenize",
                   help="comma-separated, of: completions, chat, grpc-generate, grpc-tokenize")
    p.add_argument("--concurrency", type=int, default=4, help="fuzzed requests at once")
    p.add_argument("--seed", type=int, default=None,
                   help="hypothesis seed (default: derandomized, the same examples each run)")
    p.add_argument("--api-key-file", default=None,
                   help="the router's key file (KEY TENANT [admin] per line): the first key "
                        "sends the requests, the first admin key (else the same) reads "
                        "GetStatus for the leak check")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the served vocabulary size (default: learned from the router)")
    p.add_argument("--json", default=None, metavar="OUT",
                   help="also write the report here, every distinct failure with an example")
    p.set_defaults(func=cmd_fuzz)


def cmd_fuzz(args: argparse.Namespace) -> int:
    try:
        from loadtest import fuzz
    except ImportError as e:  # hypothesis comes with the test extra
        print(f"pdserve fuzz: {e}; install it with `pip install -e '.[test]'`", file=sys.stderr)
        return EXIT_INVALID
    try:
        key, status_key = read_key_file(args.api_key_file) if args.api_key_file else (None,
                                                                                       None)
        config = fuzz.FuzzConfig(
            target=args.target, http_url=args.http,
            endpoints=tuple(e.strip() for e in args.endpoints.split(",") if e.strip()),
            examples=args.examples, concurrency=args.concurrency, seed=args.seed,
            api_key=key, status_api_key=status_key, request_timeout_s=args.timeout,
            vocab_size=args.vocab_size)
    except (OSError, ValueError) as e:
        print(f"pdserve fuzz: {e}", file=sys.stderr)
        return EXIT_INVALID
    print(f"pdserve fuzz: {config.examples} examples per endpoint ({', '.join(config.endpoints)}) "
          f"against {config.target} and {config.http_url}, {config.concurrency} at a time",
          file=sys.stderr)

    def progress(endpoint: str, sent: int, total: int) -> None:
        if sent == total or sent % max(1, total // 20) == 0:
            print(f"\r  {endpoint}: {sent}/{total}", end="\n" if sent == total else "",
                  file=sys.stderr, flush=True)

    try:
        report = fuzz.run(config, progress)
    except Exception as e:  # noqa: BLE001 - a cluster that cannot be reached, said plainly
        print(f"pdserve fuzz: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(report.table())
    if not report.ok:
        print("\nDistinct failures (count, the smallest example):")
        print(report.describe_failures())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report.to_json(), indent=1))
    return 0 if report.ok else 1
