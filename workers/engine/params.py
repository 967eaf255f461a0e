"""Typed, validated request parameters and engine configuration.

Everything here is checked once, at construction, and never mutated afterwards. A bad
value raises :class:`InvalidRequestError` naming the field, the value and the limit, so a
server can hand it to the client as ``INVALID_ARGUMENT`` unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass


class InvalidRequestError(ValueError):
    """A request the engine refuses; ``field`` names the offending parameter."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request (OpenAI / vLLM semantics).

    ``temperature == 0`` is greedy. ``top_k <= 0`` disables top-k. Filters apply in the
    order temperature, top-k, top-p, min-p. ``seed`` makes a request's samples
    independent of whatever else shares its batch. ``logprobs=n`` returns the sampled
    token's log-probability and the ``n`` most likely ones (of the raw model distribution).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so the object stays hashable/frozen.
        object.__setattr__(self, "stop", _as_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _as_tuple(stop: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of the torch-free core: block pool, per-step budget, batch size."""

    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    model_id: str = "model"
    enable_prefix_caching: bool = True
    watermark_blocks: int = 0
    """Blocks kept free when admitting new requests, so running ones can grow a little
    before anyone is preempted."""

    def __post_init__(self) -> None:
        checks = {
            "num_blocks": self.num_blocks >= 1,
            "block_size": self.block_size >= 1,
            "max_num_batched_tokens": self.max_num_batched_tokens >= 1,
            "max_num_seqs": self.max_num_seqs >= 1,
            "watermark_blocks": 0 <= self.watermark_blocks < self.num_blocks,
            # A sequence must fit in the whole pool, or it could never be scheduled.
            "max_model_len": 2 <= self.max_model_len <= self.num_blocks * self.block_size,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"SchedulerConfig.{name} out of range: {getattr(self, name)}")


DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs; the CLI reads flags and environment into it once.

    The KV cache is preallocated from ``kv_cache_memory_gb`` (or exactly ``num_blocks``
    when given) and never grows per request.
    """

    model: str
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_memory_gb: float = 2.0
    num_blocks: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_memory_gb <= 0 and self.num_blocks is None:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
