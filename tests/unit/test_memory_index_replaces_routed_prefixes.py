"""``MemoryPrefixIndex(ttl_s)`` is a drop-in for the router's ``RoutedPrefixes``: the same
random sequence of routings, lookups and clock steps gives the same answers, expiry at
the exact boundary and pruning past ``max_blocks`` included."""

from __future__ import annotations

import random

import pytest

from common.prefix_index import MemoryPrefixIndex
from router.policies import RoutedPrefixes

TTL = 10.0
WORKERS = ["a", "b", "c", "d"]
# 8 prompts of 8 blocks; prompts 2k and 2k+1 share their first 3 blocks.
PROMPTS = [[(p // 2) * 1000 + i if i < 3 else p * 100 + i for i in range(8)]
           for p in range(8)]


def some_blocks(rng: random.Random) -> list[int]:
    """A prefix of a prompt, mostly; sometimes with holes or out of order."""
    prompt = rng.choice(PROMPTS)
    shape = rng.random()
    if shape < 0.6:
        return prompt[: rng.randint(0, len(prompt))]
    if shape < 0.9:
        return [h for h in prompt if rng.random() < 0.7]
    return rng.sample(prompt, rng.randint(1, len(prompt)))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_blocks", [12, 200_000])
def test_same_sequence_same_lookups(seed: int, max_blocks: int) -> None:
    rng = random.Random(seed)
    now = 0.0
    routed = RoutedPrefixes(ttl_s=TTL, max_blocks=max_blocks)
    memory = MemoryPrefixIndex(ttl_s=TTL, max_blocks=max_blocks, clock=lambda: now)
    lookups = hits = 0
    for step in range(400):
        op = rng.random()
        if op < 0.4:
            blocks, worker = some_blocks(rng), rng.choice(WORKERS)
            routed.add(blocks, worker, now)
            memory.publish(worker, stored=blocks)
        elif op < 0.85:
            blocks = some_blocks(rng)
            expected = routed.lookup(blocks, now)
            assert memory.lookup(blocks) == expected, f"seed {seed}, step {step}"
            lookups, hits = lookups + 1, hits + bool(expected)
        else:  # often onto an expiry time exactly (entries live while expiry > now)
            now += rng.choice([0.5, 1.0, 2.5, TTL, TTL + 0.5])
        assert len(memory) == len(routed._blocks)  # noqa: SLF001 - the same pruning
    assert lookups > 100 and 0 < hits < lookups  # the sequence exercised both outcomes
