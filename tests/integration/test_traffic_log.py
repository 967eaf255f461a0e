"""common.traffic against a real redis-server: what routers write, the autoscaler reads
back; capped, and never trusting an entry that does not parse."""

from __future__ import annotations

import time

import pytest
import redis
from redis_helpers import redis_server

from common.traffic import TrafficLog, TrafficRecord


@pytest.fixture(scope="module")
def client():
    with redis_server() as s:
        c = redis.Redis.from_url(s.url)
        yield c
        c.close()


def test_routers_write_and_the_planner_reads_a_window(client):
    client.flushall()
    a, b = TrafficLog(client, "m"), TrafficLog(client, "m")  # two routers, one stream
    now = time.time()
    a.note(TrafficRecord(now - 100, 500, 0, 10))  # older than the window below
    a.note(TrafficRecord(now - 1.5, 128, 64, 96))
    b.note(TrafficRecord(now - 1.0, 1536, 0, 16))
    a.flush(a.take())
    b.flush(b.take())
    assert a.take() == []
    got = TrafficLog(client, "m").recent(now - 10)
    assert [(r.prompt_tokens, r.cached_tokens, r.output_tokens) for r in got] == [
        (128, 64, 96), (1536, 0, 16)]
    assert [r.arrival for r in got] == pytest.approx([now - 1.5, now - 1.0], abs=1e-5)
    assert TrafficLog(client, "other-model").recent(now - 10) == []


def test_malformed_entries_are_skipped_and_the_stream_is_capped(client):
    client.flushall()
    log = TrafficLog(client, "m", maxlen=100)
    client.xadd(log.key, {"a": "nan?", "p": 1, "c": 0, "o": 1})
    client.xadd(log.key, {"a": f"{time.time()}", "p": -5, "c": 0, "o": 1})
    client.xadd(log.key, {"a": f"{time.time()}", "p": 7, "c": 99, "o": 1})  # c > p: capped
    assert log.recent(time.time() - 60) == [TrafficRecord(pytest.approx(time.time(), abs=5),
                                                          7, 7, 1)]
    for i in range(1000):
        log.note(TrafficRecord(time.time(), i, 0, 1))
    log.flush(log.take())
    assert client.xlen(log.key) < 300  # ~maxlen: Redis trims whole nodes
