"""Cache-aware routing end to end: real Redis (started by the cluster like `pdserve up`),
real workers publishing their blocks, a router reading the shared index."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis
from cluster_helpers import assert_cluster_idle, start

from cluster.local import free_port
from cluster.redis_server import RedisServer, find_redis_server
from common.hashing import block_hashes
from common.prefix_index import RedisPrefixIndex
from common.redis_url import connect, password_of, without_password
from protos.pdserve.v1 import worker_pb2
from router.client import AsyncClient, Client

pytestmark = pytest.mark.skipif(find_redis_server() is None,
                                reason="no redis-server (make test installs one)")

GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
SHARED = list(range(100, 160))  # 15 blocks of 4


def misses(cluster, n: int) -> list[object]:  # noqa: ANN001
    """n sequential completions sharing SHARED, after a first one."""
    with Client(cluster.target) as client:
        client.generate(SHARED + [7], **GREEDY)
        time.sleep(0.3)  # the holder's publisher writes its blocks
        return [client.generate(SHARED + [8, i], **GREEDY) for i in range(n)]


@pytest.fixture(scope="module")
def cache_aware_pair(tiny_checkpoints, tmp_path_factory):
    """2 mixed workers behind a cache-aware router (the default policy), shared by the
    tests that need nothing else."""
    c = start(tiny_checkpoints["llama"], tmp_path_factory.mktemp("cache-aware-logs"),
              mixed=2, block_size=4, policy="cache_aware")
    yield c
    c.stop()


@pytest.mark.parametrize(("policy", "expect_all_hits"), [("cache_aware", True),
                                                          ("round_robin", False)])
def test_shared_prefix_lands_on_the_worker_that_holds_it(policy, expect_all_hits, request,
                                                         tiny_checkpoints, tmp_path) -> None:
    if policy == "cache_aware":
        c = request.getfixturevalue("cache_aware_pair")
        logs = Path(c.config.log_dir)
    else:
        c = start(tiny_checkpoints["llama"], tmp_path, mixed=2, block_size=4, policy=policy)
        logs = tmp_path
    try:
        _check_redis_password_is_needed_and_never_shown(c, logs)
        served = misses(c, 6)
        cached = [s.usage["cached_tokens"] for s in served]
        assert all(s.routing["policy"] == policy for s in served)
        if expect_all_hits:
            assert all(t >= len(SHARED) - 4 for t in cached), cached
            assert all(s.routing["reason"] == "cache" and s.routing["indexed_cached_tokens"]
                       >= len(SHARED) - 4 for s in served), [s.routing for s in served]
            assert len({s.routing["worker"] for s in served}) == 1
            with Client(c.target) as client:
                status = client.status()
            assert status.prefix_index_up and status.routing_decisions["cache_aware/cache"] >= 6
        else:
            assert cached[0] == 0  # the other worker had never seen the prefix
        assert_cluster_idle(c)
    finally:
        if policy != "cache_aware":
            c.stop()


def test_redis_outage_keeps_serving_and_the_index_refills(tiny_checkpoints, tmp_path) -> None:
    c = start(tiny_checkpoints["llama"], tmp_path, prefill=2, decode=1, block_size=4,
              local_prefill_threshold=0)
    try:
        assert c.redis_url is not None
        redis_proc = c.procs[c.names.index("redis")]
        port = int(c.redis_url.rsplit(":", 1)[1].split("/")[0])

        async def load() -> list[object]:
            async with AsyncClient(c.target) as client:
                return await asyncio.gather(*(client.generate(SHARED + [i], **GREEDY)
                                              for i in range(12)), return_exceptions=True)

        async def scenario() -> list[object]:
            task = asyncio.ensure_future(load())
            await asyncio.sleep(0.2)
            redis_proc.kill()  # mid-load
            return await task

        served = asyncio.run(scenario())
        assert not [s for s in served if isinstance(s, BaseException)], served
        with Client(c.target) as client:  # still serving with Redis down
            client.generate(SHARED + [99], **GREEDY)
        # Redis comes back empty on the same port (and password): workers re-register
        # and republish.
        back = RedisServer(port=port, password=password_of(c.redis_url))
        try:
            client_r = connect(c.redis_url)
            index = RedisPrefixIndex(client_r, "llama")
            hashes = block_hashes(SHARED, 4, _model_id(c), None)
            deadline = time.monotonic() + 20
            while not _lookup(index, hashes):
                assert time.monotonic() < deadline, "the index did not refill"
                time.sleep(0.2)
            assert max(index.lookup(hashes).values()) == len(hashes)
            client_r.close()
            assert_cluster_idle(c)
        finally:
            back.stop()
    finally:
        c.stop()


def _check_redis_password_is_needed_and_never_shown(c, logs) -> None:  # noqa: ANN001
    """The cluster's Redis wants the password it generated; no process's command line
    and no log shows it (children get it in their environment)."""
    password = password_of(c.redis_url)
    assert password and password not in str(c.redis_url)
    bare = connect(without_password(c.redis_url))
    with pytest.raises(redis.AuthenticationError):
        bare.ping()
    bare.close()
    for p in c.procs:
        assert password.encode() not in Path(f"/proc/{p.pid}/cmdline").read_bytes()
    for log in Path(logs).glob("*.log"):
        assert password not in log.read_text(errors="replace"), log


def _lookup(index: RedisPrefixIndex, hashes: list[int]) -> dict[str, int]:
    try:
        return index.lookup(hashes)
    except redis.ConnectionError:  # the restarted server is not listening yet
        return {}


def _model_id(cluster) -> str:  # noqa: ANN001
    import grpc

    from protos.pdserve.v1 import worker_pb2_grpc

    with grpc.insecure_channel(cluster.worker_addresses[0]) as ch:
        return worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(),
                                                      timeout=5).model_id


def test_two_router_processes_make_the_same_choice(cache_aware_pair, tiny_checkpoints,
                                                  tmp_path) -> None:
    """A second router, started with only the registry (no --worker), discovers the
    workers and, reading the same index, sends a prefix to the same worker."""
    c = cache_aware_pair
    port = free_port()
    log = open(tmp_path / "router2.log", "wb")  # noqa: SIM115
    second = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "router", "--model",
         str(tiny_checkpoints["llama"]), "--port", str(port), "--http-port", "0",
         "--redis-url", c.redis_url], stdout=log, stderr=log)
    try:
        with Client(c.target) as one:
            one.generate(SHARED + [7], **GREEDY)
        time.sleep(0.3)
        deadline = time.monotonic() + 60
        with Client(f"127.0.0.1:{port}") as two:
            while True:
                try:
                    if len(two.status(timeout=2).workers) == 2:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, "the second router found no workers"
                time.sleep(0.2)
            b = two.generate(SHARED + [9], **GREEDY)
        with Client(c.target) as one:
            a = one.generate(SHARED + [10], **GREEDY)
        assert a.routing["worker"] == b.routing["worker"] and b.routing["reason"] == "cache"
        assert_cluster_idle(c)
    finally:
        second.terminate()
        second.wait(10)
        log.close()
