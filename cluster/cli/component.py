"""``pdserve worker`` and ``pdserve router``: one component as a plain process, from
flags or from the deployment file (``--config``), ``pdserve convert-model`` and
``pdserve quantize`` (a pre-quantized int8 checkpoint, :mod:`workers.models.int8_checkpoint`).

These command lines are what every launcher runs (:mod:`cluster.deployment` writes
them): a plain process parses them here, a Ray actor through :func:`component_config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback

from cluster.deployment import DeploymentConfig, load_yaml
from common.logs import log_to_stderr
from common.process_exit import exit_after_shutdown
from common.redis_url import with_password

from .options import (
    EXIT_INVALID,
    add_engine_flags,
    add_redis_password_flag,
    add_setting,
    cache_dir,
    cluster_tls,
    engine_options,
    kv_channel_key,
    redis_password,
)


def register(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser("worker", help="one engine worker as a plain process")
    w.add_argument("--role", choices=("mixed", "prefill", "decode"), default="mixed")
    w.add_argument("--host", default="127.0.0.1",
                   help="interface for gRPC and, on decode workers, the KV receiver")
    w.add_argument("--port", type=int, default=50061)
    add_setting(w, "local_prefill_threshold")
    add_setting(w, "transfer_timeout_s")
    w.add_argument("--redis-url", default=None,
                   help="register here and publish KV block events to the prefix index "
                        "(redis://HOST:PORT/DB or rediss://...)")
    add_redis_password_flag(w)
    w.add_argument("--config", default=None,
                   help="deployment YAML: this worker's settings come from it (flags win)")
    w.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics here (0: any free port; default: off)")
    w.add_argument("--step-trace", default=None, metavar="PATH",
                   help="append each engine step's start, seconds, tokens, sequences and "
                        "attention pairs to this CSV ({pid}: this process's id); "
                        "`pdserve plan --validate` compares them with its predictions "
                        "(default: off)")
    w.add_argument("--publish-steps", action="store_true",
                   help="note each engine step's time and shape on the model's stream in "
                        "Redis, which the live planner refits its step model from (needs "
                        "--redis-url; `pdserve up --autoscale` turns it on)")
    add_setting(w, "drain_timeout_s")
    add_setting(w, "drain_grace_s")
    add_setting(w, "kv_offer")
    add_setting(w, "kv_offer_timeout_s")
    add_setting(w, "cluster_tls_dir")
    add_setting(w, "cluster_secret_file")
    add_engine_flags(w)
    w.set_defaults(func=cmd_worker)

    r = sub.add_parser("router", help="the router as a plain process")
    r.add_argument("--worker", action="append",
                   help="HOST:PORT (repeatable); with --redis-url workers are also found in "
                        "the registry")
    r.add_argument("--redis-url", default=None,
                   help="the prefix index and worker registry (redis://HOST:PORT/DB or "
                        "rediss://...)")
    add_redis_password_flag(r)
    add_setting(r, "policy")
    r.add_argument("--model", default=None, help="checkpoint whose tokenizer to use")
    r.add_argument("--cache-dir", default=None)
    r.add_argument("--host", default="127.0.0.1")
    add_setting(r, "port")
    add_setting(r, "http_port")
    add_setting(r, "max_in_flight")
    add_setting(r, "api_keys")
    add_setting(r, "tenant_max_concurrency")
    add_setting(r, "tenant_tokens_per_minute")
    add_setting(r, "metrics_public")
    add_setting(r, "tool_call_parser")
    add_setting(r, "profile")
    add_setting(r, "itl_budget_ms")
    add_setting(r, "slo_ttft_ms")
    add_setting(r, "max_num_batched_tokens")
    add_setting(r, "kv_offer")
    add_setting(r, "stall_probe_s")
    add_setting(r, "prefill_queue_limit")
    for role in ("prefill", "decode"):
        r.add_argument(f"--{role}-threads", type=int, default=1,
                       help=f"threads per {role} worker: which of --profile's step models "
                            "applies (default: 1)")
    r.add_argument("--config", default=None,
                   help="deployment YAML: the router's settings come from it (flags win)")
    r.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics here (0: any free port; default: off)")
    for name in ("cluster_tls_dir", "tls_cert", "tls_key"):
        add_setting(r, name)
    r.set_defaults(func=cmd_router)

    c = sub.add_parser("convert-model", help="convert the default model once; print its path")
    c.add_argument("--cache-dir", default=None)
    c.set_defaults(func=cmd_convert)

    q = sub.add_parser("quantize", help="write a pre-quantized int8 checkpoint (load it "
                                        "with --quantization int8)")
    q.add_argument("--model", default=None,
                   help="local checkpoint directory (default: the default model)")
    q.add_argument("--out", required=True, help="new directory for the int8 checkpoint")
    q.add_argument("--cache-dir", default=None)
    q.set_defaults(func=cmd_quantize)


def expand_config(argv: list[str]) -> list[str]:
    """``pdserve worker|router --config FILE [flags]``: the command line the deployment
    file gives that component (what ``pdserve up`` would run), then the flags given,
    which win (argparse keeps the last value). How a pod runs one component from the
    same file a ``pdserve up`` reads."""
    if not argv or argv[0] not in ("worker", "router"):
        return argv
    rest, path = [], None
    it = iter(argv[1:])
    for a in it:
        if a == "--config":
            path = next(it, None)
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
        else:
            rest.append(a)
    if path is None:
        return argv
    config = DeploymentConfig.from_settings(load_yaml(path))
    if argv[0] == "router":
        return config.router_args([], config.redis_url) + rest
    role = argparse.ArgumentParser(add_help=False)
    role.add_argument("--role", default="mixed")
    known, _ = role.parse_known_args(rest)
    return config.worker_args(known.role, config.host, 50061, config.redis_url,
                              config.threads(os.cpu_count() or 1)) + rest


def component_config(argv: list[str],
                     redis_password: str | None = None) -> tuple[str, object]:
    """A ``pdserve worker`` or ``pdserve router`` command line as (kind, config): how
    a Ray actor runs the component exactly as the plain process would.
    ``redis_password``: what the launcher handed over beside the command line (which
    never carries it)."""
    parser = argparse.ArgumentParser(prog="pdserve")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    if args.command == "worker":
        return "worker", worker_config(args, redis_password)
    if args.command == "router":
        return "router", router_config(args, redis_password)
    raise ValueError(f"not a component command line: {argv}")


def worker_config(args: argparse.Namespace,  # noqa: ANN201 - WorkerConfig
                  password: str | None = None):
    from workers.engine.params import EngineConfig
    from workers.model_store import resolve_model
    from workers.server import WorkerConfig
    from workers.transfer import TransferConfig
    from workers.transfer.channel import fault_hooks_from_env

    path = resolve_model(args.model, cache_dir(args))
    tls = cluster_tls(args)
    transfer = fault_hooks_from_env(TransferConfig(
        host=args.host, device=args.device, data_timeout_s=args.transfer_timeout_s,
        offer=args.kv_offer, early_go_timeout_s=args.kv_offer_timeout_s,
        auth_key=kv_channel_key(args, tls),
        fault_drop_midway=os.environ.get("PDSERVE_FAULT_DROP_TRANSFER", "")))
    return WorkerConfig(
        engine=EngineConfig(model=str(path), **engine_options(args)),  # type: ignore[arg-type]
        model_name=path.name, role=args.role, host=args.host, port=args.port,
        transfer=transfer, local_prefill_threshold=args.local_prefill_threshold,
        redis_url=with_password(args.redis_url, redis_password(args, password)),
        metrics_port=args.metrics_port,
        step_trace=args.step_trace.replace("{pid}", str(os.getpid())) if args.step_trace else None,
        publish_steps=args.publish_steps, drain_timeout_s=args.drain_timeout_s,
        drain_grace_s=args.drain_grace_s, cluster_tls=tls)


def router_config(args: argparse.Namespace,  # noqa: ANN201 - ServerConfig
                  password: str | None = None):
    from router.core import RouterConfig
    from router.server import ServerConfig
    from workers.model_store import resolve_model

    path = resolve_model(args.model, cache_dir(args))
    return ServerConfig(
        router=RouterConfig(workers=tuple(args.worker or ()), model_path=str(path),
                            model_name=path.name, max_in_flight=args.max_in_flight,
                            redis_url=with_password(args.redis_url,
                                                    redis_password(args, password)),
                            policy=args.policy,
                            tenant_max_concurrency=args.tenant_max_concurrency,
                            tenant_tokens_per_minute=args.tenant_tokens_per_minute,
                            placement_profile=args.profile, itl_budget_ms=args.itl_budget_ms,
                            ttft_slo_ms=args.slo_ttft_ms,
                            kv_offer=args.kv_offer, prefill_threads=args.prefill_threads,
                            stall_probe_after_s=args.stall_probe_s,
                            prefill_queue_limit=args.prefill_queue_limit,
                            decode_threads=args.decode_threads,
                            max_num_batched_tokens=args.max_num_batched_tokens),
        host=args.host, port=args.port, http_port=None if args.http_port == 0 else args.http_port,
        metrics_port=args.metrics_port, cluster_tls=cluster_tls(args),
        api_keys_file=args.api_keys, metrics_public=args.metrics_public,
        tool_call_parser=args.tool_call_parser,
        tls=public_tls(args.tls_cert, args.tls_key))


def public_tls(cert: str | None, key: str | None):  # noqa: ANN201 - ServerTLS | None
    """The router's public certificate and key, read once here; None: plaintext."""
    from common.tls import ServerTLS, TLSError

    if (cert is None) != (key is None):
        raise TLSError("--tls-cert and --tls-key go together: give both or neither")
    return ServerTLS.from_files(cert, key) if cert and key else None

def cmd_worker(args: argparse.Namespace) -> int:
    import asyncio

    from workers.server import serve

    log_to_stderr(f"{args.role}@{args.port}")
    try:
        config = worker_config(args)
    except ValueError as e:  # bad settings, an unreadable --redis-password-file
        print(f"pdserve worker: {e}", file=sys.stderr)
        return EXIT_INVALID
    # Either way the process ends without the interpreter's finalization: the transfer
    # threads are daemons that may still wake from a torch call, which in a finalizing
    # interpreter aborts the process (common.process_exit). serve closed what it owns;
    # a serve that failed may leave KV ends open, which the exit closes.
    try:
        asyncio.run(serve(config))
    except Exception as e:  # noqa: BLE001 - reported, then the same exit with status 1
        from workers.model_store import ModelStoreError

        if isinstance(e, (ModelStoreError, OSError)):  # a model, a port: said in a line
            print(f"pdserve worker: {e}", file=sys.stderr)
        else:
            traceback.print_exc()
        exit_after_shutdown(1)
    exit_after_shutdown(0)
    return 0  # not reached


def cmd_router(args: argparse.Namespace) -> int:
    import asyncio

    from router.server import serve

    log_to_stderr(f"router@{args.port}")
    if args.api_keys is None:  # the environment, read once, here at the edge
        args.api_keys = os.environ.get(API_KEYS_ENV) or None
    try:
        check_api_keys(args.api_keys)
        config = router_config(args)
        if args.profile:  # read once up front too: a bad file is reported before serving
            from common.cost_model import load_profile

            profile = load_profile(args.profile)
            profile.step(args.prefill_threads)
            profile.step(args.decode_threads)
    except (ValueError, KeyError) as e:  # bad settings, an unreadable file
        print(f"pdserve router: {e}", file=sys.stderr)
        return EXIT_INVALID
    try:
        asyncio.run(serve(config))
    except OSError as e:  # a port taken, as the worker says it
        print(f"pdserve router: {e}", file=sys.stderr)
        return 1
    return 0

API_KEYS_ENV = "PDSERVE_API_KEYS_FILE"
"""The API key file's path when ``--api-keys`` is not given (``pdserve router``, ``up``)."""


def check_api_keys(path: str | None) -> None:
    """Read the key file once up front, so a bad one is reported before anything starts
    (the router reads it again, and on every change). Raises ``KeyFileError`` (a
    ValueError) naming the line, never a key."""
    if path:
        from router.auth import KeyStore

        KeyStore(path)


def api_keys_checked(config: DeploymentConfig) -> DeploymentConfig:
    """``pdserve up``'s key file: ``api_keys``, else ``$PDSERVE_API_KEYS_FILE``, as an
    absolute path (a Ray actor runs elsewhere), read once to report a bad file before
    anything starts. Only the path travels; the router reads the keys."""
    path = config.api_keys or os.environ.get(API_KEYS_ENV) or None
    if path is None:
        return config
    path = os.path.abspath(path)
    check_api_keys(path)
    return dataclasses.replace(config, api_keys=path)


def cmd_quantize(args: argparse.Namespace) -> int:
    from workers.model_store import resolve_model
    from workers.models.int8_checkpoint import save_quantized

    src = resolve_model(args.model, cache_dir(args))
    try:
        counts = save_quantized(src, args.out)
    except ValueError as e:
        print(f"pdserve quantize: {e}", file=sys.stderr)
        return EXIT_INVALID
    print(f"{args.out}: {counts['quantized']} projections in int8, "
          f"{counts['bytes'] / 1e6:.1f} MB of weights (from {src})")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from workers.model_store import resolve_model

    print(resolve_model(None, cache_dir(args)))
    return 0
