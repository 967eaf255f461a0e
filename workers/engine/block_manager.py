"""Reference-counted KV blocks with prefix caching and LRU eviction. No torch.

A block is *free* when no sequence references it. A free block may still be *cached*:
it keeps its hash and tokens, so a later request with the same prefix takes it back
instead of recomputing it. Free blocks sit in one queue in the order they were freed;
allocation takes from the front, so the least recently used cached block is evicted
first (its hash is dropped and listeners hear ``evicted``). A sequence frees its blocks
back to front, so a prompt's tail is evicted before its head, and the head, shared by
more requests, lives longest.

Listeners hear ``stored`` when a fully computed block gets its hash (the Redis prefix
index consumes both events). All methods mutate and are not thread-safe: one engine
thread owns the manager.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from .sequence import Sequence


class KVEventListener(Protocol):
    """Receives block-hash events; called on the engine thread, must not block long."""

    def on_blocks_stored(self, block_hashes: list[int]) -> None: ...

    def on_blocks_evicted(self, block_hashes: list[int]) -> None: ...


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = field(default=())


@dataclass(frozen=True)
class PrefixMatch:
    """Result of :meth:`BlockManager.match_prefix`: cached blocks a sequence can reuse."""

    block_ids: tuple[int, ...]
    num_tokens: int
    num_free_reused: int  # of those, how many currently sit in the free queue


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        listeners: Iterable[KVEventListener] = (),
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._listeners = list(listeners)

    # -- queries (side-effect free) ---------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so that ``num_tokens`` of its tokens fit."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Longest run of leading full blocks of ``seq`` already cached.

        At least one prompt token is always left to compute (the last one's logits are
        needed), so a fully cached prompt reuses all but its last block. Every hit is
        re-checked token by token: a hash collision is a miss, never a wrong token.
        """
        if not self.enable_prefix_caching or seq.prompt_logprobs is not None:
            return PrefixMatch((), 0, 0)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        ids: list[int] = []
        reused_free = 0
        for i, h in enumerate(seq.block_hashes[:max_blocks]):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tuple(seq.block_tokens(i)):
                break
            ids.append(block_id)
            reused_free += block.ref_count == 0
        return PrefixMatch(tuple(ids), len(ids) * self.block_size, reused_free)

    # -- mutations ---------------------------------------------------------------------

    def take_prefix(self, seq: Sequence, match: PrefixMatch) -> None:
        """Give ``seq`` (holding no blocks) the cached blocks of ``match``."""
        assert not seq.block_table, f"{seq} already holds blocks"
        for block_id in match.block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        seq.block_table = list(match.block_ids)
        seq.num_computed_tokens = match.num_tokens
        seq.num_hashed_blocks = len(match.block_ids)

    def share(self, seq: Sequence, block_ids: Iterable[int]) -> None:
        """Append blocks another live sequence holds to ``seq``'s table (one more
        reference each): the full prompt blocks the choices of one request share. A
        shared block is never written again (it is full), so it needs no copy."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} is free: nothing to share"
            block.ref_count += 1
            seq.block_table.append(block_id)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s block table to hold ``num_tokens``; False (no change) if short."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            return False
        evicted: list[int] = []
        # The LRU picks which blocks; ascending ids keep them in runs (blocks freed back
        # to front come out reversed), so a KV transfer moves each run as one message.
        for block_id in sorted(self._free.popitem(last=False)[0] for _ in range(need)):
            block = self.blocks[block_id]
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                if self._cached.get(block.block_hash) == block_id:
                    del self._cached[block.block_hash]
                block.block_hash, block.token_ids = None, ()
            block.ref_count = 1
            seq.block_table.append(block_id)
        if evicted:
            for listener in self._listeners:
                listener.on_blocks_evicted(evicted)
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Offer every newly full, computed block of ``seq`` to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        upto = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        stored: list[int] = []
        for i in range(seq.num_hashed_blocks, upto):
            h = seq.block_hashes[i]
            if h in self._cached:  # same content computed twice: keep the first copy
                continue
            block = self.blocks[seq.block_table[i]]
            block.block_hash, block.token_ids = h, tuple(seq.block_tokens(i))
            self._cached[h] = block.block_id
            stored.append(h)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, upto)
        if stored:
            for listener in self._listeners:
                listener.on_blocks_stored(stored)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, back to front; cached blocks stay reusable."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.block_hash is None:
                    # Uncached blocks are worthless: reuse them before any cached one.
                    self._free[block_id] = None
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._free[block_id] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash of free blocks (e.g. after a model reload)."""
        evicted = []
        for block_id in self._free:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                self._cached.pop(block.block_hash, None)
                block.block_hash, block.token_ids = None, ()
        if evicted:
            for listener in self._listeners:
                listener.on_blocks_evicted(evicted)
