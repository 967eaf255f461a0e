"""Block manager: allocation, sharing, LRU eviction, re-check on hit, events. No torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from workers.engine.block_manager import BlockManager
from workers.engine.params import SamplingParams
from workers.engine.sequence import Sequence

BS = 4


class Events:
    def __init__(self) -> None:
        self.stored: list[int] = []
        self.evicted: list[int] = []

    def on_blocks_stored(self, block_hashes: list[int]) -> None:
        self.stored += block_hashes

    def on_blocks_evicted(self, block_hashes: list[int]) -> None:
        self.evicted += block_hashes


def seq(tokens: list[int], sid: str = "s") -> Sequence:
    return Sequence(sid, tokens, SamplingParams(), 0, BS, "m")


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    """What the scheduler does for a whole-prompt prefill: reuse, allocate, compute."""
    bm.take_prefix(s, bm.match_prefix(s))
    assert bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.cache_computed_blocks(s)


def assert_all_free(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_engine_core_imports_without_torch() -> None:
    code = "import sys, workers.engine.scheduler; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_and_free_returns_every_block() -> None:
    bm = BlockManager(8, BS)
    s = seq(list(range(10)))
    assert bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.allocate(s, 12) and len(s.block_table) == 3  # still fits
    assert bm.allocate(s, 13) and len(s.block_table) == 4
    bm.free(s)
    assert s.block_table == []
    assert_all_free(bm)


def test_allocation_fails_without_side_effects_when_short() -> None:
    bm = BlockManager(2, BS)
    s = seq(list(range(12)))
    assert not bm.allocate(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_shared_prefix_is_reused_and_reference_counted() -> None:
    ev = Events()
    bm = BlockManager(16, BS, listeners=[ev])
    a = seq(list(range(10)), "a")
    run_prefill(bm, a)
    assert ev.stored == a.block_hashes[:2]  # two full blocks; the partial one is not cached
    b = seq(list(range(8)) + [99, 98, 97], "b")
    m = bm.match_prefix(b)
    assert m.block_ids == tuple(a.block_table[:2]) and m.num_tokens == 8
    run_prefill(bm, b)
    assert b.num_computed_tokens == 11 and b.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    bm.free(a)
    bm.free(b)
    assert_all_free(bm)
    assert bm.num_cached_blocks == 2  # free but still cached


def test_fully_cached_prompt_still_computes_its_last_block() -> None:
    bm = BlockManager(8, BS)
    a = seq(list(range(8)), "a")
    run_prefill(bm, a)
    bm.free(a)
    m = bm.match_prefix(seq(list(range(8)), "b"))
    assert m.num_tokens == 4  # the logits of the last token are needed


def test_lru_eviction_order_and_evicted_events() -> None:
    ev = Events()
    bm = BlockManager(4, BS, listeners=[ev])
    a, b = seq(list(range(4)), "a"), seq(list(range(100, 104)), "b")
    run_prefill(bm, a)
    run_prefill(bm, b)
    bm.free(a)  # a freed first: least recently used
    bm.free(b)
    c = seq(list(range(200, 212)), "c")  # needs 3 blocks: 2 uncached first, then a's
    assert bm.allocate(c, 12)
    assert ev.evicted == a.block_hashes
    assert bm.match_prefix(seq(list(range(100, 104)) + [1], "b2")).num_tokens == 4
    assert bm.match_prefix(seq(list(range(4)) + [1], "a2")).num_tokens == 0
    bm.free(c)
    assert_all_free(bm)


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    bm = BlockManager(4, BS)
    a = seq(list(range(6)), "a")  # one cached full block, one partial uncached block
    run_prefill(bm, a)
    partial = a.block_table[1]
    bm.free(a)
    c = seq([7], "c")
    assert bm.allocate(c, 1)
    assert c.block_table == [partial]  # the uncached block goes first
    bm.free(c)
    assert_all_free(bm)


def test_hash_hit_with_different_tokens_is_a_miss() -> None:
    bm = BlockManager(8, BS)
    a = seq(list(range(8)), "a")
    run_prefill(bm, a)
    bm.free(a)
    b = seq([50, 51, 52, 53, 54], "b")
    b.block_hashes[0] = a.block_hashes[0]  # forge a collision
    assert bm.match_prefix(b).num_tokens == 0


def test_prefix_caching_can_be_disabled() -> None:
    ev = Events()
    bm = BlockManager(8, BS, enable_prefix_caching=False, listeners=[ev])
    a = seq(list(range(9)), "a")
    run_prefill(bm, a)
    bm.free(a)
    assert bm.match_prefix(seq(list(range(9)), "b")).num_tokens == 0
    assert ev.stored == [] and bm.num_cached_blocks == 0


def test_generated_tokens_fill_and_cache_blocks() -> None:
    ev = Events()
    bm = BlockManager(8, BS, listeners=[ev])
    s = seq([1, 2, 3], "s")
    run_prefill(bm, s)
    assert ev.stored == []
    s.append_token(4)  # completes block 0 with a generated token
    assert len(s.block_hashes) == 1
    assert s.block_hashes == seq([1, 2, 3, 4]).block_hashes
    s.num_computed_tokens = 4
    bm.cache_computed_blocks(s)
    assert ev.stored == s.block_hashes
    bm.free(s)
    assert_all_free(bm)


def test_double_free_is_caught() -> None:
    bm = BlockManager(4, BS)
    s = seq([1, 2])
    assert bm.allocate(s, 2)
    table = list(s.block_table)
    bm.free(s)
    s.block_table = table
    with pytest.raises(AssertionError):
        bm.free(s)


def test_reused_blocks_come_back_in_ascending_runs() -> None:
    """Freed back to front, a prompt's blocks sit reversed in the LRU queue; allocation
    still hands them out ascending, so a KV transfer sees one run, not n single blocks."""
    bm = BlockManager(8, BS)
    a = seq(list(range(8 * BS)), "a")
    run_prefill(bm, a)
    bm.free(a)
    b = seq([1000 + t for t in range(6 * BS)], "b")  # evicts the 6 least recently used
    assert bm.allocate(b, b.num_tokens)
    assert b.block_table == sorted(b.block_table) == list(range(2, 8))
    bm.free(b)
    assert_all_free(bm)
