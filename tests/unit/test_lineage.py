"""router.lineage: which earlier prompt a prompt continues (the traffic log's link from a
chat's turn to the one before it)."""

from __future__ import annotations

import random

import pytest

from router.lineage import Lineage

RNG = random.Random(7)


def ids(n: int) -> list[int]:
    return [RNG.randrange(1, 49_000) for _ in range(n)]


def test_each_turn_links_to_the_turn_before_it_not_the_first() -> None:
    links = Lineage("m", block_size=16)
    t1 = ids(192)
    t2 = t1 + ids(64 + 192)  # the reply and the next message
    t3 = t2 + ids(256)
    assert links.link(t1, "a") == ""
    assert links.link(t2, "b") == "a"
    assert links.link(t3, "c") == "b"  # the deepest: t2's blocks, not only t1's


def test_a_prompt_ending_mid_block_links_on_its_full_blocks() -> None:
    links = Lineage("m", block_size=16)
    t1 = ids(200)  # 12 full blocks and 8 tokens
    links.link(t1, "a")
    assert links.link(t1[:192] + ids(100), "b") == "a"  # its full blocks, not its tail
    assert links.link(t1[:191] + ids(100), "c") == ""
    assert links.link(t1[:192] + ids(4), "d") == ""  # not longer: no continuation


def test_turns_that_end_in_the_same_block_each_link_to_the_one_before() -> None:
    """A next turn shorter than a block past its parent ends in the parent's last full
    block: each keeps its own entry there, so the one after still finds its parent."""
    links = Lineage("m", block_size=16)
    t1 = ids(22)
    t2 = t1 + ids(8)  # 30 tokens: the same one full block
    assert [links.link(p, k) for p, k in ((t1, "a"), (t2, "b"), (t2, "c"), (t1, "d"),
                                          (t2, "e"))] == ["", "a", "a", "", "d"]


def test_unrelated_prompts_and_a_shared_system_prompt_alone_do_not_link() -> None:
    links = Lineage("m", block_size=16)
    system = ids(64)
    links.link(system + ids(128), "a")
    assert links.link(system + ids(128), "b") == ""  # another user after the same system
    assert links.link(ids(300), "c") == ""


def test_the_cache_salt_and_the_model_separate_lineages() -> None:
    links = Lineage("m", block_size=16)
    t1 = ids(64)
    links.link(t1, "a", cache_salt="tenant-1")
    assert links.link(t1 + ids(32), "b", cache_salt="tenant-2") == ""
    assert links.link(t1 + ids(32), "c", cache_salt="tenant-1") == "a"
    assert Lineage("other", block_size=16).link(t1 + ids(32), "d") == ""


def test_a_prompt_shorter_than_a_block_is_neither_linked_nor_remembered() -> None:
    links = Lineage("m", block_size=16)
    short = ids(15)
    assert links.link(short, "a") == ""
    assert links.link(short + ids(40), "b") == ""


def test_the_same_prompt_again_is_no_continuation_and_old_prompts_are_forgotten() -> None:
    links = Lineage("m", block_size=16, capacity=2)
    p, q, r = ids(32), ids(32), ids(32)
    links.link(p, "a")
    assert links.link(p, "a2") == ""  # a retry, or a template sent twice
    assert links.link(p + ids(16), "b") == "a2"  # the latest such prompt
    links.link(q, "c")
    links.link(r, "d")  # capacity 2: p's entries go first
    assert links.link(p + ids(16), "e") == ""
    assert links.link(r + ids(16), "f") == "d"
    with pytest.raises(ValueError, match="capacity"):
        Lineage("m", capacity=0)
