"""A real engine's block events reach the Redis index, and survive a Redis outage."""

from __future__ import annotations

import redis
from conftest import assert_no_leaks
from redis_helpers import RedisProcess, redis_server

from common.hashing import block_hashes
from common.prefix_index import RedisPrefixIndex
from workers.engine.llm import LLM
from workers.engine.params import SamplingParams
from workers.kv_publisher import KVEventPublisher

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def cached(llm: LLM) -> set[int]:
    return set(llm.engine.scheduler.block_manager._cached)


def test_index_mirrors_the_engine_through_evictions_and_an_outage(tiny_checkpoints) -> None:
    with redis_server() as server:
        client = redis.Redis.from_url(server.url, socket_timeout=2)
        index = RedisPrefixIndex(client, "llama")
        publisher = KVEventPublisher(index, "w1", retry_s=0.05)
        # 12 blocks of 4 tokens: later prompts evict earlier ones.
        llm = LLM(tiny_checkpoints["llama"], dtype="float32", num_blocks=12, block_size=4,
                  kv_listeners=[publisher])
        try:
            llm.generate([list(range(10, 30))], GREEDY)
            assert publisher.flush(10)
            assert index.blocks_of("w1") == cached(llm) != set()
            hashes = block_hashes(list(range(10, 30)), 4, llm.engine.model_id, None)
            assert index.lookup(hashes) == {"w1": len(hashes)}

            port = server.port
            server.stop()  # Redis goes away; the engine keeps serving and evicting
            llm.generate([list(range(100, 130)), list(range(200, 220))], GREEDY)
            assert not publisher.flush(0.3)
            restarted = RedisProcess(port)  # back, empty: the publisher refills it
            try:
                assert publisher.flush(10)
                assert index.blocks_of("w1") == cached(llm)
            finally:
                restarted.stop()
            assert_no_leaks(llm.engine)
        finally:
            publisher.close()
            client.close()
