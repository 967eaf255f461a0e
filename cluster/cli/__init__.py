"""The ``pdserve`` command line: the composition root.

The environment is read here and only here (``PDSERVE_CACHE_DIR`` and
``PDSERVE_REDIS_PASSWORD``, the Redis password, never printed, and
``PDSERVE_CLUSTER_SECRET_FILE``, the KV channel's secret file when no
``--cluster-secret-file`` is given: ``options.py``; ``PDSERVE_FAULT_DROP_TRANSFER``,
fault injection for tests: a prefill worker drops every KV transfer of a request whose
id contains it, halfway: ``component.py``), into typed
configs handed down. One module per command group, each registering its subcommands:

* ``serve.py``: ``pdserve up [--config FILE] [--mixed K | --prefill N --decode M]``
  starts the whole cluster on the default model and serves until Ctrl-C: 1 prefill + 1
  decode worker unless told otherwise, Redis and the router, as actors on a fresh local
  Ray (or ``--ray-address``; see ``cluster/ray_cluster.py``), or as plain processes here
  with ``--launcher process`` (``cluster/local.py``); its flags are
  ``DeploymentConfig``'s fields (``cluster/deployment.py``). ``pdserve scale --prefill N
  --decode M`` resizes the pools of a cluster on Ray while it serves (removed workers
  drain first);
* ``component.py``: ``pdserve worker`` / ``pdserve router`` run one component as a plain
  process (the command lines every launcher runs: ``cluster/deployment.py``);
  ``pdserve convert-model`` converts the default model once, ahead of time;
* ``client.py``: ``pdserve generate [--target HOST:PORT | --offline] PROMPT`` streams the
  text (``--json`` prints the object DESIGN.md's command-line section defines);
  ``pdserve status [--target HOST:PORT] [--ray]`` shows the workers (and with ``--ray``
  the pools' actors, nodes and restarts); exit 0 once the router serves;
* ``bench.py``: ``pdserve bench --target HOST:PORT`` load-tests a running router
  (``loadtest/``); ``pdserve bench-engine``, ``bench-disagg``, ``bench-headline``,
  ``bench-routing``, ``bench-router``, ``bench-serving`` and ``bench-multinode`` (on test
  hosts: ``cluster/testhosts.py``) run the benchmarks in ``benchmarks/`` (``bench-serving``
  reads ``PDSERVE_VLLM_PYTHON``, the python of a
  vLLM install to compare with, when no ``--vllm-python`` is given);
* ``harness.py``: ``pdserve bench-harness`` runs ``pdserve bench``, guidellm, aiperf and
  ``vllm bench serve`` on one server and workload, side by side
  (``benchmarks/external_harness.py``; the tools' paths from their flags, else
  ``PDSERVE_GUIDELLM``, ``PDSERVE_AIPERF``, ``PDSERVE_VLLM_PYTHON``, else ``PATH``);
* ``security.py``: ``pdserve certs --out DIR`` makes a development CA, the cluster's
  and the router's certificates and the KV channel's secret (``cluster/certs.py``);
* ``plan.py``: ``pdserve plan --profile FILE [--cores N | --gpus N]`` predicts every pool
  configuration's latencies, goodput and cost on a workload and recommends one (``planner/``);
* ``fuzz.py``: ``pdserve fuzz`` throws hostile requests at a running cluster (``loadtest/fuzz.py``);
* ``chaos.py``: ``pdserve chaos`` injects faults into a cluster under load and checks every
  token against a reference (``benchmarks/chaos.py``);
* ``kv.py``: ``pdserve eval-kv`` measures what each quantized KV cache format costs in
  perplexity, KL divergence and greedy agreement (``benchmarks/eval_kv.py``);
* ``options.py``: what they share (engine flags, flags built from the deployment's
  fields, the cache directory).
"""

from __future__ import annotations

import argparse
import sys

from . import bench, chaos, client, component, fuzz, harness, kv, plan, security, serve
from .component import component_config, expand_config, router_config, worker_config
from .options import EXIT_INVALID
from .serve import deployment_config

__all__ = ["EXIT_INVALID", "build_parser", "component_config", "deployment_config",
           "expand_config", "main", "router_config", "worker_config"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (serve, component, client, bench, harness, plan, security, fuzz, chaos,
                  kv):
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from workers.model_store import ModelStoreError

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = expand_config(argv)
    except ValueError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return EXIT_INVALID
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ModelStoreError as e:
        print(f"pdserve {args.command}: {e}", file=sys.stderr)
        return 1
