"""The router's typed configuration: checked once at construction, never mutated.

Its own module so every part of the router (the pool, the lifecycle, the server) can
take it without importing the lifecycle that composes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.cost_model import KV_OFFERS

from .limits import TenantLimits
from .policies import make_policy


@dataclass(frozen=True)
class RouterConfig:
    workers: tuple[str, ...]
    model_path: str  # tokenizer and chat template come from here
    model_name: str
    max_in_flight: int = 256
    connect_timeout_s: float = 120.0
    down_s: float = 5.0
    """How long a worker that failed a call is passed over (unless all are)."""
    redis_url: str | None = None
    """The shared prefix index and worker registry; workers found there join the pools
    (beside any given in ``workers``) and leave when their heartbeat expires."""
    policy: str = "cache_aware"
    """How prefill (or mixed) workers are chosen: see :mod:`router.policies`."""
    discovery_interval_s: float = 1.0
    reset_grace_s: float = 10.0
    """How long workers missing from a registry that came back empty (Redis restarted or
    flushed) are kept while they register again."""
    retire_after_s: float = 60.0
    """A worker found in the registry that left it leaves the pool (and ``pdserve
    status``) after this long, or sooner once a worker of its role joins after it."""
    stall_probe_after_s: float = 0.5
    """A prefill call or a reservation still waiting after this long asks its worker for
    its load; a worker that does not answer within ``stall_probe_timeout_s`` is stalled:
    passed over while silent (a prefill's prompts computed on the decode workers, a
    reservation made on the next decode worker; :mod:`router.stall`). 0: off."""
    stall_probe_timeout_s: float = 1.0
    prefill_queue_limit: int = 0
    """Overflow: a disaggregated prompt is computed on its decode worker when every
    prefill worker that could take it already has this many prompts from this router in
    flight (a prefill pool that lost a worker, or too small for a burst, then borrows the
    decode workers' steps instead of queueing); and, while the prefill pool is short of a
    worker (:meth:`router.pool.WorkerPool.short`), one whose decode worker already holds
    it but for its last block. 0: off."""
    prefix_lookup_budget_s: float = 0.1
    """The longest a request waits for the shared prefix index (Redis): past it, routed
    from this router's memory and Redis skipped for a second (:mod:`router.prefix_lookup`).
    0: no limit."""
    migration_limit: int = 3
    """How many times a request may move to another worker after its worker failed."""
    tenant_max_concurrency: int = 0
    """Requests a tenant may have in flight (0: unlimited), unless its key line says."""
    tenant_tokens_per_minute: int = 0
    """Tokens (prompt + max_tokens, settled to what was used) a tenant may spend per
    minute (0: unlimited), unless its key line says; see :mod:`router.limits`."""

    placement_profile: str | None = None
    """A machine profile (``pdserve profile --out FILE``): disaggregated prompts are then
    placed (prefill worker or the decode worker itself) from live state by
    :mod:`router.adaptive`; None: the decode workers' static threshold alone decides."""
    decode_threads: int = 1
    prefill_threads: int = 1
    """Threads per worker of each pool: which of the profile's step models applies."""
    itl_budget_ms: float = 200.0
    """The longest step a local prefill may make running decodes wait through."""
    ttft_slo_ms: float | None = None
    """The TTFT target: a prompt the prefill workers are estimated to serve within
    :data:`router.adaptive.TTFT_SHARE` of it goes remote even where local would be
    sooner (None: the sooner of the two, within the ITL budget)."""
    max_num_batched_tokens: int = 2048
    """The workers' step token budget (``pdserve worker --max-num-batched-tokens``): the
    chunks the placement rule expects a prompt to be computed in."""
    kv_offer: str = "layers"
    """The prefill workers' ``--kv-offer``: whether a remote prompt's KV moves while its
    prefill computes it (``layers``) or after (the placement rule's remote estimate)."""

    def __post_init__(self) -> None:
        if not self.workers and not self.redis_url:
            raise ValueError("the router needs worker addresses or a registry (redis_url)")
        make_policy(self.policy)  # validates the name
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        self.tenant_limits()  # validates them
        if self.stall_probe_after_s < 0 or self.stall_probe_timeout_s <= 0:
            raise ValueError(f"stall_probe_after_s must be >= 0 (0: off) and "
                             f"stall_probe_timeout_s > 0, got {self.stall_probe_after_s} and "
                             f"{self.stall_probe_timeout_s}")
        if self.prefill_queue_limit < 0:
            raise ValueError(f"prefill_queue_limit must be >= 0 (0: off), got "
                             f"{self.prefill_queue_limit}")
        if self.itl_budget_ms <= 0:
            raise ValueError(f"itl_budget_ms must be > 0, got {self.itl_budget_ms}")
        if self.ttft_slo_ms is not None and self.ttft_slo_ms <= 0:
            raise ValueError(f"ttft_slo_ms must be > 0 (None: none), got {self.ttft_slo_ms}")
        if self.kv_offer not in KV_OFFERS:
            raise ValueError(f"kv_offer must be one of {', '.join(KV_OFFERS)}, got "
                             f"{self.kv_offer!r}")

    def tenant_limits(self) -> TenantLimits:
        """Every tenant's limits unless its key line overrides them."""
        return TenantLimits(self.tenant_max_concurrency, self.tenant_tokens_per_minute)
