"""What the planner compares: one pool configuration (:class:`PoolConfig`) and the
resources candidates are cut from (:class:`Resources`). Typed, frozen, checked once.

A configuration is what ``pdserve up`` would start: ``mixed_workers`` colocated
workers, or ``prefill_workers`` + ``decode_workers`` (disaggregated), each with its
threads per worker (which of the profile's step models it runs), the decode workers'
``local_prefill_threshold`` (conditional disaggregation) and the router's policy.
``adaptive`` is disaggregated with the router's live prefill-placement rule
(:mod:`router.adaptive`) on top of the static threshold. ``kv_offer`` is the prefill
workers' ``--kv-offer``: when a remote prompt's KV moves (during its prefill step, layer
by layer, by default), for the simulator and the placement rule alike.

Resources are ``units`` of one kind: CPU cores (a worker of ``t`` threads takes ``t``
of them) or GPUs (a worker takes one GPU and runs the profile's one-thread step model:
a GPU profile is written with ``--threads 1``, a GPU being one unit of compute).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from common.cost_model import KV_OFFERS

KINDS = ("mixed", "disaggregated", "adaptive")
RESOURCE_KINDS = ("cores", "gpus")


@dataclass(frozen=True)
class PoolConfig:
    kind: str
    mixed_workers: int = 0
    prefill_workers: int = 0
    decode_workers: int = 0
    mixed_threads: int = 0
    prefill_threads: int = 0
    decode_threads: int = 0
    local_prefill_threshold: int = 0
    """Decode workers prefill a prompt themselves when its uncached part is shorter."""
    policy: str = "cache_aware"
    itl_budget_ms: float | None = None
    """``adaptive`` only: the longest step a local prefill may make decodes wait."""
    ttft_slo_ms: float | None = None
    """``adaptive`` only: the router's TTFT target (``pdserve router --slo-ttft-ms``), below
    which a prompt goes remote though local would be sooner (None: none)."""
    kv_offer: str = "layers"
    """Disaggregated only: the prefill workers' ``--kv-offer``."""
    prefill_tokens_while_decoding: int = 0
    """Every worker's ``--prefill-tokens-while-decoding`` (0: none): the live planner
    sets it from the traffic (:class:`planner.caps.PrefillCapChooser`)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"PoolConfig.kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "mixed":
            ok = self.mixed_workers >= 1 and self.mixed_threads >= 1 and not (
                self.prefill_workers or self.decode_workers)
        else:
            ok = (self.prefill_workers >= 1 and self.decode_workers >= 1
                  and self.prefill_threads >= 1 and self.decode_threads >= 1
                  and not self.mixed_workers)
        if not ok:
            raise ValueError(f"PoolConfig: a {self.kind} configuration needs workers and "
                             f"threads of its roles only, got {self}")
        if self.local_prefill_threshold < 0:
            raise ValueError(f"local_prefill_threshold must be >= 0, got "
                             f"{self.local_prefill_threshold}")
        if self.prefill_tokens_while_decoding < 0:
            raise ValueError(f"prefill_tokens_while_decoding must be >= 0, got "
                             f"{self.prefill_tokens_while_decoding}")
        if self.kv_offer not in KV_OFFERS:
            raise ValueError(f"PoolConfig.kv_offer must be one of {KV_OFFERS}, got "
                             f"{self.kv_offer!r}")
        if self.kind == "adaptive" and not (self.itl_budget_ms or 0) > 0:
            raise ValueError(f"an adaptive configuration needs itl_budget_ms > 0, got "
                             f"{self.itl_budget_ms}")
        if self.ttft_slo_ms is not None and (self.kind != "adaptive" or self.ttft_slo_ms <= 0):
            raise ValueError(f"ttft_slo_ms must be > 0 and only an adaptive configuration "
                             f"has one; got {self.ttft_slo_ms} on kind {self.kind!r}")

    @property
    def disaggregated(self) -> bool:
        return self.kind != "mixed"

    @property
    def workers(self) -> int:
        return self.mixed_workers + self.prefill_workers + self.decode_workers

    def units(self, resource_kind: str = "cores") -> int:
        """Cores (threads summed over workers) or GPUs (one per worker) it takes."""
        if resource_kind == "gpus":
            return self.workers
        return (self.mixed_workers * self.mixed_threads + self.prefill_workers
                * self.prefill_threads + self.decode_workers * self.decode_threads)

    @property
    def label(self) -> str:
        cap = self.prefill_tokens_while_decoding
        return self.roles_label + (f", prompts <= {cap} tokens a step while decoding"
                                   if cap else "")

    @property
    def roles_label(self) -> str:
        """:attr:`label` without the stall-free cap: the pools and how prompts move."""
        if self.kind == "mixed":
            return f"{self.mixed_workers} mixed x{self.mixed_threads}t"
        pd = (f"{self.prefill_workers}P x{self.prefill_threads}t + {self.decode_workers}D "
              f"x{self.decode_threads}t")
        offer = "" if self.kv_offer == "layers" else f", KV offered {self.kv_offer}"
        if self.kind == "adaptive":
            return f"{pd}, adaptive (static {self.local_prefill_threshold}){offer}"
        if not self.local_prefill_threshold:
            return f"{pd}, all remote{offer}"
        return f"{pd}, local < {self.local_prefill_threshold}{offer}"

    def as_dict(self) -> dict:
        d = asdict(self)
        if self.kind != "adaptive":
            del d["itl_budget_ms"]
        if self.ttft_slo_ms is None:
            del d["ttft_slo_ms"]
        if self.kind == "mixed":
            del d["kv_offer"]
        if not self.prefill_tokens_while_decoding:
            del d["prefill_tokens_while_decoding"]
        return d


@dataclass(frozen=True)
class Resources:
    """What the candidates may use, and its price per unit-hour."""

    units: int
    kind: str = "cores"
    price_per_unit_hour: float = 0.05

    def __post_init__(self) -> None:
        if self.kind not in RESOURCE_KINDS:
            raise ValueError(f"Resources.kind must be one of {RESOURCE_KINDS}, got "
                             f"{self.kind!r}")
        if self.units < 1:
            raise ValueError(f"Resources.units must be >= 1, got {self.units}")
        if self.price_per_unit_hour < 0:
            raise ValueError(f"price per {self.kind[:-1]}-hour must be >= 0, got "
                             f"{self.price_per_unit_hour}")

