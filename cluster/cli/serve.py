"""``pdserve up`` and ``pdserve scale``: a whole cluster's lifecycle.

``up`` reads the deployment (``--config FILE``, then the flags given, which win; one
flag per :class:`~cluster.deployment.DeploymentConfig` field, built from the field),
converts the model once, and serves until Ctrl-C: as actors on Ray
(``cluster/ray_cluster.py``, the default) or as plain processes here (``--launcher
process``, ``cluster/local.py``). ``scale`` resizes the pools of a cluster on Ray while
it serves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from cluster.deployment import DeploymentConfig, load_yaml
from common.redis_url import with_password

from .component import api_keys_checked, component_config
from .options import (
    EXIT_INVALID,
    add_deployment_flags,
    add_redis_password_flag,
    cache_dir,
    redis_password,
    secret_file,
)


def register(sub: argparse._SubParsersAction) -> None:
    u = sub.add_parser("up", help="start the whole cluster (on Ray by default) and serve "
                       "until Ctrl-C", argument_default=argparse.SUPPRESS,
                       description="Flags override the deployment file (--config); unset "
                       "ones take DeploymentConfig's defaults (cluster/deployment.py).")
    u.add_argument("--config", default=None,
                   help="deployment YAML (keys: DeploymentConfig's fields; see "
                        "deploy/pdserve.yaml)")
    u.add_argument("--cache-dir", default=None,
                   help="where converted models live (default: $PDSERVE_CACHE_DIR or "
                        "~/.cache/pdserve)")
    add_redis_password_flag(u)
    u.add_argument("--allow-unauthenticated-ray", action="store_true", default=False,
                   help="place work on a Ray cluster that does not enforce token "
                        "authentication (refused by default: anyone reaching it runs code)")
    add_deployment_flags(u)
    u.set_defaults(func=cmd_up)

    sc = sub.add_parser("scale", help="resize the pools of a cluster `pdserve up` runs on Ray, "
                        "while it serves (removed workers drain first)")
    sc.add_argument("--prefill", type=int, default=None)
    sc.add_argument("--decode", type=int, default=None)
    sc.add_argument("--mixed", type=int, default=None)
    sc.add_argument("--ray-address", default="auto",
                    help="the Ray cluster (default: the local one `pdserve up` started)")
    sc.set_defaults(func=cmd_scale)


def deployment_config(args: argparse.Namespace) -> DeploymentConfig:
    """The deployment file's settings (``--config``), overridden by the flags given."""
    settings: dict[str, object] = load_yaml(args.config) if args.config else {}
    fields = {f.name for f in dataclasses.fields(DeploymentConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields}
    return DeploymentConfig.from_settings({**settings, **given})


def cmd_up(args: argparse.Namespace) -> int:
    from workers.model_store import resolve_model

    try:  # bad pool sizes and files are reported before any model conversion
        config = deployment_config(args)
        config.check_autoscale()
        password = redis_password(args)  # for --redis-url; a Redis started here gets its own
        config = trust_checked(config)
        config = api_keys_checked(config)
    except ValueError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return EXIT_INVALID
    config = dataclasses.replace(config, redis_url=with_password(config.redis_url, password))
    path = resolve_model(config.model or None, cache_dir(args))  # convert once, up front
    config = dataclasses.replace(config, model=str(path))
    if config.launcher == "process":
        from cluster.local import LocalCluster

        with LocalCluster(config) as cluster:
            cluster.wait_ready()
            print(cluster.usage(), flush=True)
            if not config.autoscale:
                return cluster.wait()
            from cluster.autoscale import start_autoscale

            loop = start_autoscale(cluster)
            try:
                return cluster.wait()
            finally:
                loop.stop()
    return _up_on_ray(config, args.allow_unauthenticated_ray)


def _up_on_ray(config: DeploymentConfig, allow_unauthenticated: bool = False) -> int:
    from cluster.local import banner, start_redis, stop_on_signals
    from cluster.net import is_loopback, source_address
    from cluster.ray_auth import RayAuthError
    from cluster.ray_cluster import RayDeployment

    redis_host = config.host
    if config.ray_address and config.redis and not config.redis_url \
            and is_loopback(config.host):
        redis_host = source_address(config.ray_address)  # every node must reach it
        if is_loopback(redis_host):
            print(f"pdserve up: cannot tell which address of this node the other nodes "
                  f"reach from --ray-address {config.ray_address}; Redis binds 127.0.0.1 "
                  "and only workers on this node can use it: give --host THIS_NODE_IP "
                  "or --redis-url", file=sys.stderr)
        else:
            print(f"pdserve up: starting Redis (with a password) on {redis_host}, the "
                  "address this node reaches the Ray head from; give --redis-url to use "
                  "your own", file=sys.stderr)
    redis = start_redis(dataclasses.replace(config, host=redis_host))
    deployment = RayDeployment(config, redis.url if redis else config.redis_url,
                               component_config, allow_unauthenticated)

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
    except RayAuthError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return EXIT_INVALID
    finally:
        deployment.stop()
        if redis is not None:
            redis.stop()

def trust_checked(config: DeploymentConfig) -> DeploymentConfig:
    """The trust files as absolute paths (components may start elsewhere: a Ray actor's
    working directory is not ours), the secret file from the environment when no flag
    names one, and every file read once here, so a bad one stops ``up`` before anything
    starts. Raises ValueError (TLSError, DeploymentError) naming the file."""
    import os

    from common.tls import ClusterTLS, ServerTLS, load_ca, load_cluster_secret

    changes: dict[str, str] = {}
    for name in ("cluster_tls_dir", "cluster_secret_file", "tls_cert", "tls_key", "tls_ca"):
        value = getattr(config, name)
        if name == "cluster_secret_file":
            value = secret_file(value)
        if value:
            changes[name] = os.path.abspath(value)
    config = dataclasses.replace(config, **changes)  # type: ignore[arg-type]
    if (config.tls_cert is None) != (config.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    if config.cluster_tls_dir:
        ClusterTLS.from_dir(config.cluster_tls_dir)
    if config.cluster_secret_file:
        load_cluster_secret(config.cluster_secret_file)
    if config.tls_cert and config.tls_key:
        ServerTLS.from_files(config.tls_cert, config.tls_key).ssl_context()
    if config.client_tls_ca:
        load_ca(config.client_tls_ca)
    return config


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
