"""A worker's typed configuration: checked once at construction, never mutated (a role
change makes a new one). Its own module so the server (:mod:`workers.server`) and the
role switch (:mod:`workers.roles`) both take it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.tls import ClusterTLS

from .engine.params import EngineConfig
from .transfer import TransferConfig

ROLES = ("mixed", "prefill", "decode")


@dataclass(frozen=True)
class WorkerConfig:
    """``local_prefill_threshold`` (decode role): a request whose uncached prompt part is
    shorter is prefilled here instead of on a prefill worker (conditional
    disaggregation); 0 sends every prompt to a prefill worker."""

    engine: EngineConfig
    model_name: str
    role: str = "mixed"
    host: str = "127.0.0.1"
    port: int = 50061
    transfer: TransferConfig = field(default_factory=TransferConfig)
    local_prefill_threshold: int = 32
    redis_url: str | None = None
    """Register in the worker registry and publish KV block events to the prefix index
    there (see :mod:`workers.presence`); None: neither."""
    registry_ttl_s: float = 3.0
    metrics_port: int | None = None
    """Serve Prometheus ``/metrics`` here (0: any free port); None: no endpoint."""
    ray_metrics: bool = False
    """Mirror the metrics into ``ray.util.metrics`` (inside a Ray actor)."""
    drain_timeout_s: float = 30.0
    drain_grace_s: float = 2.0
    """Draining: how long requests routed before the registry said we left may still
    arrive (at least the routers' discovery interval)."""
    reservation_timeout_s: float = 600.0
    """Decode role: how long reserved blocks wait for their KV offer. Long on purpose:
    prefill queues can be deep, and the router's stream bounds a reservation anyway
    (a cancelled or broken Decode call frees it at once)."""
    step_trace: str | None = None
    """Append each engine step's time and shape to this CSV (:mod:`workers.step_trace`);
    None: no trace."""
    publish_steps: bool = False
    """Note each engine step on the model's served-steps stream in Redis
    (:mod:`common.served_steps`), which the live planner refits its step model from
    (``pdserve up --autoscale`` turns it on); needs ``redis_url``."""
    cluster_tls: ClusterTLS | None = None
    """Serve gRPC with mutual TLS: only clients presenting a certificate of the cluster
    CA get an answer. None: plaintext (a private network, or loopback)."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.publish_steps and not self.redis_url:
            raise ValueError("publish_steps writes to Redis: give redis_url")
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0, got "
                             f"{self.local_prefill_threshold}")
