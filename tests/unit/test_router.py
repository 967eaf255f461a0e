"""The router's request lifecycle against fake in-process workers (tests/fake_workers.py).

Each test runs a real :class:`router.core.Router` over real grpc.aio servers on
127.0.0.1 whose servicers are fake engines (the fake module says why not fake stubs):
no processes, no model, no Redis server, no real tokenizer. Each runs its own event
loop (``asyncio.run``; pytest-asyncio is not a dependency) and ends with the cluster's
leak check: nothing in flight at the router, every worker call closed, every channel
closed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

import grpc
import jinja2
import pytest
import redis
from fake_workers import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MODEL,
    Cluster,
    FakeIndex,
    FakeRegistry,
    FakeTokenizer,
    expected_tokens,
)

from common import hashing
from common.traffic import TrafficRecord
from protos.pdserve.v1 import api_pb2, common_pb2, worker_pb2
from router import edge
from router.auth import Principal, tenant_salt
from router.choice import PromptHashes
from router.config import RouterConfig
from router.errors import RouterError, WorkerFailed
from router.prefix_lookup import PrefixLookup

P = 10  # prompt tokens of the default request
PROMPT = list(range(10, 10 + P))
LENGTH = common_pb2.FINISH_REASON_LENGTH


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def req(prompt: list[int] = PROMPT, max_tokens: int | None = None,
        **kw: object) -> api_pb2.GenerateRequest:
    r = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt), **kw)
    if max_tokens is not None:
        r.sampling.max_tokens = max_tokens
    return r


async def collect(c: Cluster, r: api_pb2.GenerateRequest, timeout: float | None = None
                  ) -> list[api_pb2.GenerateResponse]:
    return [m async for m in c.router.generate(r, timeout)]


async def collect_as(c: Cluster, r: api_pb2.GenerateRequest, caller: Principal | None
                     ) -> list[api_pb2.GenerateResponse]:
    return [m async for m in c.router.generate(r, caller=caller)]


def tokens(msgs: list[api_pb2.GenerateResponse]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def metric(c: Cluster, name: str, **labels: str) -> float:
    value = c.router.metrics.registry.get_sample_value(f"pdserve:{name}",
                                                       {"model": MODEL, **labels})
    return value or 0.0


async def wait_for(cond: Callable[[], bool], timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


def assert_one_stream(msgs: list[api_pb2.GenerateResponse], n: int) -> None:
    """What a client must see: the prompt ids on the first message only, the finish,
    usage and timings on the last only, and the tokens of an unbroken generation."""
    assert tokens(msgs) == expected_tokens(P, n)
    assert list(msgs[0].prompt_token_ids) == PROMPT
    assert not any(m.prompt_token_ids for m in msgs[1:])
    assert not any(m.finish_reason or m.HasField("usage") or m.HasField("timings")
                   for m in msgs[:-1])
    last = msgs[-1]
    assert last.finish_reason == LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (P, n)
    assert 0 < last.timings.ttft_s <= last.timings.e2e_s
    assert len({m.request_id for m in msgs}) == 1


# -- the call protocols ---------------------------------------------------------------------


def test_mixed_request_relays_tokens_with_prompt_ids_first_and_usage_last() -> None:
    async def body() -> None:
        async with Cluster(["mixed"]) as c:
            msgs = await collect(c, req(max_tokens=5))
            assert_one_stream(msgs, 5)
            (w,) = c.workers
            assert msgs[-1].routing.worker == w.address
            assert msgs[-1].routing.policy == "cache_aware"
            assert msgs[-1].routing.migrations == 0
            assert list(w.requests[0].prompt_token_ids) == PROMPT
            assert w.requests[0].request_id.startswith(msgs[0].request_id + "#")
            assert metric(c, "requests_total", status="OK") == 1
            assert metric(c, "generation_tokens_total") == 5
            assert metric(c, "prompt_tokens_total") == P

    run(body)


def test_disaggregated_request_relays_the_first_token_before_decode_streams() -> None:
    async def body() -> None:
        async with Cluster(["prefill", "decode"]) as c:
            prefill, decode = c.workers
            decode.gate = asyncio.Event()  # decode sends nothing until the test says so
            stream = c.router.generate(req(max_tokens=5))
            first = await anext(stream)
            assert list(first.token_ids) == expected_tokens(P, 1)
            assert list(first.prompt_token_ids) == PROMPT
            assert decode.sent == 0
            decode.gate.set()
            msgs = [first] + [m async for m in stream]
            assert_one_stream(msgs, 5)
            assert c.events == [("reserve", decode.address), ("prefill", prefill.address),
                                ("commit", decode.address)]
            assert decode.commits == expected_tokens(P, 1)
            assert prefill.targets[0].address == f"{decode.address}-kv"  # the reservation's
            assert prefill.requests[0].request_id == decode.requests[0].request_id
            last = msgs[-1]
            assert (last.routing.worker, last.routing.decode_worker) == (prefill.address,
                                                                          decode.address)
            assert last.usage.cached_tokens == 4  # the prefill worker's, not the decode's
            assert last.timings.queue_s == pytest.approx(0.001)

    run(body)


def test_local_reservation_skips_prefill() -> None:
    async def body() -> None:
        async with Cluster(["prefill", "decode"]) as c:
            prefill, decode = c.workers
            decode.local = True
            msgs = await collect(c, req(max_tokens=4))
            assert_one_stream(msgs, 4)
            assert prefill.requests == [] and decode.commits == []
            routing = msgs[-1].routing
            assert (routing.reason, routing.worker, routing.decode_worker) == (
                "local", decode.address, decode.address)
            assert c.router.decisions[("cache_aware", "local")] == 1

    run(body)


def test_prompts_overflow_to_the_decode_worker_past_the_prefill_queue_limit() -> None:
    """With two prompts in flight on the only prefill worker (the limit), the third is
    computed on its decode worker; the limit must be >= 0."""
    async def body() -> None:
        async with Cluster(["prefill", "decode"], prefill_queue_limit=2) as c:
            prefill, decode = c.workers
            prefill.token_delay_s = 1.0
            queued = [asyncio.ensure_future(collect(c, req(max_tokens=3), timeout=10))
                      for _ in range(2)]
            await wait_for(lambda: prefill.open_calls == 2)
            third = await collect(c, req(max_tokens=3), timeout=10)
            assert_one_stream(third, 3)
            routing = third[-1].routing
            assert (routing.reason, routing.worker) == ("local_prefill_queue", decode.address)
            assert decode.commits[0] is None  # committed first, with no first token
            for task in queued:
                assert_one_stream(await task, 3)
            assert len(prefill.requests) == 2
            assert metric(c, "prefill_placement_total", where="local",
                          reason="prefill_queue") == 1

    async def lost_one() -> None:
        """A prefill worker that is down takes nothing and does not hold the count at
        zero: with the other at the limit, the prompt overflows at once."""
        async with Cluster(["prefill", "prefill", "decode"], prefill_queue_limit=1) as c:
            lost, busy, decode = c.workers
            c.router.workers.mark_down(c.router_worker(lost), 30.0)
            busy.token_delay_s = 1.0
            queued = asyncio.ensure_future(collect(c, req(max_tokens=3), timeout=10))
            await wait_for(lambda: busy.open_calls == 1)
            second = await collect(c, req(max_tokens=3), timeout=10)
            assert second[-1].routing.reason == "local_prefill_queue"
            assert_one_stream(await queued, 3)
            assert lost.requests == []

    async def held_while_short() -> None:
        """With a prefill worker down (listed or gone from the registry), a prompt its
        decode worker holds but for its last block stays there; one it lacks, or any
        prompt while no prefill worker is down (one that drained is gone but not down) or
        the overflow is off, goes to a prefill worker."""
        whole, lacking = P - BLOCK_SIZE + 1, P - BLOCK_SIZE - 1  # tokens the decode holds
        for limit, down, gone, lost, cached, kept in (
                (1, True, False, False, whole, True),  # down, listed
                (1, False, True, True, whole, True),  # lost: its down mark has lapsed
                (1, True, False, False, lacking, False),
                (1, False, True, False, whole, False),  # drained
                (0, True, False, False, whole, False)):
            async with Cluster(["prefill", "prefill", "decode"],
                               prefill_queue_limit=limit) as c:
                first, peer, decode = c.workers
                if down:
                    c.router.workers.mark_down(c.router_worker(first), 30.0)
                w = c.router_worker(first)
                w.gone, w.lost = gone, lost
                decode.cached_tokens = cached
                msgs = await collect(c, req(max_tokens=3), timeout=10)
                assert_one_stream(msgs, 3)
                assert (msgs[-1].routing.reason == "local_prefill_short") == kept
                assert (len(peer.requests) + len(first.requests) == 0) == kept
                assert decode.commits == [None] if kept else decode.commits[0] is not None
                if kept:
                    assert metric(c, "prefill_placement_total", where="local",
                                  reason="prefill_short") == 1

    run(body)
    run(lost_one)
    run(held_while_short)
    with pytest.raises(ValueError, match="prefill_queue_limit"):
        RouterConfig(workers=("127.0.0.1:1",), model_path=".", model_name="m",
                     prefill_queue_limit=-1)
    with pytest.raises(ValueError, match="kv_offer must be one of layers, step, after"):
        RouterConfig(workers=("127.0.0.1:1",), model_path=".", model_name="m",
                     kv_offer="sometime")


def test_prefill_workers_of_another_kv_format_are_never_paired() -> None:
    """A decode worker would refuse their KV: the router picks a prefill worker with the
    decode worker's model id (model, dtype and KV format), and with none the decode
    worker computes the prompt itself; nothing is sent to the others."""
    async def body() -> None:
        c = Cluster(["prefill", "prefill", "decode"])
        fp8, same, decode = c.workers
        fp8.model_id = f"{decode.model_id}:kv=fp8_e4m3:0000"
        async with c:
            for _ in range(3):
                assert_one_stream(await collect(c, req(max_tokens=3)), 3)
            assert fp8.requests == [] and len(same.requests) == 3
        c = Cluster(["prefill", "decode"])
        fp8, decode = c.workers
        fp8.model_id = f"{decode.model_id}:kv=fp8_e4m3:0000"
        async with c:
            msgs = await collect(c, req(max_tokens=3))
            assert_one_stream(msgs, 3)
            assert fp8.requests == [] and decode.commits == [None]
            assert msgs[-1].routing.reason == "local_kv_mismatch"

    run(body)


def test_request_finished_by_its_first_token_frees_the_reservation() -> None:
    async def body() -> None:
        async with Cluster(["prefill", "decode"]) as c:
            prefill, decode = c.workers
            decode.gate = asyncio.Event()  # holds the reservation until cancelled
            msgs = await collect(c, req(max_tokens=1))
            assert tokens(msgs) == expected_tokens(P, 1) and msgs[-1].finish_reason == LENGTH
            assert msgs[-1].usage.completion_tokens == 1
            await wait_for(lambda: decode.cancelled == 1)  # the reservation was let go
            assert decode.sent == 0

    run(body)


def test_failed_prefill_is_recomputed_on_the_decode_worker() -> None:
    async def body() -> None:
        async with Cluster(["prefill", "decode"]) as c:
            prefill, decode = c.workers
            prefill.fail_prefill = grpc.StatusCode.UNAVAILABLE
            msgs = await collect(c, req(max_tokens=6))
            assert_one_stream(msgs, 6)
            assert decode.commits == [None]  # commit without a first token
            assert msgs[-1].usage.cached_tokens == 0  # the decode worker's own count
            assert msgs[-1].routing.migrations == 0
            assert c.router_worker(prefill).down_until > time.monotonic()
            # Counted as a placement on the decode worker of its own kind (the planner's
            # validation tells these apart from the placement rule's).
            decisions = (await c.router.status()).routing_decisions
            assert sum(n for k, n in decisions.items() if k.endswith("/local_fallback")) == 1

    run(body)


# -- stragglers (router/stall.py) -----------------------------------------------------------

STALL = {"stall_probe_after_s": 0.1, "stall_probe_timeout_s": 0.2}


def test_a_stalled_prefill_worker_is_given_up_and_passed_over() -> None:
    """A prefill worker that stops answering (SIGSTOP) while it holds a prompt: past the
    probe, the call is cancelled and the decode worker computes the prompt; the next
    prompt goes to the other prefill worker, and keeps going there for as long as the
    straggler stays silent (longer than ``down_s``); once it resumes it finds its call
    cancelled and serves again at once (not ``down_s`` later)."""
    async def body() -> None:
        async with Cluster(["prefill", "prefill", "decode"], policy="round_robin",
                           down_s=1.0, **STALL) as c:
            stuck, other, decode = c.workers
            stuck.frozen = asyncio.Event()
            start = time.monotonic()
            # Round robin: two of three to the straggler, one to the other worker.
            first, also, third = await asyncio.gather(
                *(collect(c, req(max_tokens=6), timeout=10) for _ in range(3)))
            assert_one_stream(also, 6)
            assert_one_stream(third, 6)
            assert time.monotonic() - start < 3.0  # the detection, not the stall
            assert_one_stream(first, 6)
            assert first[-1].routing.worker == stuck.address
            assert sorted(decode.commits, key=str) == [expected_tokens(P, 1)[0], None, None]
            assert c.router_worker(stuck).down_until > time.monotonic()
            assert metric(c, "worker_stalls_total", worker=stuck.address) == 1
            second = await collect(c, req(max_tokens=6), timeout=10)
            assert_one_stream(second, 6)
            assert second[-1].routing.worker == other.address  # round robin, but down
            assert decode.commits[-1] == expected_tokens(P, 1)[0]
            await asyncio.sleep(1.5)  # past down_s: still silent, still down
            assert c.router_worker(stuck).down_until > time.monotonic()
            stuck.frozen.set()  # SIGCONT: it finds its call cancelled
            await wait_for(lambda: stuck.cancelled == 2)  # both calls it held
            # Back at its first answer (a probe every 0.1 s), well before down_s.
            await wait_for(lambda: c.router_worker(stuck).down_until == 0, timeout_s=0.8)
            later = [await collect(c, req(max_tokens=2), timeout=10) for _ in range(2)]
            assert {m[-1].routing.worker for m in later} == {stuck.address, other.address}
            assert metric(c, "worker_stalls_total", worker=stuck.address) == 1  # one stall

    run(body)


def test_a_busy_prefill_worker_that_answers_is_waited_for() -> None:
    """A slow prefill (5 probe delays) on a worker that answers its probes is not a
    stall: the call completes there and the decode worker gets its first token."""
    async def body() -> None:
        async with Cluster(["prefill", "decode"], **STALL) as c:
            prefill, decode = c.workers
            prefill.token_delay_s = 0.5
            msgs = await collect(c, req(max_tokens=4), timeout=10)
            assert_one_stream(msgs, 4)
            assert decode.commits == [expected_tokens(P, 1)[0]]
            assert c.router_worker(prefill).down_until == 0
            assert metric(c, "worker_stalls_total", worker=prefill.address) == 0
            assert prefill.cancelled == 0

    run(body)


def test_the_stall_probe_can_be_turned_off() -> None:
    async def body() -> None:
        async with Cluster(["prefill", "decode"], stall_probe_after_s=0.0) as c:
            prefill, decode = c.workers
            prefill.frozen = asyncio.Event()
            task = asyncio.ensure_future(collect(c, req(max_tokens=3), timeout=10))
            await asyncio.sleep(0.5)
            assert not task.done()  # waits for the straggler, as it was asked to
            prefill.frozen.set()
            assert_one_stream(await task, 3)
            assert decode.commits == [expected_tokens(P, 1)[0]]

    run(body)


def test_a_decode_worker_that_stalls_at_its_reservation_is_passed_over() -> None:
    """The reservation is watched too: a decode worker that takes the start and then
    answers nothing is given up after the probe, and the next decode worker serves."""
    async def body() -> None:
        async with Cluster(["prefill", "decode", "decode"], **STALL) as c:
            _, a, b = c.workers
            a.frozen, b.frozen = asyncio.Event(), asyncio.Event()
            first = c.router.workers.by_load("decode")[0]
            stuck, other = (a, b) if first.address == a.address else (b, a)
            other.frozen.set()
            start = time.monotonic()
            msgs = await collect(c, req(max_tokens=4), timeout=10)
            assert time.monotonic() - start < 3.0
            assert_one_stream(msgs, 4)
            assert msgs[-1].routing.decode_worker == other.address
            assert c.router_worker(stuck).down_until > time.monotonic()
            assert metric(c, "worker_stalls_total", worker=stuck.address) == 1
            stuck.frozen.set()
            await wait_for(lambda: stuck.cancelled == 1)

    run(body)


@pytest.mark.parametrize("roles", [["prefill", "decode", "decode"], ["mixed", "mixed"]])
def test_a_worker_that_stalls_mid_stream_hands_its_request_on(roles: list[str]) -> None:
    """The stream itself is watched: a worker that goes silent after two tokens (no
    token, no answer to the probe) loses the request, which migrates with its tokens
    so far after the detection, not after the stall; when it resumes it finds the call
    cancelled."""
    async def body() -> None:
        async with Cluster(roles, **STALL) as c:
            a, b = c.workers[-2:]
            # Decode: reservations go by load; mixed: cache-aware's first tie goes to the
            # first listed. Both pick by_load's first on an idle pool.
            first = c.router.workers.by_load(roles[-1])[0]
            stuck, other = (a, b) if first.address == a.address else (b, a)
            stuck.freeze_after = 2
            start = time.monotonic()
            msgs = await collect(c, req(max_tokens=8), timeout=10)
            assert time.monotonic() - start < 3.0
            assert_one_stream(msgs, 8)
            assert msgs[-1].routing.migrations == 1
            (moved,) = other.requests
            done = len(moved.prompt_token_ids) - len(PROMPT)
            assert moved.sampling.max_tokens == 8 - done and done >= 2
            assert c.router_worker(stuck).down_until > time.monotonic()
            assert metric(c, "worker_stalls_total", worker=stuck.address) == 1
            assert stuck.frozen is not None
            stuck.frozen.set()
            await wait_for(lambda: stuck.cancelled == 1)

    run(body)


def test_stall_probe_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="stall_probe_timeout_s"):
        RouterConfig(workers=("127.0.0.1:1",), model_path=".", model_name="m",
                     stall_probe_timeout_s=0)


# -- reservation retry ----------------------------------------------------------------------


def test_reservation_skips_decode_workers_that_fail_and_uses_the_next() -> None:
    async def body() -> None:
        async with Cluster(["prefill", "decode", "decode", "decode"]) as c:
            _, failing, dead, healthy = c.workers
            failing.fail_reserve = grpc.StatusCode.UNAVAILABLE
            await dead.kill()  # does not answer at all
            msgs = await collect(c, req(max_tokens=3))
            assert_one_stream(msgs, 3)
            assert msgs[-1].routing.decode_worker == healthy.address
            assert msgs[-1].routing.migrations == 0
            now = time.monotonic()
            assert c.router_worker(failing).down_until > now
            assert c.router_worker(dead).down_until > now
            assert c.router_worker(healthy).down_until == 0

    run(body)


def test_no_decode_worker_able_to_reserve_is_unavailable() -> None:
    async def body() -> None:
        async with Cluster(["prefill", "decode", "decode"]) as c:
            prefill, d1, d2 = c.workers
            d1.fail_reserve = d2.fail_reserve = grpc.StatusCode.UNAVAILABLE
            with pytest.raises(RouterError) as e:
                await collect(c, req())
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            assert e.value.message.startswith("no decode worker could take the request")
            assert f"{d1.address}: UNAVAILABLE" in e.value.message
            assert f"{d2.address}: UNAVAILABLE" in e.value.message
            assert prefill.requests == []
            assert metric(c, "requests_total", status="UNAVAILABLE") == 1

    run(body)


# -- migration ------------------------------------------------------------------------------


def test_request_migrates_after_its_worker_dies_mid_stream() -> None:
    async def body() -> None:
        async with Cluster(["mixed", "mixed"]) as c:
            first, second = c.workers
            first.die_after = 3  # the first worker in the pool gets the request
            msgs = await collect(c, req(max_tokens=8))
            assert first.dead and len(first.requests) == 1
            assert_one_stream(msgs, 8)  # one uninterrupted stream
            (moved,) = second.requests
            assert list(moved.prompt_token_ids) == PROMPT + expected_tokens(P, 3)
            assert moved.sampling.max_tokens == 5
            assert moved.request_id != first.requests[0].request_id
            assert msgs[-1].routing.worker == second.address
            assert msgs[-1].routing.migrations == 1
            assert metric(c, "request_migrations_total") == 1
            assert metric(c, "requests_total", status="OK") == 1

    run(body)


def test_disaggregated_request_migrates_after_its_decode_worker_dies() -> None:
    async def body() -> None:
        async with Cluster(["prefill", "decode", "decode"]) as c:
            prefill, d1, d2 = c.workers
            d1.die_after = 2  # after the prefill's first token and 2 of its own
            msgs = await collect(c, req(max_tokens=8))
            assert d1.dead
            assert_one_stream(msgs, 8)
            (moved,) = d2.requests
            assert list(moved.prompt_token_ids) == PROMPT + expected_tokens(P, 3)
            assert moved.sampling.max_tokens == 5
            assert len(prefill.requests) == 2  # the moved request is prefilled again
            assert msgs[-1].routing.decode_worker == d2.address
            assert msgs[-1].routing.migrations == 1

    run(body)


def test_request_past_the_migration_limit_fails_with_unavailable() -> None:
    async def body() -> None:
        async with Cluster(["mixed", "mixed"], migration_limit=1) as c:
            for w in c.workers:
                w.fail_after = (1, grpc.StatusCode.UNAVAILABLE)
            seen: list[api_pb2.GenerateResponse] = []
            with pytest.raises(WorkerFailed) as e:
                async for m in c.router.generate(req(max_tokens=8)):
                    seen.append(m)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            assert "failed: UNAVAILABLE" in e.value.message
            assert tokens(seen) == expected_tokens(P, 2)  # one from each worker
            assert metric(c, "request_migrations_total") == 1
            assert metric(c, "requests_total", status="UNAVAILABLE") == 1

    run(body)


# -- deadlines, cancellation, admission -----------------------------------------------------


def test_passed_deadline_is_deadline_exceeded() -> None:
    async def body() -> None:
        async with Cluster(["prefill", "decode"]) as c:
            with pytest.raises(RouterError) as e:
                await collect(c, req(), timeout=0)
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert c.events == []
            assert metric(c, "requests_total", status="DEADLINE_EXCEEDED") == 1

    run(body)


@pytest.mark.parametrize("roles", [["mixed"], ["prefill", "decode"]], ids=["mixed", "disagg"])
def test_deadline_passing_mid_stream_is_deadline_exceeded(roles: list[str]) -> None:
    async def body() -> None:
        async with Cluster(roles) as c:
            c.workers[-1].token_delay_s = 0.02
            with pytest.raises(RouterError) as e:
                await collect(c, req(max_tokens=8), timeout=0.06)
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert type(e.value) is RouterError  # the caller's deadline: no migration
            assert metric(c, "request_migrations_total") == 0

    run(body)


@pytest.mark.parametrize("roles", [["mixed"], ["prefill", "decode"]], ids=["mixed", "disagg"])
def test_closing_the_stream_cancels_the_worker_call(roles: list[str]) -> None:
    async def body() -> None:
        async with Cluster(roles) as c:
            worker = c.workers[-1]
            worker.endless, worker.token_delay_s = True, 0.001
            stream = c.router.generate(req())
            for _ in range(3):
                await anext(stream)
            assert c.router.in_flight == 1
            await stream.aclose()
            assert c.router.in_flight == 0
            await wait_for(lambda: worker.cancelled == 1)
            assert metric(c, "requests_total", status="CANCELLED") == 1

    run(body)


class Notes:
    """The traffic log's writer side, in memory (the router only calls ``note``)."""

    def __init__(self) -> None:
        self.records: list[TrafficRecord] = []

    def note(self, record: TrafficRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("roles", [["mixed"], ["prefill", "decode"]], ids=["mixed", "disagg"])
def test_the_traffic_log_times_a_request_whose_client_stops_at_the_finish(
        roles: list[str]) -> None:
    """A client that closes its stream on the last message (no read past the finish)
    was served: its ended record has latencies, as the planner's served share needs,
    and so has one whose only message was its first token and its last (the log's
    reader refuses a TTFT past the E2E). One closed mid-stream was not."""
    async def body() -> None:
        async with Cluster(roles) as c:
            c.router.traffic = notes = Notes()  # type: ignore[assignment]
            stream = c.router.generate(req(max_tokens=4))
            async for msg in stream:
                if msg.finish_reason:
                    break
            await stream.aclose()
            await collect(c, req(max_tokens=1))  # one message: first token, last, finish
            c.workers[-1].endless = True
            cut = c.router.generate(req())
            await anext(cut)
            await cut.aclose()
            await wait_for(lambda: c.router.in_flight == 0)
            served, single, cancelled = [r for r in notes.records if r.done]
            assert served.output_tokens == 4 and 0 < served.ttft_s < served.e2e_s
            assert single.output_tokens == 1 and 0 < single.ttft_s == single.e2e_s
            assert cancelled.output_tokens >= 1
            assert (cancelled.ttft_s, cancelled.e2e_s) == (None, None)
            assert metric(c, "requests_total", status="OK") == 2
            assert metric(c, "requests_total", status="CANCELLED") == 1

    run(body)


def test_a_turn_that_continues_an_earlier_prompt_is_logged_with_its_key() -> None:
    """router.lineage in the router: a prompt that begins with an earlier one's (a chat's
    next turn) carries that request's key on both its records, as the planner needs to
    send it after that one ends; an unrelated prompt carries none."""
    async def body() -> None:
        async with Cluster(["mixed"]) as c:
            c.router.traffic = notes = Notes()  # type: ignore[assignment]
            first = list(range(100, 124))  # a block of 16 and some (max_model_len 64)
            await collect(c, req(first, max_tokens=2))
            await collect(c, req(first + list(range(300, 324)), max_tokens=2))
            await collect(c, req(list(range(500, 540)), max_tokens=2))
            a1, a2, b1, b2, c1, c2 = notes.records
            assert (a1.parent, a2.parent) == ("", "")
            assert b1.parent == b2.parent == a1.key != b1.key
            assert c1.parent == c2.parent == ""

    run(body)


def test_a_traffic_note_that_fails_fails_its_request_alone() -> None:
    """Noting a request for the planner (its lineage hashes the prompt) runs inside the
    request's own error handling: a failure there is INTERNAL for that request, the
    in-flight count comes back, and the next request is served."""
    async def body() -> None:
        async with Cluster(["mixed"]) as c:
            c.router.traffic = Notes()  # type: ignore[assignment]

            def explode(*args: object, **kw: object) -> str:
                raise ValueError("cannot hash block")

            real, c.router.lineage.link = c.router.lineage.link, explode  # type: ignore[method-assign]
            with pytest.raises(ValueError):
                await collect(c, req(max_tokens=2))
            assert c.router.in_flight == 0
            assert metric(c, "requests_total", status="INTERNAL") == 1
            c.router.lineage.link = real  # type: ignore[method-assign]
            assert_one_stream(await collect(c, req(max_tokens=2)), 2)

    run(body)


def test_a_worker_that_fails_after_the_finish_fails_no_request() -> None:
    """Every token and the finish came; the worker's stream then fails: the request
    was served (no migration, no error, counted OK, its latencies logged)."""
    async def body() -> None:
        async with Cluster(["mixed"]) as c:
            c.router.traffic = notes = Notes()  # type: ignore[assignment]
            c.workers[0].fail_at_end = grpc.StatusCode.UNAVAILABLE
            msgs = await collect(c, req(max_tokens=3))
            assert tokens(msgs) == expected_tokens(P, 3) and msgs[-1].finish_reason
            assert metric(c, "requests_total", status="OK") == 1
            assert metric(c, "request_migrations_total") == 0
            (ended,) = [r for r in notes.records if r.done]
            assert 0 < ended.ttft_s < ended.e2e_s

    run(body)


def test_requests_beyond_max_in_flight_are_resource_exhausted() -> None:
    async def body() -> None:
        async with Cluster(["mixed"], max_in_flight=1) as c:
            (w,) = c.workers
            w.endless, w.token_delay_s = True, 0.001
            running = c.router.generate(req())
            await anext(running)
            with pytest.raises(RouterError) as e:
                await collect(c, req())
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_in_flight=1" in e.value.message
            assert len(w.requests) == 1
            await running.aclose()
            w.endless = False
            assert_one_stream(await collect(c, req(max_tokens=2)), 2)  # admitted again
            assert metric(c, "requests_total", status="RESOURCE_EXHAUSTED") == 1

    run(body)


# -- validation -----------------------------------------------------------------------------


def _messages(*pairs: tuple[str, str]) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(messages=api_pb2.ChatMessages(
        messages=[api_pb2.ChatMessage(role=r, content=t) for r, t in pairs]))


@pytest.mark.parametrize("request_, code, field, words", [
    (api_pb2.GenerateRequest(), "INVALID_ARGUMENT", "prompt", "set one of"),
    (_messages(), "INVALID_ARGUMENT", "messages", "at least one message"),
    (_messages(("user", "hi"), ("robot", "beep")), "INVALID_ARGUMENT", "messages", "'robot'"),
    (req(list(range(10, 10 + MAX_MODEL_LEN))), "INVALID_ARGUMENT", "prompt",
     f"max_model_len {MAX_MODEL_LEN}"),
    (req([5, 99999]), "INVALID_ARGUMENT", "prompt_token_ids", "99999"),
    (req(max_tokens=0), "INVALID_ARGUMENT", "max_tokens", "got 0"),
    (req(model="other-model"), "NOT_FOUND", "model", "'other-model'"),
], ids=["no-prompt", "no-messages", "bad-role", "too-long", "out-of-vocab", "max-tokens-0",
        "other-model"])
def test_invalid_request_is_refused_naming_the_field(request_: api_pb2.GenerateRequest,
                                                     code: str, field: str,
                                                     words: str) -> None:
    async def body() -> None:
        async with Cluster(["mixed"]) as c:
            with pytest.raises(RouterError) as e:
                await collect(c, request_)
            assert (e.value.code.name, e.value.field) == (code, field)
            assert words in e.value.message
            assert c.events == []
            assert metric(c, "requests_total", status=code) == 1

    run(body)


def test_text_and_chat_prompts_are_tokenized_by_the_given_tokenizer() -> None:
    async def body() -> None:
        async with Cluster(["mixed"]) as c:
            (w,) = c.workers
            text = await collect(c, api_pb2.GenerateRequest(text="hey"))
            assert list(text[0].prompt_token_ids) == [ord(ch) for ch in "hey"]
            chat = await collect(c, _messages(("user", "hi")))
            assert list(chat[0].prompt_token_ids) == [1, *map(ord, "user:hi"), 2, 1]
            assert [list(r.prompt_token_ids) for r in w.requests] == [
                list(text[0].prompt_token_ids), list(chat[0].prompt_token_ids)]

    run(body)


def test_tokenizing_and_chat_templating_run_off_the_event_loop() -> None:
    async def body() -> None:
        async with Cluster(["mixed"]) as c:
            await collect(c, api_pb2.GenerateRequest(text="hey"))
            await collect(c, _messages(("user", "hi")))
            tokenize = api_pb2.TokenizeRequest(text="abc")
            assert await c.router.tokenize(tokenize) == [ord(ch) for ch in "abc"]
            assert c.tokenizer.threads and threading.get_ident() not in c.tokenizer.threads

    run(body)


def _text(n: int) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(text="x" * n)


@pytest.mark.parametrize("request_, field, words", [
    (_text(edge.MAX_PROMPT_BYTES + 1), "prompt", f"limit of {edge.MAX_PROMPT_BYTES} bytes"),
    (api_pb2.GenerateRequest(text="\u00e9" * (edge.MAX_PROMPT_BYTES // 2 + 1)), "prompt",
     "bytes of UTF-8"),
    (_messages(*[("user", "a")] * (edge.MAX_CHAT_MESSAGES + 1)), "messages",
     f"limit of {edge.MAX_CHAT_MESSAGES}"),
    (_messages(("user", "y" * edge.MAX_CHAT_BYTES), ("user", "z")), "messages",
     f"limit of {edge.MAX_CHAT_BYTES} bytes"),
    (req(request_id="r" * (edge.MAX_CLIENT_REQUEST_ID_CHARS + 1)), "request_id", "limit"),
    (req(request_id="two\nlines"), "request_id", "printable"),
], ids=["text-bytes", "text-utf8-bytes", "message-count", "chat-bytes", "long-id", "id-newline"])
def test_prompt_bounds_are_checked_before_tokenizing(request_: api_pb2.GenerateRequest,
                                                    field: str, words: str) -> None:
    async def body() -> None:
        async with Cluster(["mixed"]) as c:
            with pytest.raises(RouterError) as e:
                await collect(c, request_)
            assert (e.value.code, e.value.field) == (grpc.StatusCode.INVALID_ARGUMENT, field)
            assert words in e.value.message
            assert not c.tokenizer.threads  # refused before the tokenizer saw it

    run(body)


def test_a_chat_template_that_raises_refuses_the_messages() -> None:
    class Strict(FakeTokenizer):
        def apply_chat_template(self, messages: list[dict], **kw: object) -> list[int]:
            raise jinja2.TemplateError("Conversation roles must alternate user/assistant")

    async def body() -> None:
        async with Cluster(["mixed"], tokenizer=Strict()) as c:
            with pytest.raises(RouterError) as e:
                await collect(c, _messages(("user", "a"), ("user", "b")))
            assert (e.value.code, e.value.field) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                     "messages")
            assert "roles must alternate" in e.value.message

    run(body)


# -- tenants --------------------------------------------------------------------------------

ACME = Principal("acme", key_id="a")
GLOBEX = Principal("globex", key_id="g")
ADMIN = Principal("ops", admin=True, key_id="o")


def test_each_tenant_runs_in_its_own_cache_namespace() -> None:
    async def body() -> None:
        async with Cluster(["mixed"]) as c:
            (w,) = c.workers
            for caller in (ACME, GLOBEX, ACME, None):
                await collect_as(c, req(max_tokens=1), caller)
            await collect_as(c, req(max_tokens=1, cache_salt="s"), ACME)
            await collect_as(c, req(max_tokens=1, cache_salt="s"), None)
            salts = [r.cache_salt for r in w.requests]
            assert salts == [tenant_salt("acme", None), tenant_salt("globex", None),
                             tenant_salt("acme", None), "", tenant_salt("acme", "s"), "s"]
            assert len(set(salts)) == 5  # acme twice alike; nothing else shared

    run(body)


def test_a_tenant_cannot_see_another_tenants_cached_prefix() -> None:
    """The cache-aware choice looks the prompt up under the caller's salt: blocks cached
    for one tenant are never found (indexed cached tokens 0) for another."""

    async def body() -> None:
        async with Cluster(["mixed", "mixed"]) as c:
            a, _ = c.workers
            prompt = list(range(10, 26))
            await collect_as(c, req(prompt, max_tokens=1), ACME)
            first = a.address if a.requests else c.workers[1].address
            owner = Principal("acme", admin=True)
            again = await collect_as(c, req(prompt, max_tokens=1), owner)
            assert again[-1].routing.indexed_cached_tokens == 16  # what acme routed
            assert again[-1].routing.worker == first
            other = Principal("globex", admin=True)
            theirs = await collect_as(c, req(prompt, max_tokens=1), other)
            assert theirs[-1].routing.indexed_cached_tokens == 0
            assert theirs[-1].routing.reason != "cache"

    run(body)


def test_routing_details_reach_admin_callers_only() -> None:
    async def body() -> None:
        async with Cluster(["prefill", "decode"]) as c:
            for caller, shown in ((ACME, False), (ADMIN, True), (None, True)):
                last = (await collect_as(c, req(max_tokens=3), caller))[-1]
                assert last.routing.policy == "cache_aware" and last.routing.reason
                assert bool(last.routing.worker) == shown
                assert bool(last.routing.decode_worker) == shown
                assert bool(last.routing.estimated_prefill_tokens) == shown
                assert last.usage.completion_tokens == 3

    run(body)


def test_tenant_concurrency_limit_is_resource_exhausted_with_retry_after() -> None:
    async def body() -> None:
        async with Cluster(["mixed"], tenant_max_concurrency=1) as c:
            (w,) = c.workers
            w.endless, w.token_delay_s = True, 0.001
            running = c.router.generate(req(), caller=ACME)
            await anext(running)
            with pytest.raises(RouterError) as e:
                await collect_as(c, api_pb2.GenerateRequest(text="abc"), ACME)
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.value.retry_after_s == 1 and "acme" in e.value.message
            assert not c.tokenizer.threads  # refused before any work on it
            with pytest.raises(RouterError) as e:
                await c.router.tokenize_as(api_pb2.TokenizeRequest(text="abc"), ACME)
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert await c.router.tokenize_as(api_pb2.TokenizeRequest(text="ab"), GLOBEX) == [
                ord("a"), ord("b")]
            other = c.router.generate(req(), caller=GLOBEX)  # another tenant still runs
            await anext(other)
            await other.aclose()
            await running.aclose()
            w.endless = False
            assert_one_stream(await collect_as(c, req(max_tokens=2), ACME), 2)
            assert c.router.limiter.in_flight("acme") == 0

    run(body)


def test_tenant_tokens_per_minute_reserve_prompt_plus_max_tokens_and_settle_to_usage() -> None:
    async def body() -> None:
        async with Cluster(["mixed"], tenant_tokens_per_minute=100) as c:
            limiter = c.router.limiter
            await collect_as(c, req(max_tokens=5), ACME)  # reserves 10 + 5, uses 15
            assert 85 <= limiter.available_tokens("acme") < 86
            # reserves 10 + 40 (the context's room caps max_tokens at 64 - 10 = 54)
            await collect_as(c, req(max_tokens=40), ACME)
            assert 35 <= limiter.available_tokens("acme") < 36
            with pytest.raises(RouterError) as e:
                await collect_as(c, req(max_tokens=50), ACME)  # reserves 60, 35 left
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.value.retry_after_s == 15  # 25 tokens at 100/60 per second
            assert limiter.available_tokens("globex") == 100

    run(body)


# -- the worker pool ------------------------------------------------------------------------


def test_worker_appearing_in_the_registry_joins_the_pool() -> None:
    async def body() -> None:
        async with Cluster(["mixed"], registry=FakeRegistry(),
                           discovery_interval_s=0.005) as c:
            (static,) = c.workers
            joiner = await c.add_worker("mixed")
            c.registry.add(joiner.address, "mixed", free_blocks=7)
            await wait_for(lambda: len(c.router.pool("mixed")) == 2)
            joined = c.router_worker(joiner)
            assert not joined.static
            # It joined while the router served: its cache is cold for down_s (the
            # pool counts as short of it: the overflow's held prompts); the first was
            # there from the start.
            assert c.router.workers.short("mixed", lambda w: w is joined)
            assert not c.router.workers.short("mixed", lambda w: w.address == static.address)
            # Its heartbeat's load is read on the round after it joined.
            await wait_for(lambda: joined.free_blocks == 7)
            assert metric(c, "workers", role="mixed") == 2
            c.router_worker(static).down_until = time.monotonic() + 60
            msgs = await collect(c, req(max_tokens=2))
            assert msgs[-1].routing.worker == joiner.address

    run(body)


def test_worker_whose_heartbeat_expired_retires_and_returns_with_it() -> None:
    async def body() -> None:
        async with Cluster(["mixed"], registry_roles=["mixed"],
                           discovery_interval_s=0.005) as c:
            (static,), (listed,) = c.workers, c.registry_workers
            assert len(c.router.pool("mixed")) == 2
            c.registry.expire(listed.address)
            await wait_for(lambda: c.router_worker(listed).gone)
            assert [w.address for w in c.router.pool("mixed")] == [static.address]
            assert metric(c, "workers", role="mixed") == 1
            c.router_worker(static).down_until = time.monotonic() + 60  # still chosen
            msgs = await collect(c, req(max_tokens=2))
            assert msgs[-1].routing.worker == static.address
            assert listed.requests == []
            c.registry.add(listed.address, "mixed")
            await wait_for(lambda: not c.router_worker(listed).gone)
            assert metric(c, "workers", role="mixed") == 2
            # It left while up (drained): gone, not lost. Gone while down: lost, and
            # the pool is short of it until it is back.
            w = c.router_worker(listed)
            assert not w.lost and not c.router.workers.short("mixed", lambda x: x is w)
            w.down_until = time.monotonic() + 0.05  # a short down mark
            c.registry.expire(listed.address)
            await wait_for(lambda: w.gone)
            assert w.lost
            await asyncio.sleep(0.06)  # its down mark lapses; lost stays
            assert c.router.workers.short("mixed", lambda x: x is w)
            c.registry.add(listed.address, "mixed")
            await wait_for(lambda: not w.gone)
            assert not w.lost
            assert c.router.workers.short("mixed", lambda x: x is w)  # back, cold: down_s
            w.warm_until = 0.0
            assert not c.router.workers.short("mixed", lambda x: x is w)

    run(body)


def test_a_gone_worker_retires_once_a_replacement_of_its_role_joins() -> None:
    """A restarted Ray actor comes back on a new port: the dead entry leaves the pool and
    ``pdserve status`` (no ghost rows); a static worker would stay."""
    async def body() -> None:
        async with Cluster(["mixed"], registry_roles=["mixed", "decode"],
                           discovery_interval_s=0.005) as c:
            (static,), (listed, other) = c.workers, c.registry_workers
            c.registry.expire(listed.address)
            await wait_for(lambda: c.router_worker(listed).gone)
            await asyncio.sleep(0.05)  # gone, not replaced: it stays (it may come back)
            assert listed.address in [w.address for w in c.router.workers.workers]
            newcomer = await c.add_worker("decode")  # another role replaces nothing
            c.registry.add(newcomer.address, "decode")
            await wait_for(lambda: len(c.router.pool("decode")) == 2)
            await asyncio.sleep(0.05)
            assert listed.address in [w.address for w in c.router.workers.workers]
            replacement = await c.add_worker("mixed")
            c.registry.add(replacement.address, "mixed")
            await wait_for(lambda: listed.address not in
                           [w.address for w in c.router.workers.workers])
            status = await c.router.status()
            assert sorted(w.address for w in status.workers) == sorted(
                [static.address, other.address, newcomer.address, replacement.address])

    run(body)


def test_a_registry_that_comes_back_empty_keeps_the_workers_while_they_register() -> None:
    """Redis restarted or flushed: every entry vanishes. The router keeps serving on the
    workers (they register again within a heartbeat) instead of refusing every request;
    a worker still missing after ``reset_grace_s`` is gone; a worker that merely expires
    (Redis intact) is gone at once."""
    async def body() -> None:
        async with Cluster([], registry_roles=["mixed", "mixed"], discovery_interval_s=0.005,
                           reset_grace_s=0.3, redis_url="redis://unused.invalid") as c:
            a, b = c.registry_workers
            saved = list(c.registry.entries)
            c.registry.flush()
            await asyncio.sleep(0.1)  # many discovery rounds
            assert len(c.router.pool("mixed")) == 2
            assert_one_stream(await collect(c, req(max_tokens=2)), 2)
            c.registry.entries = saved[:1]  # a registered again; b never does
            await wait_for(lambda: c.router_worker(b).gone)
            assert not c.router_worker(a).gone
            c.registry.expire(a.address)  # Redis intact: an expiry is a departure
            await wait_for(lambda: c.router_worker(a).gone)

    run(body)


def test_router_with_only_a_registry_serves_disaggregated() -> None:
    async def body() -> None:
        async with Cluster([], registry_roles=["prefill", "decode"], index=FakeIndex(),
                           redis_url="redis://unused.invalid") as c:
            assert c.router.disaggregated
            assert c.router.max_model_len == MAX_MODEL_LEN
            assert_one_stream(await collect(c, req(max_tokens=3)), 3)

    run(body)


def test_status_reports_workers_decisions_and_prefix_index_health() -> None:
    async def body() -> None:
        registry = FakeRegistry()
        async with Cluster(["mixed", "mixed"], registry=registry, index=FakeIndex(),
                           discovery_interval_s=0.005) as c:
            await collect(c, req(max_tokens=2))
            await c.workers[1].kill()
            status = await c.router.status()
            assert [(w.address, w.serving, w.role) for w in status.workers] == [
                (c.workers[0].address, True, "mixed"), (c.workers[1].address, False, "")]
            assert status.prefix_index_up
            assert sum(status.routing_decisions.values()) == 1
            assert (status.requests_in_flight, status.max_requests_in_flight) == (0, 256)
            registry.error = redis.ConnectionError("redis is down")
            await wait_for(lambda: not c.router.prefixes.up)
            assert not (await c.router.status()).prefix_index_up

    run(body)


# -- the cache-aware choice and its prefix lookup -------------------------------------------


def test_cache_aware_choice_follows_the_index_and_what_this_router_routed() -> None:
    async def body() -> None:
        index = FakeIndex()
        async with Cluster(["mixed", "mixed"], index=index) as c:
            a, b = c.workers
            prompt = list(range(10, 26))  # 4 blocks of 4
            index.counts = {b.address: 3}
            msgs = await collect(c, req(prompt, max_tokens=1))
            routing = msgs[-1].routing
            assert (routing.worker, routing.reason) == (b.address, "cache")
            assert routing.indexed_cached_tokens == 12
            index.counts = {}  # not published yet: this router remembers where it went
            msgs = await collect(c, req(prompt, max_tokens=1))
            assert msgs[-1].routing.worker == b.address
            assert msgs[-1].routing.indexed_cached_tokens == 16

    run(body)


def test_a_request_is_hashed_once_and_a_migration_hashes_only_its_new_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[int] = []  # tokens handed to block_hashes, per call
    real = hashing.block_hashes
    monkeypatch.setattr(hashing, "block_hashes",
                        lambda tokens, *a, **k: hashed.append(len(tokens)) or real(tokens, *a, **k))
    prompt = list(range(10, 30))
    wreq = worker_pb2.WorkerGenerateRequest(prompt_token_ids=prompt, cache_salt="t")
    hashes = PromptHashes()
    assert hashes.of(wreq, 4, "m") == real(prompt, 4, "m", "t") and hashed == [20]
    assert hashes.of(wreq, 4, "m") == real(prompt, 4, "m", "t") and hashed == [20]  # a retry
    wreq.prompt_token_ids.extend([7] * 9)  # migrated after 9 tokens: 2 more full blocks
    assert hashes.of(wreq, 4, "m") == real(prompt + [7] * 9, 4, "m", "t")
    assert hashed == [20, 8]
    assert hashes.of(wreq, 8, "m") == real(prompt + [7] * 9, 8, "m", "t")  # another pool
    assert hashed == [20, 8, 24]


def test_prefix_lookup_merges_by_max_and_backs_off_while_redis_is_down() -> None:
    async def body() -> None:
        index = FakeIndex({"a": 2, "b": 1})
        now = [100.0]
        lookup = PrefixLookup(index, retry_s=1.0, clock=lambda: now[0])
        lookup.note_routed([1, 2, 3], "b")
        now[0] = 100.5
        assert await lookup.lookup([1, 2, 3]) == {"a": 2, "b": 3}
        assert lookup.up
        index.error = redis.ConnectionError("down")
        now[0] = 101.0
        assert await lookup.lookup([1, 2, 3]) == {"b": 3}  # routed only
        assert not lookup.up and index.calls == 2
        now[0] = 101.5
        assert await lookup.lookup([1, 2, 3]) == {"b": 3}
        assert index.calls == 2  # within retry_s: Redis is not asked
        index.error = None
        now[0] = 102.1
        assert await lookup.lookup([1, 2, 3]) == {"a": 2, "b": 3}
        assert lookup.up and index.calls == 3
        now[0] = 100.0 + 30.0  # the routed entry expires after ROUTED_TTL_S
        assert await lookup.lookup([1, 2, 3]) == {"a": 2, "b": 1}

    run(body)


def test_a_slow_shared_index_costs_a_lookup_its_budget_then_is_skipped_a_while() -> None:
    """Redis slowed, not down: a lookup past the budget answers from the routed memory,
    and Redis is not asked again for ``retry_s``; then it is, and it answers again."""
    async def body() -> None:
        index = FakeIndex({"a": 2}, delay_s=0.3)
        now = [100.0]
        lookup = PrefixLookup(index, retry_s=1.0, budget_s=0.05, clock=lambda: now[0])
        lookup.note_routed([1, 2, 3], "b")
        start = time.monotonic()
        assert await lookup.lookup([1, 2, 3]) == {"b": 3}  # routed memory only
        assert time.monotonic() - start < 0.25 and index.calls == 1
        assert await lookup.lookup([1, 2, 3]) == {"b": 3}
        assert index.calls == 1  # skipped within retry_s
        index.delay_s = 0.0
        now[0] = 101.1
        assert await lookup.lookup([1, 2, 3]) == {"a": 2, "b": 3}
        assert index.calls == 2

    run(body)


def _by_choice(msgs: list[api_pb2.GenerateResponse], n: int) -> list[list[int]]:
    tokens: list[list[int]] = [[] for _ in range(n)]
    for m in msgs:
        tokens[m.index].extend(m.token_ids)
    return tokens


@pytest.mark.parametrize("roles", [["mixed", "mixed"], ["prefill", "decode", "decode"]])
def test_choices_run_as_one_attempt_and_move_one_by_one_after_a_failure(roles) -> None:
    """n = 3 is one worker request (one Prefill, one commit with every first token);
    when its worker dies mid-stream, each unfinished choice moves on its own, with its
    own tokens continuing the prompt, and every choice still ends once, complete."""
    async def body() -> None:
        async with Cluster(roles) as c:
            target = c.workers[-2]  # the mixed or decode worker the pool picks first
            target.die_after = 2
            msgs = await collect(c, req(max_tokens=6, n=3))
            assert target.dead
            assert _by_choice(msgs, 3) == [expected_tokens(P, 6)] * 3
            ends = [m.index for m in msgs if m.finish_reason]
            assert sorted(ends) == [0, 1, 2]
            assert all(m.usage.completion_tokens == 6 for m in msgs if m.finish_reason)
            (first,) = [r for r in target.requests]
            assert first.n == 3
            moved = c.workers[-1].requests
            assert [r.n for r in moved] == [0, 0, 0]  # one request per choice
            k = 3 if "prefill" in roles else 2  # the prefill worker's first token too
            assert all(list(r.prompt_token_ids) == PROMPT + expected_tokens(P, k)
                       for r in moved)
            assert msgs[-1].routing.migrations == 1  # one failure, whatever it moved
            if "prefill" in roles:
                assert c.workers[-2].commits == [expected_tokens(P, 1)[0]]

    run(body)
