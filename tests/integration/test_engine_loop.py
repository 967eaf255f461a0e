"""The engine thread behind the servers: ids, aborts and delivery; and the decode side's
reservations (:meth:`EngineLoop.reserve`) carried out on it."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import TypeVar

import pytest
from conftest import assert_no_leaks, engine_idle
from conftest import on_engine as on_engine_within

from common.request import Request
from workers.engine.llm_engine import LLMEngine
from workers.engine.params import EngineConfig, SamplingParams
from workers.engine_loop import EngineLoop
from workers.reservation import PREFILL_FAILED, Reservation
from workers.step_trace import read_step_trace
from workers.transfer import TransferHandle
from workers.transfer import TransferState as T
from workers.transfer.state import StateCounters

R = TypeVar("R")


def test_closing_a_finished_stream_never_aborts_a_newer_request_with_its_id(
    tiny_checkpoints,
) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32",
                                    num_blocks=64))
    loop = EngineLoop(engine)
    ids = engine.tokenize("same id twice")

    async def run() -> int:
        first = loop.generate(Request("dup", ids, SamplingParams(max_tokens=2, ignore_eos=True)))
        async for out in first:
            if out.finished:
                break  # the stream is not closed yet
        second = loop.generate(Request("dup", ids, SamplingParams(max_tokens=6, ignore_eos=True)))
        got = [await second.__anext__()]
        await first.aclose()  # must not reach the second request
        got += [o async for o in second]
        return len(got[-1].token_ids)

    try:
        assert asyncio.run(asyncio.wait_for(run(), timeout=30)) == 6
        assert_no_leaks(engine)
    finally:
        loop.close()


def test_a_step_trace_records_every_step_that_ran_work(tiny_checkpoints, tmp_path) -> None:
    """``step_trace``: one line per step with its time and sums; over two requests the
    traced tokens are every prompt token and every sampled token fed back, the
    sequences every sampled row."""
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32",
                                    num_blocks=64))
    path = str(tmp_path / "w" / "mixed-1.steps.csv")
    heard: list = []  # the step listener (--publish-steps) hears what the trace holds
    loop = EngineLoop(engine, step_trace=path,
                      step_listener=lambda *step: heard.append(step))
    prompts = [engine.tokenize("a trace of steps"), engine.tokenize("and another one here")]

    async def one(i: int, tag: str = "") -> None:
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        async for _ in loop.generate(Request(f"t{i}{tag}", prompts[i], params)):
            pass

    async def run() -> float:
        await asyncio.gather(one(0), one(1))
        await asyncio.sleep(0.3)  # the loop idles ...
        resumed = time.time()
        await one(0, "again")  # ... then works again
        return resumed

    started = time.time()
    try:
        resumed = asyncio.run(asyncio.wait_for(run(), timeout=30))
        assert_no_leaks(engine)
    finally:
        loop.close()
    steps = read_step_trace(path)
    assert steps and all(started <= s.start_unix_s <= time.time() and s.seconds > 0
                         for s in steps)
    busy = [s for s in steps if s.start_unix_s < resumed]
    assert sum(s.sums.tokens for s in busy) == sum(len(p) + 5 - 1 for p in prompts)
    assert sum(s.sums.seqs for s in busy) == 2 * 5
    # While the loop never waits, each step's time starts where the previous one ended.
    for a, b in zip(busy, busy[1:], strict=False):
        assert abs(a.start_unix_s + a.seconds - b.start_unix_s) < 0.01, (a, b)
    # After the idle wait, the next step's time starts with it, not 0.3 s before.
    after = next(s for s in steps if s.start_unix_s >= resumed)
    assert after.start_unix_s - (busy[-1].start_unix_s + busy[-1].seconds) > 0.25
    assert after.seconds < 0.25
    assert sum(s.sums.fresh_pairs for s in busy) == sum(len(p) * (len(p) + 1) / 2
                                                        for p in prompts)
    assert [(round(a, 6), round(b, 6), c) for a, b, c in heard] == [
        (round(s.start_unix_s, 6), round(s.seconds, 6), s.sums) for s in steps]


def test_a_step_listener_that_raises_is_turned_off_and_the_requests_finish(
        tiny_checkpoints) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32",
                                    num_blocks=64))
    calls: list = []

    def broken(*step) -> None:  # noqa: ANN002
        calls.append(step)
        raise RuntimeError("the listener's bug")

    loop = EngineLoop(engine, step_listener=broken)
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def run() -> list:
        return [out async for out in loop.generate(Request("r", engine.tokenize("hello"),
                                                           params))]

    try:
        outs = asyncio.run(asyncio.wait_for(run(), timeout=30))
        assert sum(len(o.new_token_ids) for o in outs) == 4
        assert len(calls) == 1  # heard once, then off
        assert engine.trace_sums is False  # no sums computed for nobody
        assert_no_leaks(engine)
    finally:
        loop.close()


def test_cancelled_consumer_frees_blocks(tiny_checkpoints) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32",
                                    num_blocks=64))
    loop = EngineLoop(engine)

    async def run() -> None:
        stream = loop.generate(Request("c", engine.tokenize("go"),
                                       SamplingParams(max_tokens=300, ignore_eos=True)))
        await stream.__anext__()
        await stream.aclose()
        for _ in range(200):
            if loop.load().free_blocks == loop.load().total_blocks and not loop.load().running:
                return
            await asyncio.sleep(0.01)

    try:
        asyncio.run(run())
        assert_no_leaks(engine)
    finally:
        loop.close()


def test_outputs_a_slow_consumer_missed_arrive_coalesced_and_complete(tiny_checkpoints) -> None:
    """A consumer that blocks its event loop for a while gets the steps it missed as one
    output: every token, the text whole, fewer messages than tokens."""
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32",
                                    num_blocks=64))
    loop = EngineLoop(engine)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    ids = engine.tokenize("coalesce me")

    async def run() -> list:
        outs = []
        async for out in loop.generate(Request("slow", ids, params)):
            outs.append(out)
            if len(outs) == 1:
                time.sleep(0.3)  # blocks the event loop: the engine thread runs ahead
        return outs

    try:
        outs = asyncio.run(asyncio.wait_for(run(), timeout=30))
        final = outs[-1]
        assert final.finished and len(final.token_ids) == 24
        assert [t for o in outs for t in o.new_token_ids] == final.token_ids
        assert "".join(o.delta_text for o in outs) == final.text
        assert len(outs) < 24
        assert_no_leaks(engine)
    finally:
        loop.close()


def test_coalesced_outputs_keep_prompt_logprobs_and_never_mix_choices(tiny_checkpoints) -> None:
    """A consumer that misses the first steps of a request of two choices with prompt
    log-probabilities still gets them once, whole, and each choice's tokens complete."""
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32",
                                    num_blocks=64))
    loop = EngineLoop(engine)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=3)
    ids = engine.tokenize("coalesce these prompt tokens please")

    async def run() -> list:
        stream = loop.generate(Request("slow", ids, params, n=2, prompt_logprobs=1))
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # the request is posted; its reader waits for an output
        time.sleep(0.3)  # blocks the event loop: the engine thread runs ahead
        outs = [await first]
        async for out in stream:
            outs.append(out)
        return outs

    try:
        outs = asyncio.run(asyncio.wait_for(run(), timeout=30))
        scored = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
        assert len(scored) == 1 and len(scored[0]) == len(ids) - 1
        for index in (0, 1):
            mine = [o for o in outs if o.index == index]
            assert [t for o in mine for t in o.new_token_ids] == mine[-1].token_ids
            assert len(mine[-1].token_ids) == 12 and mine[-1].finished
        assert outs[-1].done and len(outs) < 2 * 12
        assert_no_leaks(engine)
    finally:
        loop.close()


# -- the decode side: EngineLoop.reserve, driven by fake transfer handles ----------------
#
# No KV moves: the loop's ``kv_expect`` hands out bare TransferHandles and the test plays
# the channel (advances them, lingers on them), so each test pins one path of
# workers.reservation as the loop carries it out. Waits poll with generous bounds; order
# between the engine thread and the test comes from ``on_engine`` (the engine thread
# runs commands in the order they were posted), never from a sleep.

FIVE = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
WAIT_S = 10.0  # bound on every poll: far above what anything here takes
Handles = dict[str, tuple[TransferHandle, list[int]]]


def start(tiny: dict, num_blocks: int = 64, commit_wait_s: float = 10.0
          ) -> tuple[LLMEngine, EngineLoop, Handles]:
    """A decode engine loop (blocks of 4 tokens) whose KV receiver is the test:
    ``handles[rid]`` is the handle and the target blocks of each placed reservation."""
    engine = LLMEngine(EngineConfig(model=str(tiny["llama"]), dtype="float32",
                                    num_blocks=num_blocks, block_size=4))
    handles: Handles = {}

    def expect(rid: str, block_ids: list[int]) -> TransferHandle:
        handle = TransferHandle(rid, StateCounters(), frozenset({T.PENDING, T.RECEIVING}))
        handles[rid] = (handle, block_ids)
        return handle

    return engine, EngineLoop(engine, expect, "decode:1", commit_wait_s), handles


def prompt(engine: LLMEngine, n: int, text: str = "a prompt of some length") -> list[int]:
    """Exactly ``n`` token ids."""
    ids = engine.tokenize(text)
    return (ids * n)[:n]


async def until(check: Callable[[], bool | Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        ok = check()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        assert time.monotonic() < deadline, f"still waiting after {WAIT_S}s: {what}"
        await asyncio.sleep(0.01)


async def on_engine(loop: EngineLoop, fn: Callable[[], R]) -> R:
    """``fn()`` on the engine thread, after every command posted before this call."""
    return await on_engine_within(loop, fn, WAIT_S)  # type: ignore[no-any-return]


async def idle(loop: EngineLoop) -> None:
    await engine_idle(loop, WAIT_S)


async def greedy(loop: EngineLoop, ids: list[int]) -> list[int]:
    """This engine's own output for ``ids``, salted so it shares no cached block."""
    outs = [o async for o in loop.generate(Request("reference", ids, FIVE, "reference"))]
    return outs[-1].token_ids


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "failed"])
@pytest.mark.parametrize("commit_first", [True, False], ids=["commit-first", "transfer-first"])
def test_transfer_end_and_commit_settle_in_either_order(tiny_checkpoints, commit_first: bool,
                                                        landed: bool) -> None:
    """Neither event alone settles. Landed KV plus the first token decodes from that KV
    (no prefill step); a failed transfer recomputes the prompt after the prefill
    worker's first token, so the greedy output is the engine's own."""
    engine, loop, handles = start(tiny_checkpoints)
    ids = prompt(engine, 21)

    async def run() -> tuple[list[int], list[int], list[tuple[int, int]]]:
        want = await greedy(loop, ids)
        await on_engine(loop, lambda: setattr(engine, "step_shapes", []))
        commit, stream = loop.reserve(Request("r", ids, FIVE))
        r = await anext(stream)
        assert isinstance(r, Reservation) and not r.local, r
        handle, targets = handles["r"]
        assert (r.kv_address, r.cached_tokens, r.skip_blocks) == ("decode:1", 0, 0)
        assert r.block_ids == tuple(targets) and len(targets) == 6  # 21 tokens, blocks of 4
        # Published after the answer went out: poll.
        await until(lambda: loop.load().reserved == 1, "the reservation counted in load()")

        def end_transfer() -> None:
            handle.advance(T.RECEIVING)
            handle.advance(T.DONE if landed else T.FAILED, "test: the KV did not land")

        events = [lambda: commit(want[0]), end_transfer]
        events[0 if commit_first else 1]()
        load = await on_engine(loop, engine.load)  # that event applied, alone
        assert (load.running, load.waiting, load.reserved) == (0, 0, 1), load
        events[1 if commit_first else 0]()
        outs = [o async for o in stream]
        await idle(loop)
        assert outs[-1].finished
        return want, outs[-1].token_ids, list(engine.step_shapes or [])

    try:
        want, got, shapes = asyncio.run(asyncio.wait_for(run(), 30))
        assert len(got) == 5 and got[0] == want[0]
        if landed:
            assert shapes == [(1, 1)] * 4, f"decoding from the landed KV ran {shapes}"
        else:
            assert got == want
            assert shapes[0][0] == len(ids) + 1, f"expected prompt + token recomputed: {shapes}"
        assert handles["r"][0].state is (T.DONE if landed else T.FAILED)
        assert_no_leaks(engine)
    finally:
        loop.close()


def test_abort_mid_transfer_frees_blocks_only_once_the_transfer_quiesces(
    tiny_checkpoints,
) -> None:
    """The consumer goes away while the KV is landing: the receive is cancelled, the
    request ends, and its blocks stay out of the pool while a posted receive may still
    write into them (the handle lingers); they come back once it resolves."""
    engine, loop, handles = start(tiny_checkpoints)

    async def run() -> None:
        _, stream = loop.reserve(Request("r", prompt(engine, 21), FIVE))
        await anext(stream)
        handle = handles["r"][0]
        handle.advance(T.RECEIVING)
        settle = handle.linger()  # a posted receive that has not resolved
        await stream.aclose()
        await until(lambda: handle.state is T.CANCELLED, "the abort cancels the receive")
        await until(lambda: on_engine(loop, lambda: not engine.has_unfinished_requests()),
                    "the request ends once its transfer did")
        load = await on_engine(loop, engine.load)
        assert load.reserved == 1 and load.free_blocks == load.total_blocks - 6, (
            f"the 6 blocks must stay quarantined until the transfer quiesces: {load}")
        settle()
        await idle(loop)

    try:
        asyncio.run(asyncio.wait_for(run(), 30))
        assert_no_leaks(engine)
    finally:
        loop.close()


def test_commit_with_no_offer_gives_up_after_the_commit_wait_and_recomputes(
    tiny_checkpoints,
) -> None:
    """The prefill worker sampled the first token, then its KV offer never came: after
    ``commit_wait_s`` the still-PENDING transfer is cancelled and the prompt computed
    here, after that token."""
    engine, loop, handles = start(tiny_checkpoints, commit_wait_s=0.2)
    ids = prompt(engine, 21)

    async def run() -> tuple[list[int], list[int], float]:
        want = await greedy(loop, ids)
        commit, stream = loop.reserve(Request("r", ids, FIVE))
        await anext(stream)
        t0 = time.monotonic()
        commit(want[0])
        outs = [o async for o in stream]
        waited = time.monotonic() - t0
        await idle(loop)
        return want, outs[-1].token_ids, waited

    try:
        want, got, waited = asyncio.run(asyncio.wait_for(run(), 30))
        result = handles["r"][0].result()
        assert result.state is T.CANCELLED and "no KV offer" in (result.reason or ""), result
        assert waited >= 0.2, f"gave up after {waited:.3f}s, before the commit wait"
        assert got == want
        assert_no_leaks(engine)
    finally:
        loop.close()


def test_reserve_under_the_local_threshold_prefills_here(tiny_checkpoints) -> None:
    """Fewer uncached prompt tokens than ``local_threshold``: no transfer is expected and
    the request runs here like any other; at the threshold it is placed for a transfer."""
    engine, loop, handles = start(tiny_checkpoints)
    ids = prompt(engine, 21)

    async def run() -> tuple[list[int], list[int]]:
        want = await greedy(loop, ids)
        _, at = loop.reserve(Request("at", ids, FIVE), local_threshold=len(ids))
        assert not (await anext(at)).local
        await at.aclose()  # abort while PENDING: cancelled, freed
        _, under = loop.reserve(Request("under", ids, FIVE), local_threshold=len(ids) + 1)
        r = await anext(under)
        assert r == Reservation(local=True, cached_tokens=0), r
        outs = [o async for o in under]
        await idle(loop)
        return want, outs[-1].token_ids

    try:
        want, got = asyncio.run(asyncio.wait_for(run(), 30))
        assert got == want
        assert set(handles) == {"at"} and handles["at"][0].state is T.CANCELLED
        assert_no_leaks(engine)
    finally:
        loop.close()


def test_reserve_waits_for_room_in_the_pool_then_runs(tiny_checkpoints) -> None:
    """8 blocks, two prompts of 5 blocks: the second reserve waits (counted as reserved,
    holding nothing) until the first finishes, then gets its answer and runs."""
    engine, loop, handles = start(tiny_checkpoints, num_blocks=8)
    a_ids, b_ids = prompt(engine, 20), prompt(engine, 20, "something else entirely")
    assert a_ids != b_ids

    async def run() -> tuple[list[int], list[int], Reservation]:
        commit_a, a = loop.reserve(Request("a", a_ids, FIVE))
        assert not (await anext(a)).local
        _, b = loop.reserve(Request("b", b_ids, FIVE), local_threshold=1000)
        b_answer = asyncio.ensure_future(anext(b))
        await until(lambda: loop.load().reserved == 2, "b queued behind a")
        load = loop.load()
        assert load.free_blocks == 3 and not b_answer.done(), (load, b_answer)
        handle = handles["a"][0]
        handle.advance(T.RECEIVING)
        handle.advance(T.DONE)
        commit_a(3)
        a_outs = [o async for o in a]
        rb = await b_answer
        b_outs = [o async for o in b]
        await idle(loop)
        return a_outs[-1].token_ids, b_outs[-1].token_ids, rb

    try:
        a_got, b_got, rb = asyncio.run(asyncio.wait_for(run(), 30))
        assert rb.local and len(a_got) == len(b_got) == 5
        assert set(handles) == {"a"}
        assert_no_leaks(engine)
    finally:
        loop.close()


def test_abort_while_queued_takes_nothing(tiny_checkpoints) -> None:
    """A reserve cancelled while waiting for room leaves the queue holding nothing and is
    never placed; the one ahead of it, committed with no first token (the prefill
    failed), cancels its transfer and computes everything here."""
    # A commit wait no test run reaches: only the commit of None may end the transfer.
    engine, loop, handles = start(tiny_checkpoints, num_blocks=8, commit_wait_s=600.0)
    a_ids, b_ids = prompt(engine, 20), prompt(engine, 20, "something else entirely")

    async def run() -> tuple[list[int], list[int]]:
        want = await greedy(loop, a_ids)
        commit_a, a = loop.reserve(Request("a", a_ids, FIVE))
        await anext(a)
        _, b = loop.reserve(Request("b", b_ids, FIVE))
        b_answer = asyncio.ensure_future(anext(b))
        await until(lambda: loop.load().reserved == 2, "b queued behind a")
        b_answer.cancel()
        with suppress(asyncio.CancelledError):
            await b_answer
        await b.aclose()
        await until(lambda: loop.load().reserved == 1, "the aborted reserve left the queue")
        commit_a(None)
        outs = [o async for o in a]
        await idle(loop)
        return want, outs[-1].token_ids

    try:
        want, got = asyncio.run(asyncio.wait_for(run(), 30))
        assert got == want
        assert set(handles) == {"a"}, "the aborted reserve was placed after all"
        result = handles["a"][0].result()
        assert result.state is T.CANCELLED and result.reason == PREFILL_FAILED, result
        assert_no_leaks(engine)
    finally:
        loop.close()
