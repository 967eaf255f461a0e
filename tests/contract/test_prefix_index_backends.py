"""What only some prefix indexes do: the memory backend's expiry and bound, and the
wrappers a router stacks (layered reads, a Redis that goes away, metrics)."""

from __future__ import annotations

import sys
import threading

import pytest
import redis
from redis_helpers import RedisProcess

from cluster.net import free_port
from common.hashing import block_hashes
from common.metrics import Metrics
from common.prefix_index import (
    FailSoftIndex,
    InstrumentedIndex,
    LayeredIndex,
    MemoryPrefixIndex,
    RedisPrefixIndex,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def hashes(n: int, seed: int = 0) -> list[int]:
    return block_hashes(list(range(seed, seed + 16 * n)), 16, "m", None)


def sample(metrics: Metrics, name: str, backend: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(f"pdserve:prefix_index_{name}",
                                             {"model": "m", "backend": backend, **labels})


# -- memory: expiry and bound ------------------------------------------------------------


def test_memory_entries_expire_per_worker_and_block() -> None:
    clock = Clock()
    index = MemoryPrefixIndex(ttl_s=10, clock=clock)
    h = hashes(3)
    index.publish("a", h)
    clock.now = 5
    index.publish("b", h[:2])
    index.publish("a", h[:1])  # refreshes a's block 0 only
    clock.now = 9.99
    assert index.lookup(h) == {"a": 3, "b": 2}
    clock.now = 10  # a's blocks 1 and 2 expire at 10 exactly
    assert index.lookup(h) == {"a": 1, "b": 2}
    assert index.blocks_of("a") == {h[0]}
    clock.now = 15
    assert index.lookup(h) == {} and index.blocks_of("b") == set()
    assert index.purge("a") == 0  # expired entries are not counted as held


def test_memory_lookup_ends_each_run_at_its_first_expired_block() -> None:
    """lookup walks blocks while several workers are in the running and scans the last
    one's run alone: an entry expiring mid-run ends the run in both phases, whoever
    else still holds that block."""
    clock = Clock()
    index = MemoryPrefixIndex(ttl_s=10, clock=clock)
    h = hashes(40)
    alone = hashes(20, seed=999)  # d alone holds it
    for w in ("a", "b", "c"):
        index.publish(w, h)
    index.publish("d", alone)
    clock.now = 5
    index.publish("a", h)  # a's whole run is fresher
    index.publish("b", h[:6] + h[7:])  # b's block 6 keeps the old expiry
    index.publish("c", h[:30] + h[31:])  # c's block 30 too
    index.publish("d", alone[:13] + alone[14:])  # d's block 13 too
    assert index.lookup(h) == {"a": 40, "b": 40, "c": 40}
    clock.now = 12  # b, c and d keep only the blocks refreshed at 5
    assert index.lookup(h) == {"a": 40, "b": 6, "c": 30}
    assert index.lookup(h[7:]) == {"a": 33, "b": 33, "c": 23}
    assert index.lookup(alone) == {"d": 13}
    clock.now = 15
    assert index.lookup(h) == {}


def test_memory_bound_drops_expired_entries_first() -> None:
    clock = Clock()
    index = MemoryPrefixIndex(ttl_s=10, max_blocks=4, clock=clock)
    old, new = hashes(3), hashes(2, seed=900)
    index.publish("a", old)
    clock.now = 11
    index.publish("b", new)  # 5 blocks > 4: the expired three go
    assert len(index) == 2 and index.lookup(new) == {"b": 2}
    assert index.blocks_of("a") == set() and index.purge("a") == 0


def test_memory_bound_then_drops_the_oldest_blocks() -> None:
    index = MemoryPrefixIndex(max_blocks=4)
    h = hashes(5)
    index.publish("a", h[:2])
    index.publish("b", h[:1])  # a block published again keeps its place
    index.publish("a", h[2:])  # 5 blocks: block 0, first inserted, goes, with both holders
    assert len(index) == 4
    assert index.lookup(h) == {} and index.lookup(h[1:]) == {"a": 4}
    assert index.blocks_of("a") == set(h[1:]) and index.blocks_of("b") == set()


def test_memory_replace_is_atomic_to_a_concurrent_lookup() -> None:
    index = MemoryPrefixIndex()
    h = hashes(8)
    index.publish("a", h)
    seen: set[int] = set()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            seen.add(index.lookup(h).get("a", 0))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, inside replace too
    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(2000):
            index.replace("a", h if i % 2 else h[:4])
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert seen <= {4, 8}  # never a purged-but-not-yet-published state


def test_memory_config_is_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        MemoryPrefixIndex(ttl_s=0)
    with pytest.raises(ValueError, match="max_blocks"):
        MemoryPrefixIndex(max_blocks=0)
    with pytest.raises(ValueError, match="retry_after_s"):
        FailSoftIndex(MemoryPrefixIndex(), retry_after_s=-1)


# -- layered -----------------------------------------------------------------------------


def test_layered_reads_the_max_per_worker_and_writes_its_primary() -> None:
    routed, shared = MemoryPrefixIndex(), MemoryPrefixIndex()
    index = LayeredIndex(routed, shared)
    h = hashes(4)
    shared.publish("a", h[:2])
    shared.publish("b", h[:1])
    index.publish("b", h)  # "routed here": only the primary learns it
    assert index.lookup(h) == {"a": 2, "b": 4}
    assert shared.blocks_of("b") == {h[0]} and index.blocks_of("b") == set(h)
    routed.publish("c", h[:1])
    shared.publish("c", h[1:2])
    assert index.lookup(h)["c"] == 1  # each member's own leading run, never spliced
    assert index.purge("b") == 4 and index.lookup(h) == {"a": 2, "b": 1, "c": 1}
    index.replace("a", [])
    assert index.lookup(h)["a"] == 2  # the shared member's entry is not the router's to drop


# -- fail-soft Redis, as a router stacks it ----------------------------------------------


def test_failsoft_routes_from_memory_while_redis_is_down_then_recovers() -> None:
    clock, changes, metrics = Clock(), [], Metrics({"model": "m"})
    server = RedisProcess()
    port = server.port
    client = redis.Redis.from_url(server.url, socket_timeout=2, socket_connect_timeout=2)
    try:
        shared = RedisPrefixIndex(client, "m")
        remote = FailSoftIndex(InstrumentedIndex(shared, metrics, backend="redis"),
                               on_change=changes.append, retry_after_s=1.0, clock=clock)
        routed = MemoryPrefixIndex(ttl_s=30, clock=clock)
        index = LayeredIndex(routed, remote)
        h = hashes(3)
        shared.publish("a", h)
        index.publish("b", h[:1])
        assert index.lookup(h) == {"a": 3, "b": 1} and remote.up and changes == []

        server.stop()
        assert remote.lookup(h) == {} and index.lookup(h) == {"b": 1}
        assert not remote.up and len(changes) == 1
        assert isinstance(changes[0], redis.ConnectionError)
        assert sample(metrics, "lookups_total", "redis") == 2  # the second was skipped
        with pytest.raises(redis.RedisError):
            remote.publish("a", h)  # writes are not softened: their writer must know
        clock.now = 1.0
        assert remote.lookup(h) == {} and len(changes) == 1  # tried again, still down
        assert sample(metrics, "lookups_total", "redis") == 3

        server = RedisProcess(port)  # back, empty
        shared.publish("a", h[:2])
        clock.now = 1.5
        assert index.lookup(h) == {"b": 1}  # not asked again before retry_after_s
        clock.now = 2.0
        assert index.lookup(h) == {"a": 2, "b": 1}
        assert remote.up and len(changes) == 2 and changes[1] is None
        assert sample(metrics, "errors_total", "redis", op="lookup") == 2
    finally:
        client.close()
        server.stop()


def test_failsoft_lets_other_errors_through() -> None:
    class Broken(MemoryPrefixIndex):
        def lookup(self, block_hashes):  # noqa: ANN001, ANN202
            raise KeyError("a bug, not an outage")

    with pytest.raises(KeyError):
        FailSoftIndex(Broken()).lookup([1])


# -- instrumented ------------------------------------------------------------------------


def test_instrumented_counts_lookups_blocks_matches_and_latency() -> None:
    m = Metrics({"model": "m"})
    index = InstrumentedIndex(MemoryPrefixIndex(), m, backend="memory")
    assert sample(m, "lookups_total", "memory") == 0  # the series exist from the start
    h = hashes(4)
    index.publish("a", h[:2])
    index.publish("b", h[:3])
    assert index.lookup(h) == {"a": 2, "b": 3}
    assert index.lookup([]) == {}
    assert index.lookup(hashes(2, seed=500)) == {}
    assert sample(m, "lookups_total", "memory") == 3
    assert sample(m, "lookup_blocks_total", "memory") == 6
    assert sample(m, "matched_blocks_total", "memory") == 3  # the best worker's: b
    assert sample(m, "lookup_seconds_count", "memory") == 3
    assert sample(m, "errors_total", "memory", op="lookup") == 0
    assert index.blocks_of("b") == set(h[:3]) and index.purge("a") == 2


def test_instrumented_counts_errors_by_op_and_reraises() -> None:
    m = Metrics({"model": "m"})
    # nobody serves there; from_url, as the router connects (no retries with back-off)
    client = redis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1)
    index = InstrumentedIndex(RedisPrefixIndex(client, "m"), m, backend="redis")
    try:
        with pytest.raises(redis.ConnectionError):
            index.lookup(hashes(2))
        with pytest.raises(redis.ConnectionError):
            index.purge("a")
    finally:
        client.close()
    assert sample(m, "errors_total", "redis", op="lookup") == 1
    assert sample(m, "errors_total", "redis", op="purge") == 1
    assert sample(m, "lookup_seconds_count", "redis") == 1  # failed lookups' time too
    assert sample(m, "matched_blocks_total", "redis") == 0


def test_routed_memory_remembers_leading_blocks_until_they_expire() -> None:
    """The router's record of where it routed (was router.policies.RoutedPrefixes)."""
    now = [0.0]
    r = MemoryPrefixIndex(ttl_s=10, max_blocks=5, clock=lambda: now[0])
    r.publish("a", [1, 2, 3])
    now[0] = 5
    r.publish("b", [1, 9])
    now[0] = 6
    assert r.lookup([1, 2, 3, 4]) == {"a": 3, "b": 1}
    assert r.lookup([1, 9]) == {"a": 1, "b": 2}
    now[0] = 12
    assert r.lookup([1, 9]) == {"b": 2}  # a's entries expired
    now[0] = 13
    r.publish("c", [20, 21, 22])  # over max_blocks: expired entries are dropped
    assert r.lookup([1, 2]) == {"b": 1}
