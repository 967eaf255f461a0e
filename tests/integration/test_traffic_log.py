"""common.traffic and common.served_steps against a real redis-server: what routers and
workers write, the autoscaler reads back; capped, and never trusting an entry that does
not parse."""

from __future__ import annotations

import time

import pytest
import redis
from redis_helpers import redis_server

from common.cost_model import StepSums
from common.served_steps import ServedStep, StepLog
from common.traffic import TrafficLog, TrafficRecord
from workers.step_trace import StepPublisher


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


def test_a_request_in_flight_is_read_by_its_admitted_record_then_its_finished_one(client):
    """A router notes a request when admitted (``done`` False, output: its max_tokens)
    and when finished (the output it had, same key): the reader keeps one record per
    request, the finished one where it exists."""
    client.flushall()
    log = TrafficLog(client, "m")
    now = time.time()
    log.note(TrafficRecord(now - 3, 128, 0, 256, "r-1", done=False))
    log.note(TrafficRecord(now - 2, 1536, 0, 16, "r-2", done=False))
    log.note(TrafficRecord(now - 1, 64, 0, 32))  # a record that stands alone
    log.flush(log.take())
    assert [(r.key, r.output_tokens, r.done) for r in log.recent(now - 10)] == [
        ("r-1", 256, False), ("r-2", 16, False), ("", 32, True)]
    log.note(TrafficRecord(now - 3, 128, 64, 96, "r-1"))
    log.flush(log.take())
    assert [(r.key, r.cached_tokens, r.output_tokens, r.done)
            for r in log.recent(now - 10)] == [("r-1", 64, 96, True), ("r-2", 0, 16, False),
                                               ("", 0, 32, True)]


def test_a_finished_requests_latencies_go_with_it_and_bad_ones_are_dropped(client):
    """The ended record carries the first and last token's latencies (the planner's
    measured goodput); latencies that cannot be (last before first, negative, absurd)
    are read as none, the record kept."""
    client.flushall()
    log = TrafficLog(client, "m")
    now = time.time()
    log.note(TrafficRecord(now - 3, 128, 0, 96, "r-1", ttft_s=0.25, e2e_s=3.5))
    log.note(TrafficRecord(now - 2, 64, 0, 0, "r-2"))  # failed: no latencies
    log.flush(log.take())
    for bad in ({"t": "2", "e": "1"}, {"t": "-1", "e": "1"}, {"t": "0", "e": "1e9"},
                {"t": "x", "e": "1"}):
        client.xadd(log.key, {"a": f"{now - 1:.6f}", "p": 7, "c": 0, "o": 1, **bad})
    got = log.recent(now - 10)
    assert [(r.ttft_s, r.e2e_s) for r in got] == [(0.25, 3.5)] + [(None, None)] * 5
    assert [r.prompt_tokens for r in got] == [128, 64, 7, 7, 7, 7]


def test_a_turns_link_to_the_one_before_goes_with_both_its_records(client):
    """``parent`` (router.lineage: the request whose prompt this one's begins with) is
    read back on the admitted record and the finished one; an entry whose parent is
    longer than a key is not ours."""
    client.flushall()
    log = TrafficLog(client, "m")
    now = time.time()
    log.note(TrafficRecord(now - 3, 192, 0, 64, "r-1", ttft_s=0.3, e2e_s=1.2))
    log.note(TrafficRecord(now - 1.7, 448, 0, 64, "r-2", done=False, parent="r-1"))
    log.flush(log.take())
    assert [(r.key, r.parent, r.done) for r in log.recent(now - 10)] == [
        ("r-1", "", True), ("r-2", "r-1", False)]
    log.note(TrafficRecord(now - 1.7, 448, 192, 64, "r-2", ttft_s=0.2, e2e_s=1.1,
                           parent="r-1"))
    log.flush(log.take())
    client.xadd(log.key, {"a": f"{now - 1:.6f}", "p": 7, "c": 0, "o": 1, "pa": "x" * 65})
    assert [(r.key, r.parent, r.cached_tokens) for r in log.recent(now - 10)] == [
        ("r-1", "", 0), ("r-2", "r-1", 192)]


def test_malformed_entries_are_skipped_and_the_stream_is_capped(client):
    client.flushall()
    log = TrafficLog(client, "m", maxlen=100)
    client.xadd(log.key, {"a": "nan?", "p": 1, "c": 0, "o": 1})
    client.xadd(log.key, {"a": f"{time.time()}", "p": -5, "c": 0, "o": 1})
    client.xadd(log.key, {"a": f"{time.time()}", "p": 7, "c": 0, "o": 1, "d": "maybe"})
    client.xadd(log.key, {"a": f"{time.time()}", "p": 7, "c": 0, "o": 1, "k": "x" * 65})
    client.xadd(log.key, {"a": f"{time.time()}", "p": 7, "c": 99, "o": 1})  # c > p: capped
    assert log.recent(time.time() - 60) == [TrafficRecord(pytest.approx(time.time(), abs=5),
                                                          7, 7, 1)]
    for i in range(1000):
        log.note(TrafficRecord(time.time(), i, 0, 1))
    log.flush(log.take())
    assert client.xlen(log.key) < 300  # ~maxlen: Redis trims whole nodes


def test_workers_publish_served_steps_and_the_planner_reads_a_window(client):
    """common.served_steps (the same stream machinery): each worker's steps with its
    threads and role, one stream per model, a window read back oldest first."""
    client.flushall()
    a, b = StepLog(client, "m"), StepLog(client, "m")
    now = time.time()
    sums = StepSums(9, 8, 2400.0, 0.0, 0.0)
    a.note(ServedStep(now - 100, 0.02, 1, "mixed", sums))  # before the window
    a.note(ServedStep(now - 2.0, 0.031, 1, "decode", sums))
    b.note(ServedStep(now - 1.0, 1.25, 2, "prefill", StepSums(512, 1, 0.0, 131328.0, 0.0)))
    a.flush(a.take())
    b.flush(b.take())
    got = StepLog(client, "m").recent(now - 10)
    assert [(s.threads, s.role, s.sums) for s in got] == [
        (1, "decode", sums), (2, "prefill", StepSums(512, 1, 0.0, 131328.0, 0.0))]
    assert [s.seconds for s in got] == pytest.approx([0.031, 1.25])
    assert StepLog(client, "other-model").recent(now - 10) == []
    assert TrafficLog(client, "m").recent(now - 10) == []  # two streams, never mixed


def test_served_steps_that_do_not_parse_or_cannot_be_are_skipped(client):
    client.flushall()
    log = StepLog(client, "m")
    t = f"{time.time():.6f}"
    good = {"t": t, "s": "0.02", "h": 1, "r": "mixed", "k": 4, "q": 4, "d": "800", "f": "0",
            "x": "0"}
    for bad in ({"s": "nan"}, {"s": "-1"}, {"h": 0}, {"r": "admin"}, {"q": 5},
                {"d": "inf"}, {"k": "x"}, {"t": "0"}):
        client.xadd(log.key, {**good, **bad})
    client.xadd(log.key, good)
    assert [s.sums for s in log.recent(time.time() - 60)] == [StepSums(4, 4, 800.0, 0.0, 0.0)]


def test_a_worker_publishing_steps_to_a_redis_that_is_away_serves_on_and_stops_cleanly():
    """StepPublisher.run (a worker's --publish-steps task): a Redis that does not answer
    loses those steps, never the worker's shutdown, which awaits the task; once a flush
    failed, stopping does not try again (each try waits out redis-py's retries), and
    empty rounds never touch Redis."""
    import asyncio

    from cluster.net import free_port

    class Counted(StepLog):
        tries = 0

        def flush(self, records: list) -> None:
            Counted.tries += 1
            super().flush(records)

    away = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.2)
    publisher = StepPublisher(Counted(away, "m"), 1, lambda: "decode")

    async def serve_then_stop() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(publisher.run(stop, every_s=0.02))
        await asyncio.sleep(0.2)  # empty rounds: no try
        assert Counted.tries == 0
        publisher(time.time(), 0.02, StepSums(1, 1, 300.0, 0.0, 0.0))
        while Counted.tries == 0:
            await asyncio.sleep(0.01)
        publisher(time.time(), 0.02, StepSums(1, 1, 301.0, 0.0, 0.0))  # while it fails
        stop.set()
        await asyncio.wait_for(task, 30)  # returns, raises nothing

    asyncio.run(serve_then_stop())
    assert Counted.tries == 1  # not again at stop: Redis was away
    assert publisher.steps.take() == []  # taken and lost, not piling up
