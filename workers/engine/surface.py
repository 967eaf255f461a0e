"""What servers may see of an engine: small frozen value objects, never its internals.

Like vLLM's ``KVCacheBlocks`` (the one thing its scheduler gets from the KV cache
manager), :class:`~workers.engine.llm_engine.LLMEngine` hands servers, the engine loop
and the KV transfer these snapshots instead of its scheduler, block manager or model
runner, so those can change behind them:

- :class:`KVCapacity` (``LLMEngine.capacity``): what the engine can hold, fixed;
- :class:`EngineLoad` (``LLMEngine.load``): the queues and the block pool, a snapshot;
- :class:`KVView` (``LLMEngine.kv_view``): the paged cache a transfer reads and writes;
- :class:`KVReservation` (``LLMEngine.reserve_request``): a decode-side reservation.

Plain data, no torch: the module is in the engine core's ``engine-core-pure`` import
contract (pyproject.toml), so it can be imported and tested without the model stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVCapacity:
    """What this engine can hold; fixed at construction."""

    num_blocks: int
    block_size: int
    max_model_len: int
    model_id: str
    """Seeds the block-hash chain (see :func:`~workers.engine.llm_engine.model_identity`)."""


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of the queues and the KV block pool."""

    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    reserved: int = 0
    """Requests holding blocks for KV in transit: decode, reserved (or waiting for room)
    until the KV lands; prefill, held until their KV has been sent."""


@dataclass(frozen=True)
class KVView:
    """The paged KV cache as a transfer reads and writes it: ``cache`` is
    ``[layers, 2, num_blocks * block_size, kv_heads, row]`` and block ``b`` is rows
    ``b * block_size`` up to ``(b + 1) * block_size``. Write only into a reservation's
    blocks, read only blocks held for export (``on_prefilled``). ``kv_format`` names what
    a row stores (``auto``: ``head_dim`` values of the model's dtype; otherwise bytes of
    a quantized format, :mod:`workers.models.kv_format`)."""

    # A torch.Tensor. Typed Any, not ``torch.Tensor`` under TYPE_CHECKING: import-linter
    # counts TYPE_CHECKING imports by default, which would break engine-core-pure.
    cache: Any
    block_size: int
    kv_format: str = "auto"
    kv_digest: int = 0
    """The key transform's digest (quantized formats; 0: none): must match across a
    transfer."""


@dataclass(frozen=True)
class KVReservation:
    """Blocks :meth:`~workers.engine.llm_engine.LLMEngine.reserve_request` holds for a
    whole prompt."""

    block_table: tuple[int, ...]
    """Every block of the prompt, the cached prefix first."""
    cached_tokens: int
    """Leading prompt tokens (whole blocks) whose KV is already here: not sent."""
    num_tokens: int
    block_size: int

    @property
    def skip_blocks(self) -> int:
        return self.cached_tokens // self.block_size

    @property
    def target_block_ids(self) -> tuple[int, ...]:
        """The blocks the transfer fills."""
        return self.block_table[self.skip_blocks:]

    @property
    def uncached_tokens(self) -> int:
        return self.num_tokens - self.cached_tokens
