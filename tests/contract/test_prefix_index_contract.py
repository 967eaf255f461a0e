"""One behaviour suite for every prefix-index backend (llm-d's testCommonIndexBehavior).

Each test gets ``index_for``: model name -> an index of that model; two calls with the
same model share one store (a second router's handle on the same Redis), two models
never see each other. The backends: Redis (a real ``redis-server``), memory (with and
without expiry), and the stacks a router builds, so the wrappers keep the contract too.
The Redis key layout itself is pinned in ``tests/integration/test_prefix_index.py``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest
import redis
from redis_helpers import redis_server

from cluster.redis_server import RedisServer
from common.hashing import block_hashes
from common.metrics import Metrics
from common.prefix_index import (
    FailSoftIndex,
    InstrumentedIndex,
    LayeredIndex,
    MemoryPrefixIndex,
    PrefixIndexBackend,
    RedisPrefixIndex,
)

IndexFor = Callable[[str], PrefixIndexBackend]
BACKENDS = ["redis", "memory", "memory-ttl", "layered-memory", "failsoft-instrumented-redis"]


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with redis_server() as s:
        yield s


@pytest.fixture(params=BACKENDS)
def index_for(request: pytest.FixtureRequest) -> Iterator[IndexFor]:
    kind: str = request.param
    if "redis" in kind:
        client = redis.Redis.from_url(request.getfixturevalue("server").url)
        client.flushall()
        metrics = Metrics({"model": "contract"})
        if kind == "redis":
            yield lambda model: RedisPrefixIndex(client, model)
        else:
            yield lambda model: FailSoftIndex(InstrumentedIndex(
                RedisPrefixIndex(client, model), metrics, backend="redis"))
        client.close()
        return
    stores: dict[str, MemoryPrefixIndex] = {}

    def store(model: str) -> MemoryPrefixIndex:
        if model not in stores:  # a TTL that never runs out here; expiry is tested below
            stores[model] = MemoryPrefixIndex(ttl_s=3600.0) if kind == "memory-ttl" \
                else MemoryPrefixIndex()
        return stores[model]

    yield (lambda model: LayeredIndex(store(model))) if kind == "layered-memory" else store


def hashes(n: int, seed: int = 0) -> list[int]:
    return block_hashes(list(range(seed, seed + 16 * n)), 16, "m", None)


def test_every_backend_is_a_prefix_index(index_for: IndexFor) -> None:
    assert isinstance(index_for("m"), PrefixIndexBackend)


def test_lookup_of_no_blocks_is_empty(index_for: IndexFor) -> None:
    index = index_for("m")
    index.publish("a", hashes(3))
    assert index.lookup([]) == {}


def test_unknown_blocks_match_no_worker(index_for: IndexFor) -> None:
    index = index_for("m")
    assert index.lookup(hashes(3)) == {}
    index.publish("a", hashes(3, seed=1000))
    assert index.lookup(hashes(3)) == {}


def test_lookup_counts_leading_blocks_per_worker(index_for: IndexFor) -> None:
    index = index_for("m")
    h = hashes(5)
    index.publish("a", h)
    index.publish("b", h[:2])
    assert index.lookup(h) == {"a": 5, "b": 2}
    assert index.lookup(h[:1]) == {"a": 1, "b": 1}


def test_a_worker_missing_block_i_is_not_credited_beyond_it(index_for: IndexFor) -> None:
    index = index_for("m")
    h = hashes(5)
    index.publish("a", h[:3])
    index.publish("c", [h[0], h[2], h[3], h[4]])  # lacks block 1: only block 0 counts
    index.publish("d", h[1:])  # lacks block 0: nothing counts
    assert index.lookup(h) == {"a": 3, "c": 1}


def test_counting_stops_at_the_first_block_no_worker_holds(index_for: IndexFor) -> None:
    index = index_for("m")
    h = hashes(6)
    index.publish("a", h[:2] + h[3:])  # a gap at block 2
    index.publish("b", h[:2] + h[3:])
    assert index.lookup(h) == {"a": 2, "b": 2}


def test_the_walk_goes_on_while_any_worker_holds_the_prefix(index_for: IndexFor) -> None:
    index = index_for("m")
    h = hashes(4)
    index.publish("a", h)
    index.publish("b", [h[0], h[1], h[3]])
    assert index.lookup(h) == {"a": 4, "b": 2}
    assert index.lookup([h[0], h[3]]) == {"a": 2, "b": 2}  # hashes chain; lookups take any


def test_each_worker_gets_its_own_leading_run_on_random_layouts(index_for: IndexFor) -> None:
    """Many workers, long prompts, runs of every length, some with holes after them and
    some with blocks of other prompts: the Redis script checks runs of blocks at once and
    walks block by block only where workers drop out, so this covers every branch."""
    rng = random.Random(7)
    for trial in range(12):
        index = index_for(f"m{trial}")
        h = hashes(rng.choice([1, 2, 9, 40, 100]), seed=10_000 * trial)
        expected = {}
        for w in range(rng.randrange(1, 24)):
            run = rng.randrange(len(h) + 1)
            held = h[:run] + [x for x in h[run + 1:] if rng.random() < 0.3]  # h[run]: missing
            held += hashes(3, seed=10_000 * trial + 5_000 + 100 * w)  # another prompt's blocks
            index.publish(f"w{w}", held)
            if run:
                expected[f"w{w}"] = run
        assert index.lookup(h) == expected, trial


def test_evicted_blocks_are_removed_from_the_index(index_for: IndexFor) -> None:
    index = index_for("m")
    h = hashes(4)
    index.publish("a", h)
    index.publish("a", evicted=h[2:])
    assert index.lookup(h) == {"a": 2} and index.blocks_of("a") == set(h[:2])
    index.publish("a", stored=[h[2]], evicted=[h[2]])  # one batch: evictions after stores
    assert index.blocks_of("a") == set(h[:2])
    index.publish("a", evicted=h[:2])
    assert index.lookup(h) == {} and index.blocks_of("a") == set()


def test_evicting_what_a_worker_does_not_hold_changes_nothing(index_for: IndexFor) -> None:
    index = index_for("m")
    h = hashes(3)
    index.publish("a", h)
    index.publish("b", evicted=h)
    index.publish("a", evicted=hashes(2, seed=500))
    assert index.lookup(h) == {"a": 3} and index.blocks_of("b") == set()


def test_purge_removes_every_block_of_one_worker_and_counts_them(index_for: IndexFor) -> None:
    index = index_for("m")
    h = hashes(4)
    index.publish("a", h[:2])
    index.publish("b", h)
    assert index.purge("a") == 2
    assert index.lookup(h) == {"b": 4} and index.blocks_of("a") == set()
    assert index.purge("a") == 0 and index.purge("never-published") == 0
    assert index.blocks_of("b") == set(h)


def test_replace_makes_held_the_whole_state(index_for: IndexFor) -> None:
    index = index_for("m")
    h = hashes(4)
    index.publish("b", h)
    index.publish("c", h[:2])
    index.replace("b", h[:1] + h[3:])
    assert index.lookup(h) == {"b": 1, "c": 2} and index.blocks_of("b") == {h[0], h[3]}
    index.replace("b", [])
    assert index.lookup(h) == {"c": 2} and index.blocks_of("b") == set()


def test_blocks_of_lists_exactly_one_workers_blocks(index_for: IndexFor) -> None:
    index = index_for("m")
    a, b = hashes(3), hashes(2, seed=700)
    index.publish("a", a)
    index.publish("b", b + a[:1])
    assert index.blocks_of("a") == set(a)
    assert index.blocks_of("b") == set(b) | {a[0]}
    assert index.blocks_of("nobody") == set()


def test_republishing_is_idempotent(index_for: IndexFor) -> None:
    index = index_for("m")
    h = hashes(3)
    index.publish("a", h)
    index.publish("a", h)
    index.publish("a", h[:2])
    assert index.lookup(h) == {"a": 3} and index.blocks_of("a") == set(h)
    assert index.purge("a") == 3


def test_models_are_namespaced_and_handles_share_one_store(index_for: IndexFor) -> None:
    h = hashes(3)
    index_for("m1").publish("a", h)
    index_for("m2").publish("b", h[:1])
    assert index_for("m1").lookup(h) == {"a": 3}  # a second handle on m1 sees a's blocks
    assert index_for("m2").lookup(h) == {"b": 1}  # and none of them on m2
    assert index_for("m2").purge("a") == 0 and index_for("m1").blocks_of("a") == set(h)
