"""Blast radius: what one request carries fails that request alone.

Issue 14 measured four ``/v1/completions`` requests with a ~70 KB ``cache_salt`` and a
short prompt failing the decode worker's engine step: the salt entered the block hash
inside the step (once the short prompt grew to a full block) and overflowed a uint16
length field, every other request got 503, and the loop published a stale load (8
running, 12 blocks held) ever after. Here four greedy victim requests run on one engine
loop while an attacker is injected; each attacker gets its own clear
:class:`InvalidRequestError`, each victim's tokens equal a run without the attacker, and
every block is free at the end. Some failures cannot be reached with input that passed
the checks at the door any more; those are injected at the spot where they used to
happen (the fault is named in each test) to pin that the step contains them.

A genuine engine failure (the forward raising) still fails the batch, but then the loop
says so: every request gets :class:`EngineUnavailableError`, new ones too, the published
load is fresh, and the worker's health and registry entry stop claiming it serves.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from conftest import assert_no_leaks, engine_idle
from conftest import on_engine as on_engine_within
from grpc_health.v1 import health_pb2, health_pb2_grpc

import workers.engine.llm_engine as llm_engine_module
import workers.engine.sequence as sequence_module
from common.request import MAX_CACHE_SALT_BYTES, Request
from common.wire import sampling_to_proto
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.llm_engine import LLMEngine
from workers.engine.model_runner import ModelRunner
from workers.engine.params import EngineConfig, InvalidRequestError, SamplingParams
from workers.engine_loop import EngineLoop, EngineUnavailableError
from workers.presence import Presence
from workers.reservation import Reservation
from workers.transfer import TransferHandle
from workers.transfer import TransferState as T
from workers.transfer.state import StateCounters

VICTIM = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
ATTACK = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TEXTS = ("The quick brown fox", "Once upon a time there", "def main():\n    return",
         "A journey of a thousand miles")
HUGE_SALT = "s" * 70_000
WAIT_S = 20.0
Handles = dict[str, TransferHandle]
Strike = Callable[[], Awaitable[BaseException]]
"""Posts the attack's one command at once (its first slice), then awaits its error."""


@dataclass
class Bench:
    """One decode-side engine loop (blocks of 4 tokens) whose KV receiver is the test."""

    engine: LLMEngine
    loop: EngineLoop
    handles: Handles
    prompts: list[list[int]]
    want: list[list[int]]  # the victims' tokens with nobody else around


def _start(tiny: dict, num_blocks: int = 256) -> tuple[LLMEngine, EngineLoop, Handles]:
    engine = LLMEngine(EngineConfig(model=str(tiny["llama"]), dtype="float32",
                                    num_blocks=num_blocks, block_size=4))
    handles: Handles = {}

    def expect(rid: str, block_ids: list[int]) -> TransferHandle:
        handles[rid] = TransferHandle(rid, StateCounters(), frozenset({T.PENDING, T.RECEIVING}))
        return handles[rid]

    return engine, EngineLoop(engine, expect, "decode:1"), handles


@pytest.fixture(scope="module")
def bench(tiny_checkpoints) -> Iterator[Bench]:
    engine, loop, handles = _start(tiny_checkpoints)
    prompts = [engine.tokenize(t) for t in TEXTS]
    try:
        want, _ = asyncio.run(asyncio.wait_for(_victims_and(loop, prompts, None), WAIT_S))
        assert all(len(w) == VICTIM.max_tokens for w in want)
        yield Bench(engine, loop, handles, prompts, want)
    finally:
        loop.close()


async def on_engine(loop: EngineLoop, fn: Callable[[], object]) -> object:
    """``fn()`` on the engine thread, after every command posted before this call."""
    return await on_engine_within(loop, fn, WAIT_S)  # type: ignore[no-any-return]


async def _victims_and(loop: EngineLoop, prompts: list[list[int]], strike: Strike | None
                       ) -> tuple[list[list[int]], BaseException | None]:
    """Four victims in the running batch, then the attack; returns the victims' tokens
    and the attacker's error.

    The engine thread holds still right after the step in which the last victim got its
    first token (a wrapper around ``step``, armed only here) while the attack posts its
    command, so the attack lands between two steps of a batch holding all four victims
    (checked there) however the machine is loaded; the attacker then fails within a few
    steps, long before the victims' ``max_tokens``."""
    engine, step = loop.engine, loop.engine.step
    paused, resume, running, started = threading.Event(), threading.Event(), [], set()

    def held_step() -> list:  # engine thread
        outputs = step()
        started.update(o.request_id for o in outputs if o.request_id.startswith("victim-"))
        if len(started) == len(prompts) and not paused.is_set():
            running.append(engine.load().running)
            paused.set()
            resume.wait(WAIT_S)
        return outputs

    if strike is not None:
        engine.step = held_step  # type: ignore[method-assign]
    try:
        streams = [loop.generate(Request(f"victim-{i}", ids, VICTIM)) for i, ids in
                   enumerate(prompts)]
        firsts = [asyncio.create_task(anext(s)) for s in streams]  # posts the requests
        error = None
        if strike is not None:
            assert await asyncio.to_thread(paused.wait, WAIT_S), "the victims never started"
            attack = asyncio.create_task(strike())
            for _ in range(3):
                await asyncio.sleep(0)  # the attack's first slice posts its command
            resume.set()
            error = await attack
            assert running == [len(prompts)], f"the victims must be running: {running}"
        await asyncio.gather(*firsts)
    finally:
        resume.set()
        vars(engine).pop("step", None)  # the class's step again
    finals = []
    for s in streams:
        async for out in s:
            last = out
        finals.append(last)
    assert all(o.finished and o.finish_reason == "length" for o in finals)
    return [o.token_ids for o in finals], error


async def _error_of(stream: AsyncIterator[object]) -> BaseException:
    with pytest.raises(Exception) as err:  # noqa: PT011 - the test checks which
        async for _ in stream:
            pass
    return err.value


async def _idle(loop: EngineLoop) -> None:
    await engine_idle(loop, WAIT_S)


def _attacked(bench: Bench, strike: Strike,
              prepare: Callable[[], Awaitable[None]] | None = None) -> BaseException:
    """Run the victims with an attack (``prepare`` runs before the victims start); they
    must equal their solo run, and nothing may leak. Returns the attacker's error."""

    async def run() -> tuple[list[list[int]], BaseException | None]:
        if prepare is not None:
            await prepare()
        got = await _victims_and(bench.loop, bench.prompts, strike)
        await _idle(bench.loop)
        return got

    got, error = asyncio.run(asyncio.wait_for(run(), WAIT_S * 2))
    assert got == bench.want, "a victim's tokens changed"
    assert bench.loop.serving and bench.loop.failure is None
    assert_no_leaks(bench.engine)
    assert error is not None
    return error


def _forged(rid: str, ids: list[int], params: SamplingParams, salt: str) -> Request:
    """A Request that skipped its own checks: what a buggy door (or an older router
    build) could hand the engine loop. The engine's own door must still refuse it."""
    r = object.__new__(Request)
    for name, value in (("request_id", rid), ("prompt_token_ids", tuple(ids)),
                        ("sampling", params), ("cache_salt", salt)):
        object.__setattr__(r, name, value)
    return r


def _through(bench: Bench, door: str, request: Request) -> Strike:
    """The attack: ``request`` sent through ``generate`` or the decode side's ``reserve``."""
    if door == "generate":
        return lambda: _error_of(bench.loop.generate(request))
    return lambda: _error_of(bench.loop.reserve(request)[1])


# -- what one request carries ------------------------------------------------------------


@pytest.mark.parametrize("door", ["generate", "reserve"])
def test_a_70kb_cache_salt_is_refused_and_the_victims_run_on(bench: Bench, door: str) -> None:
    ids = bench.prompts[0][:2]  # shorter than a block: the salt was hashed inside a step
    with pytest.raises(InvalidRequestError) as typed:
        Request("attacker", ids, ATTACK, HUGE_SALT)
    assert typed.value.field == "cache_salt" and str(MAX_CACHE_SALT_BYTES) in str(typed.value)
    error = _attacked(bench, _through(bench, door, _forged("attacker", ids, ATTACK, HUGE_SALT)))
    assert isinstance(error, InvalidRequestError) and error.field == "cache_salt", error
    assert "70000" in str(error) and str(MAX_CACHE_SALT_BYTES) in str(error)


@pytest.mark.parametrize("door", ["generate", "reserve"])
def test_prompt_ids_outside_the_vocabulary_are_refused(bench: Bench, door: str) -> None:
    vocab = bench.engine.runner.vocab_size
    error = _attacked(bench, _through(bench, door, Request("attacker", [5, vocab], ATTACK)))
    assert isinstance(error, InvalidRequestError) and error.field == "prompt_token_ids", error
    assert f"{vocab} is outside the vocabulary [0, {vocab})" in str(error)


@pytest.mark.parametrize("bad", ["vocab", "uint32-max", "negative"])
@pytest.mark.parametrize("landed_first", [True, False], ids=["landed-first", "commit-first"])
def test_a_commit_with_a_first_token_outside_the_vocabulary_fails_only_that_request(
    bench: Bench, landed_first: bool, bad: str,
) -> None:
    """The decode side: the attacker's KV lands (or not yet) and the router's commit
    carries a first token the model does not have. It used to enter the next forward's
    input and fail the batch; now the commit is refused and the reservation freed."""
    vocab = bench.engine.runner.vocab_size
    token = {"vocab": vocab, "uint32-max": 2**32 - 1, "negative": -1}[bad]
    ids = (bench.prompts[1] * 8)[:21]
    placed: list[tuple[Callable[[int | None], None], AsyncIterator[object]]] = []

    async def prepare() -> None:  # placed (and maybe landed) before the victims start
        commit, stream = bench.loop.reserve(Request("attacker", ids, ATTACK))
        r = await anext(stream)
        assert isinstance(r, Reservation) and not r.local, r
        if landed_first:
            bench.handles["attacker"].advance(T.RECEIVING)
            bench.handles["attacker"].advance(T.DONE)
        placed.append((commit, stream))

    async def strike() -> BaseException:
        commit, stream = placed[0]
        commit(token)
        return await _error_of(stream)

    error = _attacked(bench, strike, prepare)
    assert isinstance(error, InvalidRequestError) and error.field == "first_token", error
    assert f"{token} is outside the vocabulary [0, {vocab})" in str(error)
    assert bench.handles["attacker"].state is (T.DONE if landed_first else T.CANCELLED)


def test_a_detokenizer_that_raises_fails_only_its_request(bench: Bench, monkeypatch) -> None:
    """Fault injected: no token id that passes the door makes the tiny tokenizer's
    decode raise (ids outside the vocabulary decode to "", negative ones are refused),
    so the attacker's detokenizer is swapped for one that raises, as a real tokenizer
    may on an id it does not know."""
    ids = bench.prompts[2][:3]

    class Exploding(IncrementalDetokenizer):
        def add(self, token_id: int) -> str:
            raise ValueError(f"injected: cannot decode token {token_id}")

    def detokenizer(tokenizer, prompt_ids, *args):  # noqa: ANN001, ANN202
        cls = Exploding if list(prompt_ids) == ids else IncrementalDetokenizer
        return cls(tokenizer, prompt_ids, *args)

    monkeypatch.setattr(llm_engine_module, "IncrementalDetokenizer", detokenizer)
    error = _attacked(bench, _through(bench, "generate", Request("attacker", ids, ATTACK)))
    assert isinstance(error, InvalidRequestError) and error.field == "request", error
    assert "turning its tokens into text" in str(error) and "injected" in str(error)


def test_a_block_hash_that_raises_inside_the_step_fails_only_its_request(
    bench: Bench, monkeypatch,
) -> None:
    """The incident's own spot: the attacker's prompt is shorter than a block, so its
    first block is hashed inside a step, when a generated token fills it. Fault injected
    there (the salt bound and the fixed hash leave no honest input that fails it)."""
    ids = bench.prompts[3][:2]
    real = sequence_module.block_hashes

    def block_hashes(token_ids, block_size, model_id, cache_salt=None, *args, **kw):  # noqa: ANN001, ANN202
        if cache_salt == "explode" and len(token_ids) >= block_size:
            raise OverflowError("injected: the salt does not fit the hash")
        return real(token_ids, block_size, model_id, cache_salt, *args, **kw)

    monkeypatch.setattr(sequence_module, "block_hashes", block_hashes)
    error = _attacked(bench, _through(bench, "generate",
                                      Request("attacker", ids, ATTACK, "explode")))
    assert isinstance(error, InvalidRequestError) and error.field == "request", error
    assert "recording its tokens" in str(error) and "injected" in str(error)


def test_a_prefill_export_callback_that_raises_fails_only_its_request(bench: Bench) -> None:
    """Prefill side: the callback that hands the KV blocks to a transfer raises; the
    engine takes it to hold nothing, frees the blocks and fails that request."""

    def export(block_table: list[int], release: Callable[[], None]) -> None:
        raise ConnectionError("injected: the KV channel is gone")

    ids = (bench.prompts[0] * 4)[:13]
    error = _attacked(bench, lambda: _error_of(
        bench.loop.generate(Request("attacker", ids, ATTACK), export)))
    assert isinstance(error, InvalidRequestError) and error.field == "request", error
    assert "handing its KV blocks out" in str(error)


def test_the_engine_refuses_a_first_token_outside_the_vocabulary_at_its_door(
    bench: Bench,
) -> None:
    vocab = bench.engine.runner.vocab_size
    for token in (-1, vocab, 2**32, True, 1.0):
        with pytest.raises(InvalidRequestError) as err:
            bench.engine.check_first_token(token)
        assert err.value.field == "first_token"
    bench.engine.check_first_token(vocab - 1)


# -- an engine failure: the worker stops claiming to serve ---------------------------------


def test_a_failing_forward_fails_every_request_and_the_loop_stops_serving(
    tiny_checkpoints,
) -> None:
    engine, loop, _ = _start(tiny_checkpoints, num_blocks=64)
    boom = threading.Event()
    forward = engine.runner.execute

    def execute(chunks, *rest):  # noqa: ANN001, ANN002, ANN202 - engine thread
        if boom.is_set():
            raise RuntimeError("injected: the device fell off the bus")
        return forward(chunks, *rest)

    engine.runner.execute = execute  # type: ignore[method-assign]
    reasons: list[str] = []
    loop.on_failure(reasons.append)
    ids = engine.tokenize("some prompt")

    async def run() -> tuple[list[BaseException], BaseException, BaseException]:
        streams = [loop.generate(Request(f"v{i}", ids, VICTIM)) for i in range(4)]
        for s in streams:
            await anext(s)
        boom.set()
        errors = [await _error_of(s) for s in streams]
        later = await _error_of(loop.generate(Request("later", ids, ATTACK)))
        reserve = await _error_of(loop.reserve(Request("later-reserve", ids, ATTACK))[1])
        return errors, later, reserve

    try:
        errors, later, reserve = asyncio.run(asyncio.wait_for(run(), WAIT_S))
        assert all(isinstance(e, EngineUnavailableError) for e in errors), errors
        assert "injected" in str(errors[0])
        assert isinstance(later, EngineUnavailableError) and "no longer serves" in str(later)
        assert isinstance(reserve, EngineUnavailableError)
        assert not loop.serving and "injected" in (loop.failure or "")
        assert len(reasons) == 1 and "injected" in reasons[0]
        load = loop.load()  # fresh, not the load from before the failure
        assert (load.running, load.waiting, load.reserved) == (0, 0, 0), load
        assert load.free_blocks == load.total_blocks, load
        assert_no_leaks(engine)
    finally:
        loop.close()


class _FakeRegistry:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def register(self, info: object, load: dict, ttl_s: float) -> None:
        self.calls.append("register")

    def heartbeat(self, worker_id: str, load: dict, ttl_s: float) -> bool:
        self.calls.append("heartbeat")
        return True

    def deregister(self, worker_id: str) -> None:
        self.calls.append("deregister")


class _FakePublisher:
    def resync(self) -> None:
        pass


def test_a_worker_that_stops_serving_leaves_the_registry_and_stops_heartbeating() -> None:
    presence = object.__new__(Presence)  # no Redis: the registry is a fake
    presence.registry = _FakeRegistry()  # type: ignore[assignment]
    presence.publisher = _FakePublisher()  # type: ignore[assignment]
    presence.worker_id, presence.ttl_s = "w", 0.03
    serving = [True]

    async def run() -> list[str]:
        stop = asyncio.Event()
        task = asyncio.create_task(presence.run(None, dict, stop,  # type: ignore[arg-type]
                                                lambda: serving[0]))
        await asyncio.sleep(0.1)
        serving[0] = False
        await asyncio.sleep(0.1)
        stop.set()
        await task
        return presence.registry.calls  # type: ignore[attr-defined]

    calls = asyncio.run(asyncio.wait_for(run(), 10))
    assert calls[0] == "register" and "heartbeat" in calls
    assert calls.count("deregister") == 1
    assert calls[-1] == "deregister", f"heartbeats after leaving: {calls}"


# -- through the real gRPC worker server ----------------------------------------------------


def test_worker_answers_attackers_invalid_argument_and_a_failed_engine_unavailable(
    tiny_checkpoints, monkeypatch,
) -> None:
    """A mixed worker served in-process: a 70 KB salt and out-of-vocabulary ids end
    INVALID_ARGUMENT while four victims stream on unchanged; then the forward fails
    (injected): requests end UNAVAILABLE and health turns NOT_SERVING."""
    from workers.server import WorkerConfig, serve

    boom = threading.Event()
    forward = ModelRunner.execute

    def execute(self, chunks, *rest):  # noqa: ANN001, ANN002, ANN202
        if boom.is_set():
            raise RuntimeError("injected: the device fell off the bus")
        return forward(self, chunks, *rest)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    config = WorkerConfig(engine=EngineConfig(model=str(tiny_checkpoints["llama"]),
                                              dtype="float32", num_blocks=128, block_size=4,
                                              num_threads=1),
                          model_name="llama", port=0)
    ready: list[object] = []
    stop_box: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def worker() -> None:
        async def main() -> None:
            stop = asyncio.Event()
            stop_box.append((asyncio.get_running_loop(), stop))
            await serve(config, ready.append, stop)
        asyncio.run(main())

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not ready:
        assert thread.is_alive() and time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.05)
    address = ready[0].address  # type: ignore[attr-defined]
    victim = sampling_to_proto(VICTIM)
    prompts = [list(range(10 + i, 17 + i)) for i in range(4)]

    def req(rid: str, ids: list[int], salt: str = "") -> worker_pb2.WorkerGenerateRequest:
        return worker_pb2.WorkerGenerateRequest(request_id=rid, prompt_token_ids=ids,
                                                sampling=victim, cache_salt=salt)

    async def victims(stub, attack=None):  # noqa: ANN001, ANN202
        calls = [stub.Generate(req(f"v{i}", ids)) for i, ids in enumerate(prompts)]
        firsts = [list((await c.read()).token_ids) for c in calls]  # all four running
        codes = []
        for bad in attack or ():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(bad):
                    pass
            codes.append((err.value.code(), err.value.details()))
        tokens = []
        for c in calls:
            got = []
            while (m := await c.read()) is not grpc.aio.EOF:
                got.extend(m.token_ids)
            tokens.append(got)
        return [f + t for f, t in zip(firsts, tokens, strict=True)], codes

    async def scenario():  # noqa: ANN202
        async with grpc.aio.insecure_channel(address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            want, _ = await victims(stub)
            got, codes = await victims(stub, [req("salt", [5, 6], HUGE_SALT),
                                              req("vocab", [5, 10**6])])
            status_ok = (await health.Check(health_pb2.HealthCheckRequest())).status
            load = await stub.GetLoad(worker_pb2.GetLoadRequest())
            boom.set()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for _ in stub.Generate(req("doomed", prompts[0])):
                    pass
            deadline = time.monotonic() + 10
            while (await health.Check(health_pb2.HealthCheckRequest())).status != \
                    health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline, "health still says SERVING"
                await asyncio.sleep(0.05)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Generate(req("after", prompts[0])):
                    pass
            after = await stub.GetLoad(worker_pb2.GetLoadRequest())
            return want, got, codes, status_ok, load, failed.value, refused.value, after

    try:
        want, got, codes, status_ok, load, failed, refused, after = asyncio.run(
            asyncio.wait_for(scenario(), 60))
    finally:
        if stop_box:
            aloop, stop = stop_box[0]
            aloop.call_soon_threadsafe(stop.set)
        thread.join(30)
    assert got == want and all(len(t) == VICTIM.max_tokens for t in got)
    assert [c for c, _ in codes] == [grpc.StatusCode.INVALID_ARGUMENT] * 2, codes
    assert codes[0][1].startswith("cache_salt:") and "prompt_token_ids" in codes[1][1]
    assert status_ok == health_pb2.HealthCheckResponse.SERVING
    assert load.running_requests == 0 and load.free_blocks == load.total_blocks
    assert failed.code() == grpc.StatusCode.UNAVAILABLE and "injected" in failed.details()
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert after.running_requests == 0 and after.free_blocks == after.total_blocks
