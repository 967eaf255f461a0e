"""Fake workers for router tests: real grpc.aio servers on 127.0.0.1, fake engines.

Why real servers and not fake stubs: the router leans on grpc.aio's own semantics
(``AioRpcError`` codes and details, ``grpc.aio.EOF``, ``asyncio.InvalidStateError`` when
writing to a call the worker already ended, deadlines and cancellation reaching the
worker, a stopped server failing calls with UNAVAILABLE). A fake stub would have to
re-implement each of them, and a test passing against a wrong imitation proves nothing.
In-process servers cost about a millisecond to start and a millisecond per call, so a
whole scenario still runs in tens of milliseconds. What is fake is everything behind
the servicer: no model, no KV, no Redis, no processes.

The fake engine is deterministic: the next token is ``100 + len(context)``, so a
request's output depends only on its prompt length, and a request that migrates with
``prompt + tokens so far`` continues exactly where it stopped (the stream a client sees
is the same as without the failure). ``max_tokens`` defaults to 8; the last message
carries ``finish_reason=LENGTH`` and usage.

:class:`Cluster` starts the workers, builds a :class:`router.core.Router` on them with a
:class:`FakeTokenizer` and a recording ``connect``, and on exit checks that nothing
leaked: the router has nothing in flight, no worker call is open, every channel closed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import grpc

from common.registry import LiveWorker, WorkerInfo
from common.wire import KEEPALIVE_SERVER
from protos.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from router.core import Router, RouterConfig

MODEL = "fake-model"
MAX_MODEL_LEN = 64
BLOCK_SIZE = 4
VOCAB = 1000
DEFAULT_MAX_TOKENS = 8


def next_token(context_len: int) -> int:
    return 100 + context_len % 800


def expected_tokens(prompt_len: int, n: int) -> list[int]:
    """What the fake engine generates for a prompt of ``prompt_len`` tokens."""
    return [next_token(prompt_len + i) for i in range(n)]


class FakeTokenizer:
    """A character per token; chat messages framed by ids 1 and 2. Records the threads
    it ran on (``threads``); ``error``, when set, is raised by every call (an internal
    failure the client must not read about)."""

    def __init__(self) -> None:
        self.threads: set[int] = set()
        self.error: Exception | None = None

    def _enter(self) -> None:
        self.threads.add(threading.get_ident())
        if self.error is not None:
            raise self.error

    def __call__(self, text: str) -> SimpleNamespace:
        self._enter()
        return SimpleNamespace(input_ids=[ord(c) % VOCAB for c in text])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = False) -> list[int]:
        self._enter()
        ids = []
        for m in messages:
            ids += [1] + self(f"{m['role']}:{m['content']}").input_ids + [2]
        return ids + ([1] if add_generation_prompt else [])

    def __len__(self) -> int:
        return VOCAB


@dataclass
class FakeRegistry:
    """``common.registry.WorkerRegistry.live`` over a list the test edits; ``error``
    makes the read fail as an unreachable Redis would."""

    entries: list[LiveWorker] = field(default_factory=list)
    error: Exception | None = None
    readers: set[str] = field(default_factory=set)  # markers (WorkerRegistry.emptied)

    def add(self, address: str, role: str, free_blocks: int = 0) -> None:
        self.entries.append(LiveWorker(WorkerInfo(address, role, address, 100, BLOCK_SIZE, 1),
                                       {"free_blocks": free_blocks}))

    def expire(self, address: str) -> None:
        self.entries = [e for e in self.entries if e.info.address != address]

    def flush(self) -> None:
        """Redis restarted empty, or FLUSHALL: entries and readers' markers go."""
        self.entries, self.readers = [], set()

    def emptied(self, reader: str) -> bool:
        if self.error is not None:
            raise self.error
        fresh = reader not in self.readers
        self.readers.add(reader)
        return fresh

    def live(self) -> list[LiveWorker]:  # called from a thread, as the real one is
        if self.error is not None:
            raise self.error
        return list(self.entries)


@dataclass
class FakeIndex:
    """The shared index's ``lookup`` (``common.prefix_index.RedisPrefixIndex``) answering
    from a dict after ``delay_s`` (a slow Redis; it blocks, as Redis calls do), or
    raising ``error``."""

    counts: dict[str, int] = field(default_factory=dict)
    error: Exception | None = None
    calls: int = 0
    delay_s: float = 0.0

    def lookup(self, block_hashes: Sequence[int]) -> dict[str, int]:
        self.calls += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        return dict(self.counts)


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """One worker of ``role``. Knobs the test sets before the request:

    - ``fail_after``: (k, code): abort the next stream with ``code`` after k tokens;
    - ``die_after``: k: stop this worker's server after k tokens of the next stream
      (a dead process: every call fails UNAVAILABLE);
    - ``fail_reserve``/``fail_prefill``: abort ``Decode`` before the reservation /
      ``Prefill`` with this code;
    - ``local``: reservations are local (the decode worker prefills itself);
    - ``cached_tokens``: what a reservation says this decode worker already holds;
    - ``gate``: decode output waits for this event (after the reservation/commit);
    - ``token_delay_s``, ``endless``: a slow or never-ending stream;
    - ``frozen``: while this event is unset, ``Prefill``, ``Decode``'s reservation,
      every streamed token and ``GetLoad`` answer nothing (a stopped process: SIGSTOP;
      its HTTP/2 pings still answer, in-process);
    - ``freeze_after``: k: set ``frozen`` (unset) after k tokens of the next stream.

    Records what it was asked: ``requests`` (every Generate, Prefill and Decode start),
    ``targets`` (of each Prefill), ``events`` (the order of calls across workers),
    ``commits`` (the first token of each commit, None when absent), ``sent`` (tokens
    streamed), ``cancelled`` (calls the router cancelled), ``open_calls``.
    """

    def __init__(self, role: str) -> None:
        self.role = role
        self.model_id = MODEL  # what GetLoad reports (a KV format changes it)
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self.fail_after: tuple[int, grpc.StatusCode] | None = None
        self.die_after: int | None = None
        self.fail_reserve: grpc.StatusCode | None = None
        self.fail_prefill: grpc.StatusCode | None = None
        self.fail_at_end: grpc.StatusCode | None = None  # after the last token's finish
        self.local = False
        self.cached_tokens = 0
        self.gate: asyncio.Event | None = None
        self.token_delay_s = 0.0
        self.endless = False
        self.frozen: asyncio.Event | None = None
        self.freeze_after: int | None = None
        self.requests: list[worker_pb2.WorkerGenerateRequest] = []
        self.targets: list[worker_pb2.KVTarget] = []
        self.events: list[tuple[str, str]] = []  # (what, address); Cluster shares one
        self.commits: list[int | None] = []
        self.sent = 0
        self.cancelled = 0
        self.open_calls = 0
        self.dead = False

    async def start(self) -> str:
        # The real workers' ping policy: the router's channels ping every 2 s.
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *KEEPALIVE_SERVER])
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def kill(self) -> None:
        """The process dies: open calls fail UNAVAILABLE, new ones cannot connect."""
        self.dead = True
        assert self.server is not None
        await self.server.stop(None)

    # -- the fake engine -------------------------------------------------------------------

    async def _tokens(self, context: grpc.aio.ServicerContext,
                      req: worker_pb2.WorkerGenerateRequest, context_len: int, done: int):
        """The outputs after ``done`` tokens of ``req`` were already produced; with ``n``
        choices, one token of each per round (every choice writes the same tokens)."""
        limit = (req.sampling.max_tokens if req.sampling.HasField("max_tokens")
                 else DEFAULT_MAX_TOKENS)
        fail, self.fail_after = self.fail_after, None
        die, self.die_after = self.die_after, None
        freeze, self.freeze_after = self.freeze_after, None
        n = 0
        while self.endless or done < limit:
            if freeze is not None and n == freeze:
                self.frozen = asyncio.Event()
            if self.frozen is not None:
                await self.frozen.wait()
            if fail is not None and n == fail[0]:
                await context.abort(fail[1], f"fake worker {self.address} failed on purpose")
            if die is not None and n == die:
                asyncio.ensure_future(self.kill())
                await asyncio.Event().wait()  # cancelled by the server's stop
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            t = next_token(context_len)
            context_len += 1
            done += 1
            n += 1
            for index in range(req.n or 1):
                self.sent += 1
                out = worker_pb2.WorkerGenerateResponse(token_ids=[t], text=f"<{t}>",
                                                        index=index)
                if not self.endless and done >= limit:
                    out.finish_reason = common_pb2.FINISH_REASON_LENGTH
                    out.usage.CopyFrom(common_pb2.Usage(
                        prompt_tokens=len(req.prompt_token_ids), completion_tokens=done,
                        cached_tokens=0))
                yield out
        if self.fail_at_end is not None:
            await context.abort(self.fail_at_end, f"fake worker {self.address} failed "
                                "after the finish on purpose")

    def _enter(self) -> None:
        self.open_calls += 1

    def _exit(self, cancelled: bool) -> None:
        self.open_calls -= 1
        self.cancelled += cancelled

    # -- the Worker service ----------------------------------------------------------------

    async def GetLoad(self, request, context):  # noqa: N802 - gRPC method name
        if self.frozen is not None:
            await self.frozen.wait()
        return worker_pb2.WorkerLoad(role=self.role, model=MODEL, max_model_len=MAX_MODEL_LEN,
                                     block_size=BLOCK_SIZE, model_id=self.model_id,
                                     free_blocks=100,
                                     total_blocks=100)

    async def Generate(self, request, context):  # noqa: N802
        self._enter()
        cancelled = False
        try:
            self.requests.append(request)
            self.events.append(("generate", self.address))
            async for out in self._tokens(context, request, len(request.prompt_token_ids), 0):
                yield out
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            self._exit(cancelled)

    async def Prefill(self, request, context):  # noqa: N802
        self._enter()
        cancelled = False
        try:
            self.requests.append(request.request)
            self.targets.append(request.target)
            self.events.append(("prefill", self.address))
            if self.frozen is not None:
                await self.frozen.wait()
            if self.fail_prefill is not None:
                await context.abort(self.fail_prefill, f"fake prefill {self.address} failed")
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            req = request.request
            t = next_token(len(req.prompt_token_ids))
            self.sent += 1
            first = worker_pb2.WorkerGenerateResponse(token_ids=[t], text=f"<{t}>",
                                                      queue_s=0.001)
            first.usage.cached_tokens = 4  # what this prefill worker's cache served
            if req.sampling.HasField("max_tokens") and req.sampling.max_tokens <= 1:
                first.finish_reason = common_pb2.FINISH_REASON_LENGTH
                first.usage.prompt_tokens = len(req.prompt_token_ids)
                first.usage.completion_tokens = 1
            others = []
            for index in range(1, req.n or 1):
                other = worker_pb2.WorkerGenerateResponse()
                other.CopyFrom(first)
                other.index = index
                others.append(other)
            return worker_pb2.PrefillResponse(first=first, choices=others)
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            self._exit(cancelled)

    async def Decode(self, request_iterator, context):  # noqa: N802
        self._enter()
        cancelled = False
        try:
            requests = request_iterator.__aiter__()
            first = await anext(requests, None)
            if first is None or first.WhichOneof("kind") != "start":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "Decode: the first message must be `start`")
            req = first.start
            self.requests.append(req)
            self.events.append(("reserve", self.address))
            if self.frozen is not None:
                await self.frozen.wait()
            if self.fail_reserve is not None:
                await context.abort(self.fail_reserve, f"fake decode {self.address} failed")
            prompt = len(req.prompt_token_ids)
            blocks = list(range(-(-prompt // BLOCK_SIZE)))
            reservation = worker_pb2.Reservation(local=self.local,
                                                 cached_tokens=self.cached_tokens)
            if not self.local:
                reservation.target.CopyFrom(worker_pb2.KVTarget(address=f"{self.address}-kv",
                                                                block_ids=blocks))
            yield worker_pb2.DecodeResponse(reservation=reservation)
            done = 0
            if not self.local:
                msg = await anext(requests, None)
                ok = msg is not None and msg.WhichOneof("kind") == "commit"
                token = (msg.commit.first_token
                         if ok and msg.commit.HasField("first_token") else None)
                self.commits.append(token)
                self.events.append(("commit", self.address))
                done = 0 if token is None else 1  # None: recompute the prompt here
            if self.gate is not None:
                await self.gate.wait()
            async for out in self._tokens(context, req, prompt + done, done):
                yield worker_pb2.DecodeResponse(output=out)
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            self._exit(cancelled)


class RecordingChannel:
    """A grpc.aio channel that remembers whether the router closed it."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.closed = False

    async def close(self) -> None:
        self.closed = True
        await self.channel.close()


class Cluster:
    """``async with Cluster(["prefill", "decode"], ...) as c``: fake workers, a router
    on them (``c.router``, started), and the leak check on a clean exit."""

    def __init__(self, roles: Sequence[str], *, registry_roles: Sequence[str] = (),
                 registry: FakeRegistry | None = None, index: FakeIndex | None = None,
                 tokenizer: FakeTokenizer | None = None, **config: Any) -> None:
        self.tokenizer = tokenizer or FakeTokenizer()
        self.workers = [FakeWorker(r) for r in roles]
        self.registry_workers = [FakeWorker(r) for r in registry_roles]
        self.events: list[tuple[str, str]] = []
        for w in self.workers + self.registry_workers:
            w.events = self.events
        self.registry = registry
        self.index = index
        self.config = config
        self.channels: list[RecordingChannel] = []
        self.router: Router

    def connect(self, address: str) -> tuple[RecordingChannel, worker_pb2_grpc.WorkerStub]:
        channel = grpc.aio.insecure_channel(address)
        self.channels.append(RecordingChannel(channel))
        return self.channels[-1], worker_pb2_grpc.WorkerStub(channel)

    async def add_worker(self, role: str) -> FakeWorker:
        """A worker started after the router (not in any list or registry yet)."""
        w = FakeWorker(role)
        w.events = self.events
        self.registry_workers.append(w)
        await w.start()
        return w

    def by_role(self, role: str) -> list[FakeWorker]:
        return [w for w in self.workers + self.registry_workers if w.role == role]

    def router_worker(self, fake: FakeWorker):  # noqa: ANN201 - router.pool.Worker
        return next(w for w in self.router.workers.workers if w.address == fake.address)

    async def __aenter__(self) -> Cluster:
        for w in self.workers + self.registry_workers:
            await w.start()
        if self.registry_workers:
            self.registry = self.registry or FakeRegistry()
            for w in self.registry_workers:
                self.registry.add(w.address, w.role)
        config = RouterConfig(workers=tuple(w.address for w in self.workers),
                              model_path="unused", model_name=MODEL,
                              **{"connect_timeout_s": 2.0, **self.config})
        self.router = Router(config, tokenizer=self.tokenizer, connect=self.connect,
                             registry=self.registry, index=self.index)
        await self.router.start()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001
        try:
            if exc_type is None:
                await self.check_no_leaks()
        finally:
            await self.router.close()
            for w in self.workers + self.registry_workers:
                if not w.dead:
                    await w.kill()
        if exc_type is None:
            assert all(c.closed for c in self.channels), "a worker channel was left open"

    async def check_no_leaks(self, timeout_s: float = 2.0) -> None:
        """Nothing in flight at the router, no call open at any worker (cancellation
        reaches a worker asynchronously, so this waits a little for it)."""
        assert self.router.in_flight == 0
        for w in self.router.workers.workers:
            assert (w.in_flight, w.queued_tokens) == (0, 0), w
        deadline = time.monotonic() + timeout_s
        while any(w.open_calls for w in self.workers + self.registry_workers):
            assert time.monotonic() < deadline, [
                (w.address, w.open_calls) for w in self.workers if w.open_calls]
            await asyncio.sleep(0.001)
