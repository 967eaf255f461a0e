"""One deployment description for every launcher: plain processes on this machine
(``cluster.local``), actors on Ray (``cluster.ray_cluster``) and, rendered by the Helm
chart, pods on Kubernetes.

A deployment is a :class:`DeploymentConfig`: pool sizes, per-worker resources and
placement, engine settings, the router's ports and policy, Redis. ``pdserve up --config
FILE`` reads it from YAML (keys are the field names; unknown keys and wrong types are
refused with the key and what is expected), and command-line flags given explicitly win
over the file. Every launcher turns it into the same command lines,
:meth:`DeploymentConfig.worker_args` and :meth:`DeploymentConfig.router_args`, which
``pdserve worker`` / ``pdserve router`` parse: a process, an actor and a pod run one
component the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path

ROLES = ("prefill", "decode", "mixed")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class DeploymentError(ValueError):
    """A deployment that cannot run; the message names the key and the fix."""


@dataclass(frozen=True)
class DeploymentConfig:
    model: str = ""
    """Local checkpoint directory; empty: the default model (converted once)."""
    mixed: int | None = None
    """Colocated workers; None: 1, or 0 when prefill and decode workers are asked for."""
    prefill: int = 0
    decode: int = 0
    local_prefill_threshold: int = 32
    transfer_timeout_s: float = 30.0
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 8000
    metrics_port: int | None = 9400
    """The router's Prometheus ``/metrics`` (0: any free port; None: off); workers
    serve theirs on free ports."""
    dtype: str = "float32"
    kv_cache_gb: float = 1.0
    max_in_flight: int = 256
    threads_per_worker: int | None = None
    """torch threads per worker; None: this machine's cores / workers (at least 1)."""
    block_size: int = 16
    max_model_len: int | None = None
    redis_url: str | None = None
    """An existing Redis for the prefix index and registry; None: start one (``redis``)."""
    redis: bool = True
    """Start a ``redis-server`` on a free loopback port (persistence off) when no
    ``redis_url`` is given; without one the cluster routes by load only."""
    policy: str = "cache_aware"
    log_dir: str | None = None
    """Where each process writes ``<name>.log``; None: they share this terminal."""
    # -- Ray placement (``pdserve up`` on Ray) --------------------------------------------
    launcher: str = "ray"
    """``ray``: actors on a Ray cluster (a fresh local one unless ``ray_address``);
    ``process``: plain processes on this machine."""
    ray_address: str | None = None
    dashboard: bool = True
    """Start the Ray dashboard with a fresh local Ray (127.0.0.1:8265; ~1 GB more RSS)."""
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    prefill_strategy: str = "PACK"
    decode_strategy: str = "PACK"
    mixed_strategy: str = "PACK"
    """Placement-group strategy per pool: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD."""
    drain_timeout_s: float = 30.0
    """Scaling down: how long a removed worker may take to finish its requests."""

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 0 or (self.mixed or 0) < 0:
            raise DeploymentError("worker counts must be >= 0")
        if (self.prefill == 0) != (self.decode == 0):
            raise DeploymentError(f"--prefill {self.prefill} --decode {self.decode}: a "
                                  "disaggregated cluster needs at least one of each")
        if self.num_mixed + self.prefill == 0:
            raise DeploymentError("no workers: give --mixed K or --prefill N --decode M")
        if self.launcher not in ("ray", "process"):
            raise DeploymentError(f"launcher: {self.launcher!r}; use ray or process")
        for role in ROLES:
            strategy = self.strategy(role)
            if strategy not in STRATEGIES:
                raise DeploymentError(f"{role}_strategy: {strategy!r}; use one of "
                                      f"{', '.join(STRATEGIES)}")
        if self.cpus_per_worker < 0 or self.gpus_per_worker < 0:
            raise DeploymentError("cpus_per_worker and gpus_per_worker must be >= 0")

    @property
    def num_mixed(self) -> int:
        if self.mixed is not None:
            return self.mixed
        return 0 if self.prefill else 1

    def pool_sizes(self) -> dict[str, int]:
        return {"prefill": self.prefill, "decode": self.decode, "mixed": self.num_mixed}

    def strategy(self, role: str) -> str:
        return str(getattr(self, f"{role}_strategy"))

    def roles(self) -> list[tuple[str, str]]:
        """(name, role) of every worker, in start order."""
        return [(f"{role}-{i}" if role != "mixed" else f"worker-{i}", role)
                for role, n in self.pool_sizes().items() for i in range(n)]

    def threads(self, cores: int) -> int:
        workers = self.prefill + self.decode + self.num_mixed
        return self.threads_per_worker or max(1, cores // workers)

    def worker_args(self, role: str, host: str, port: int, redis_url: str | None,
                    threads: int, metrics_port: int | None = None) -> list[str]:
        """``pdserve worker`` arguments for one worker of ``role``."""
        args = ["worker", "--role", role, "--host", host, "--port", str(port),
                "--dtype", self.dtype, "--kv-cache-gb", str(self.kv_cache_gb),
                "--block-size", str(self.block_size), "--threads", str(threads),
                "--local-prefill-threshold", str(self.local_prefill_threshold),
                "--transfer-timeout-s", str(self.transfer_timeout_s),
                "--drain-timeout-s", str(self.drain_timeout_s)]
        if self.model:
            args += ["--model", self.model]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        if redis_url:
            args += ["--redis-url", redis_url]
        if metrics_port is not None:
            args += ["--metrics-port", str(metrics_port)]
        if self.gpus_per_worker > 0:
            args += ["--device", "cuda"]
        return args

    def router_args(self, workers: list[str], redis_url: str | None) -> list[str]:
        """``pdserve router`` arguments (``workers``: static addresses, beside the
        registry's)."""
        args = ["router", "--host", self.host, "--port", str(self.port),
                "--http-port", str(self.http_port), "--max-in-flight", str(self.max_in_flight),
                "--policy", self.policy]
        if self.metrics_port is not None:
            args += ["--metrics-port", str(self.metrics_port)]
        if self.model:
            args += ["--model", self.model]
        for address in workers:
            args += ["--worker", address]
        if redis_url:
            args += ["--redis-url", redis_url]
        return args


def load_yaml(path: str | Path) -> dict[str, object]:
    """The file's keys, checked against :class:`DeploymentConfig`'s fields and types."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise DeploymentError(f"{path}: cannot read the deployment file: {e}") from e
    if not isinstance(data, dict):
        raise DeploymentError(f"{path}: expected a mapping of settings at the top level")
    fields = {f.name: f for f in dataclasses.fields(DeploymentConfig)}
    hints = typing.get_type_hints(DeploymentConfig)
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=2)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise DeploymentError(f"{path}: unknown key {key!r}{hint}; the keys are "
                                  "DeploymentConfig's fields (cluster/deployment.py)")
        if not _fits(value, hints[key]):
            raise DeploymentError(f"{path}: {key}: {value!r} is not a {hints[key]}")
    return data


def _fits(value: object, hint: object) -> bool:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)  # type: ignore[arg-type]
