"""``pdserve generate`` and ``pdserve status``: what a user asks of a cluster (or, with
``generate --offline``, of an engine in this process)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from workers.engine.params import InvalidRequestError

from .options import (
    EXIT_INVALID,
    add_api_key_flag,
    add_engine_flags,
    cache_dir,
    client_api_key,
    engine_options,
)


def register(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser("status", help="workers and load; exit 0 once the router serves")
    st.add_argument("--target", default="127.0.0.1:50051")
    _add_tls_flags(st)
    st.add_argument("--timeout", type=float, default=5.0)
    st.add_argument("--json", action="store_true")
    st.add_argument("--ray", action="store_true",
                    help="also list the pools' actors, their nodes and restarts (Ray)")
    st.add_argument("--ray-address", default="auto")
    st.set_defaults(func=cmd_status)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("prompt")
    g.add_argument("--target", default="127.0.0.1:50051",
                   help="router HOST:PORT, or several comma-separated: a stream whose "
                        "router dies resumes on the next (router/resume.py)")
    _add_tls_flags(g)
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
    add_engine_flags(g)
    g.set_defaults(func=cmd_generate)


def _add_tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default=None, metavar="FILE",
                   help="the router serves TLS: trust this CA certificate (`pdserve certs` "
                        "writes ca.pem); default: plaintext")
    p.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="with --tls-ca: the name to check in the router's certificate "
                        "(default: the target's host)")
    add_api_key_flag(p)


def _client(args: argparse.Namespace):  # noqa: ANN202 - router.client.Client
    from common.tls import TLSError
    from router.client import Client

    targets = [t.strip() for t in args.target.split(",") if t.strip()]  # several: resume
    try:
        return Client(targets[0] if len(targets) == 1 else targets, args.tls_ca,
                      args.tls_server_name, api_key=client_api_key(args))
    except (TLSError, ValueError) as e:  # ValueError: no target in --target
        print(f"pdserve {args.command}: {e}", file=sys.stderr)
        raise SystemExit(EXIT_INVALID) from None


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """``generate``'s flags as SamplingParams fields, for the offline and remote paths."""
    return {"max_tokens": args.max_tokens, "temperature": args.temperature,
            "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
            "stop": tuple(args.stop or ()), "ignore_eos": args.ignore_eos}


def cmd_generate(args: argparse.Namespace) -> int:
    from router.client import Completion
    from workers.engine.llm_engine import LLMEngine
    from workers.engine.params import EngineConfig, SamplingParams
    from workers.model_store import resolve_model

    if not args.offline:
        return _generate_remote(args)
    try:
        params = SamplingParams(**_sampling_kwargs(args))  # type: ignore[arg-type]
    except InvalidRequestError as e:
        print(f"pdserve generate: invalid request: {e}", file=sys.stderr)
        return EXIT_INVALID
    path = resolve_model(args.model, cache_dir(args))
    engine = LLMEngine(EngineConfig(model=str(path), **engine_options(args)))  # type: ignore[arg-type]
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
    result = Completion(
        text=final.text, token_ids=final.token_ids, prompt_token_ids=final.prompt_token_ids,
        finish_reason=final.finish_reason,
        usage={"prompt_tokens": len(final.prompt_token_ids),
               "completion_tokens": len(final.token_ids),
               "cached_tokens": final.num_cached_tokens},
        ttft_s=(final.first_token_time or end) - start, e2e_s=end - start)
    print(json.dumps(result.to_json()) if args.json else "")
    return 0


def _generate_remote(args: argparse.Namespace) -> int:
    import grpc

    from router.client import Completion

    prompt: object = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    try:
        with _client(args) as client:
            out = Completion()
            for msg in client.stream(prompt, **_sampling_kwargs(args)):  # type: ignore[arg-type]
                out.add(msg)
                if not args.json:
                    print(msg.text, end="", flush=True)
    except InvalidRequestError as e:
        print(f"pdserve generate: invalid request: {e}", file=sys.stderr)
        return EXIT_INVALID
    except grpc.RpcError as e:
        print(f"pdserve generate: {args.target} answered {e.code().name}: {e.details()}",
              file=sys.stderr)
        return EXIT_INVALID if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    print(json.dumps(out.to_json()) if args.json else "")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import grpc

    try:
        with _client(args) as client:
            status = client.status(timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"pdserve status: router at {args.target} is not serving ({e.code().name}: "
              f"{e.details()}); start one with `pdserve up`", file=sys.stderr)
        return 1
    if args.json:
        from google.protobuf.json_format import MessageToDict

        out = MessageToDict(status, always_print_fields_with_no_presence=True)
        if args.ray:
            try:
                out["ray"] = _ray_view(args.ray_address)
            except (RuntimeError, ConnectionError) as e:
                print(f"pdserve status: {e}", file=sys.stderr)
                return 1
        print(json.dumps(out))
        return 0
    print(f"router {args.target}: model {status.model}, {status.requests_in_flight}/"
          f"{status.max_requests_in_flight} requests in flight")
    decisions = ", ".join(f"{k} {v}" for k, v in sorted(status.routing_decisions.items()))
    print(f"prefix index: {'up' if status.prefix_index_up else 'not in use or down'}; "
          f"routing decisions: {decisions or 'none yet'}")
    print(f"{'worker':24}{'role':8}{'serving':>8}{'running':>9}{'waiting':>9}{'reserved':>9}"
          f"{'free KV':>14}{'prefix hit':>11}  transfers done/failed/timed out, in flight, MB")
    for w in status.workers:
        t = w.transfers
        moved = (f"{t.entered.get('done', 0)}/{t.entered.get('failed', 0)}/"
                 f"{t.entered.get('timed_out', 0)}, {t.in_flight}, {t.bytes_moved / 1e6:.1f}"
                 if w.role in ("prefill", "decode") else "-")
        print(f"{w.address:24}{w.role:8}{'yes' if w.serving else 'NO':>8}"
              f"{w.running_requests:>9}{w.waiting_requests:>9}{w.reserved_requests:>9}"
              f"{f'{w.free_blocks}/{w.total_blocks}':>14}"
              f"{_ratio(w.cached_prompt_tokens, w.prompt_tokens):>11}  {moved}")
    return _ray_status(args.ray_address) if args.ray else 0


def _ratio(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "-"


def _ray_view(address: str) -> dict:
    """The deployment's actors (``Controller.describe``) and the Ray nodes."""
    import ray

    from cluster.ray_cluster import connect, controller

    connect(address)
    try:
        ctl = controller()
        rows = ray.get(ctl.describe.remote(), timeout=30)  # type: ignore[attr-defined]
        groups = ray.get(ctl.placement.remote(), timeout=30)  # type: ignore[attr-defined]
        nodes = [{"node_id": n["NodeID"], "ip": n["NodeManagerAddress"],
                  "metrics_export_port": n.get("MetricsExportPort"),
                  "resources": n.get("Resources", {})} for n in ray.nodes() if n.get("Alive")]
    finally:
        ray.shutdown()
    return {"actors": rows, "nodes": nodes, "placement_groups": groups}


def _ray_status(address: str) -> int:
    try:
        view = _ray_view(address)
    except (RuntimeError, ConnectionError) as e:
        print(f"pdserve status: {e}", file=sys.stderr)
        return 1
    rows = view["actors"]
    pools: dict[str, int] = {}
    for r in rows:
        pools[r["role"]] = pools.get(r["role"], 0) + 1
    print(f"\nRay: {len(view['nodes'])} node(s) alive ("
          + ", ".join(f"{n['ip']}: {n['resources'].get('CPU', 0):g} CPU, "
                      f"{n['resources'].get('GPU', 0):g} GPU" for n in view["nodes"])
          + "); pools: " + ", ".join(f"{n} {role}" for role, n in pools.items()))
    print(f"{'actor':22}{'role':9}{'state':12}{'address':24}{'node':16}{'pid':>8}{'restarts':>10}")
    for r in rows:
        restarts = "?" if r["restarts"] is None else r["restarts"]
        print(f"{r['name']:22}{r['role']:9}{r['state']:12}{r['address']:24}{r['node_ip']:16}"
              f"{r['pid']:>8}{restarts:>10}")
    print(f"{'placement group':22}{'strategy':14}{'state':14}bundles on nodes")
    for g in view["placement_groups"]:
        print(f"{g['name']:22}{g['strategy']:14}{g['state']:14}"
              + ", ".join(ip or "-" for ip in g["nodes"]))
    for g in view["placement_groups"]:
        if "short" in g:
            print(f"pool {g['role']} is short: {g['name']}: {g['short']}")
    return 0
