"""Routing policies: pure decisions from candidates (no I/O)."""

from __future__ import annotations

import pytest

from router.policies import (
    CacheAware,
    Candidate,
    LeastLoaded,
    RoundRobin,
    make_policy,
)


def test_round_robin_takes_turns_and_skips_unhealthy() -> None:
    rr = RoundRobin()
    cands = [Candidate("a"), Candidate("b", healthy=False), Candidate("c")]
    assert [rr.choose(cands, 10).address for _ in range(4)] == ["a", "c", "a", "c"]


def test_least_loaded() -> None:
    d = LeastLoaded().choose([Candidate("a", 3), Candidate("b", 1), Candidate("c", 1, 50)], 10)
    assert (d.address, d.reason) == ("b", "load")


def test_cache_aware_prefers_the_holder_of_a_long_prefix() -> None:
    cands = [Candidate("a", 1, 0, 0), Candidate("b", 2, 100, 960)]
    d = CacheAware().choose(cands, 1024)
    assert (d.address, d.reason, d.cached_tokens, d.estimated_tokens) == ("b", "cache", 960, 164)


def test_cache_aware_stays_with_a_busy_holder_but_not_for_a_short_prefix() -> None:
    # b holds 960 of 1024 tokens and has 2000 queued: still b (recomputing wastes work).
    d = CacheAware().choose([Candidate("a", 1, 0, 0), Candidate("b", 2, 2000, 960)], 1024)
    assert (d.address, d.reason) == ("b", "cache")
    # b holds only 256 (< half): the least estimated work wins, a computing it all.
    d = CacheAware().choose([Candidate("a", 1, 0, 0), Candidate("b", 2, 2000, 256)], 1024)
    assert (d.address, d.reason, d.estimated_tokens) == ("a", "load", 1024)


def test_cache_aware_balance_guard() -> None:
    cands = [Candidate("a", 1), Candidate("b", 12, 0, 1000)]
    d = CacheAware(balance_abs=8, balance_rel=2.0).choose(cands, 1024)
    assert (d.address, d.reason) == ("a", "balance")
    # Same gap, but not a factor 2 apart: the cache still decides.
    d = CacheAware(balance_abs=8, balance_rel=2.0).choose(
        [Candidate("a", 10), Candidate("b", 19, 0, 1000)], 1024)
    assert (d.address, d.reason) == ("b", "cache")


def test_cache_aware_breaks_ties_in_turn() -> None:
    """Fed one prompt at a time, new prefixes spread over the pool (none stays cold), as
    do the prompts of a prefix every worker holds; a real difference still decides."""
    policy = CacheAware()
    idle = [Candidate("a"), Candidate("b"), Candidate("c")]
    assert [policy.choose(idle, 100).address for _ in range(6)] == list("abcabc")
    both = [Candidate("a", 0, 0, 90), Candidate("b", 0, 0, 90)]
    assert {policy.choose(both, 100).address for _ in range(4)} == {"a", "b"}
    holder = [Candidate("a", 0, 0, 90), Candidate("b", 0, 0, 0)]
    assert {policy.choose(holder, 100).address for _ in range(4)} == {"a"}
    less = [Candidate("a", 0, 50), Candidate("b", 0, 0)]
    assert {policy.choose(less, 100).address for _ in range(4)} == {"b"}
    # The turn moves on ties only: new prefixes alternating with hits still alternate.
    new_prefix = []
    for _ in range(4):
        new_prefix.append(policy.choose([Candidate("a"), Candidate("b")], 100).address)
        policy.choose(holder, 100)
    assert sorted(new_prefix) == ["a", "a", "b", "b"]


def test_all_unhealthy_still_decides_and_says_so() -> None:
    d = LeastLoaded().choose([Candidate("a", healthy=False)], 5)
    assert (d.address, d.reason) == ("a", "unhealthy")


def test_unknown_policy_is_named() -> None:
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("random")
