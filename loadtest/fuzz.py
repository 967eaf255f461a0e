"""Fuzzing the trust boundary: hostile requests (:mod:`loadtest.fuzz_inputs`) thrown at a
running cluster's HTTP and gRPC fronts while a victim request runs, and the properties
the cluster must keep. ``pdserve fuzz`` and ``tests/integration/test_fuzz_fronts.py`` run
it.

Lifecycle of :func:`run` (one cluster, the endpoints one after the other):

1. **Learn and reference.** The served model (``ListModels``), its vocabulary size
   (from the router's own refusal of token id 2^32-1, unless given), the serving
   workers (``GetStatus``). Then the victim, a
   greedy ``ignore_eos`` prompt through gRPC ``Generate``, runs alone, once with a fresh
   cache salt and once without: both must agree, and their tokens are the truth.
2. **Fuzz** each endpoint: hypothesis draws ``examples`` requests, derandomized (or from
   ``seed``); each is sent as soon as it is drawn, ``concurrency`` at a time, from an
   event loop on a second thread, while the victim runs back to back, alternating a
   fresh cache salt (the whole prompt computed: on a disaggregated cluster, prefilled
   and moved over the KV channel) and none (its cached prefix).
3. **Settle.** The victim stops; within ``settle_s`` every serving worker must be idle
   (nothing running, waiting, reserved or in transfer), every KV block free, and the
   same workers serving as before.

The properties every answer, victim and worker is checked for, and the report, are
:mod:`loadtest.fuzz_checks`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from protos.pdserve.v1 import api_pb2, api_pb2_grpc, common_pb2
from router.client import auth_metadata, build_request, busy_workers, describe_busy

from .fuzz_checks import EndpointReport, Failure, FuzzReport, check_grpc, check_http
from .fuzz_inputs import GrpcExample, HttpExample, grpc_examples, http_examples

__all__ = ["ENDPOINTS", "EndpointReport", "FuzzConfig", "FuzzReport", "run"]

ENDPOINTS: dict[str, tuple[str, str]] = {
    "completions": ("http", "/v1/completions"),
    "chat": ("http", "/v1/chat/completions"),
    "grpc-generate": ("grpc", "Generate"),
    "grpc-tokenize": ("grpc", "Tokenize"),
}

VICTIM_PROMPT = ("The history of the city begins with a small settlement on the river bank, "
                 "where traders met every spring to exchange salt, wool and iron tools. Over "
                 "the centuries the market grew into a town with stone walls.")

_VOCAB_IN_MESSAGE = re.compile(r"outside the vocabulary \[0, (\d+)\)")


@dataclass(frozen=True)
class FuzzConfig:
    target: str
    """The router's gRPC address, HOST:PORT."""
    http_url: str | None = None
    """The router's OpenAI front, http://HOST:PORT; needed for the HTTP endpoints."""
    endpoints: tuple[str, ...] = tuple(ENDPOINTS)
    examples: int = 100
    """Per endpoint."""
    concurrency: int = 4
    seed: int | None = None
    """None: derandomized (the same examples every run); else hypothesis's seed."""
    api_key: str | None = None
    """Sent as ``authorization: Bearer KEY`` (gRPC metadata and HTTP header) with every
    fuzzed request and the victim."""
    status_api_key: str | None = None
    """For ``ListModels`` and ``GetStatus`` (an admin key where keys are on); None: the
    same as ``api_key``."""
    request_timeout_s: float = 120.0
    settle_s: float = 15.0
    vocab_size: int | None = None
    """The served vocabulary, for token ids at its edge; None: ask the router."""
    victim_prompt: str = VICTIM_PROMPT
    victim_max_tokens: int = 32

    def __post_init__(self) -> None:
        unknown = [e for e in self.endpoints if e not in ENDPOINTS]
        if unknown or not self.endpoints:
            raise ValueError(f"endpoints must be some of {', '.join(ENDPOINTS)}; got "
                             f"{', '.join(self.endpoints) or 'none'}")
        if any(ENDPOINTS[e][0] == "http" for e in self.endpoints) and not self.http_url:
            raise ValueError("the HTTP endpoints need the router's HTTP address (http_url)")
        if self.examples < 1 or self.concurrency < 1:
            raise ValueError(f"examples and concurrency must be >= 1, got {self.examples} "
                             f"and {self.concurrency}")


# --------------------------------------------------------------------------- the fuzzer


class _LoopThread:
    """An asyncio event loop on a daemon thread: where requests are sent from while the
    main thread draws examples. ``submit`` may be called from any thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-io",
                                        daemon=True)
        self._thread.start()

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Any) -> Any:
        return self.submit(coro).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class _Fuzzer:
    """The connections, the victim and the send-and-check of one example. Its coroutines
    run on the :class:`_LoopThread`'s loop only."""

    def __init__(self, config: FuzzConfig) -> None:
        self.config = config
        self.metadata = auth_metadata(config.api_key)
        self.status_metadata = auth_metadata(config.status_api_key or config.api_key)
        self.reference: list[int] = []
        self._nonce = uuid.uuid4().hex[:8]
        self._victim_runs = 0

    async def open(self) -> None:
        import aiohttp

        self.channel = grpc.aio.insecure_channel(self.config.target)
        self.stub = api_pb2_grpc.PDServeStub(self.channel)
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key \
            else {}
        # A connection per request: a hostile request that makes the server close its
        # connection must fail itself, not the next example that would reuse it.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True), headers=headers,
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s))
        # Bytes in (no serializer): examples may be messages no client would write.
        self.raw_generate = self.channel.unary_stream(
            "/pdserve.v1.PDServe/Generate", request_serializer=None,
            response_deserializer=api_pb2.GenerateResponse.FromString)
        self.raw_tokenize = self.channel.unary_unary(
            "/pdserve.v1.PDServe/Tokenize", request_serializer=None,
            response_deserializer=api_pb2.TokenizeResponse.FromString)

    async def close(self) -> None:
        await self.session.close()
        await self.channel.close()

    # -- learning the cluster

    async def learn(self) -> tuple[str, int]:
        """(the served model, its vocabulary size or 0 when the router did not say)."""
        models = await self.stub.ListModels(api_pb2.ListModelsRequest(),
                                            metadata=self.status_metadata, timeout=10)
        vocab = self.config.vocab_size
        if vocab is None:
            try:
                await self._generate(build_request([2**32 - 1], max_tokens=1))
            except grpc.aio.AioRpcError as e:
                m = _VOCAB_IN_MESSAGE.search(e.details() or "")
                vocab = int(m.group(1)) if m else None
        return models.models[0].id, vocab or 0

    async def status(self) -> api_pb2.GetStatusResponse:
        return await self.stub.GetStatus(api_pb2.GetStatusRequest(),
                                         metadata=self.status_metadata, timeout=10)

    # -- the victim

    async def _generate(self, req: api_pb2.GenerateRequest) -> tuple[list[int], int]:
        tokens: list[int] = []
        finish = 0
        async for msg in self.stub.Generate(req, metadata=self.metadata,
                                            timeout=self.config.request_timeout_s):
            tokens.extend(msg.token_ids)
            finish = msg.finish_reason or finish
        return tokens, finish

    def _victim_request(self, salted: bool) -> api_pb2.GenerateRequest:
        self._victim_runs += 1
        salt = f"fuzz-victim-{self._nonce}-{self._victim_runs}" if salted else ""
        return build_request(self.config.victim_prompt, cache_salt=salt, temperature=0.0,
                             max_tokens=self.config.victim_max_tokens, ignore_eos=True)

    async def make_reference(self) -> list[int]:
        salted, _ = await self._generate(self._victim_request(salted=True))
        cached, _ = await self._generate(self._victim_request(salted=False))
        if salted != cached or len(salted) != self.config.victim_max_tokens:
            raise RuntimeError(f"the victim is not reproducible before any fuzzing: {salted} "
                               f"vs {cached}; fuzz a greedy-deterministic cluster")
        self.reference = salted
        return salted

    async def victim_loop(self, stop: asyncio.Event, report: EndpointReport) -> None:
        """The victim, back to back until ``stop``. Refused for load (a tenant's limits
        where keys are on) it waits and tries again: admission is not harm."""
        salted = True
        while not stop.is_set():
            try:
                tokens, finish = await self._generate(self._victim_request(salted))
                problem = (None if tokens == self.reference
                           and finish == common_pb2.FINISH_REASON_LENGTH else
                           f"tokens {tokens} (finish reason {finish}) differ from the "
                           f"reference {self.reference} (length)")
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    await asyncio.sleep(0.2)
                    continue
                problem = f"{e.code().name}: {e.details()}"
            report.victims += 1
            if problem:
                report.add(Failure(report.endpoint, "victim", "salted" if salted else "cached",
                                   problem[:500]))
            salted = not salted

    # -- one example

    async def send(self, endpoint: str, example: HttpExample | GrpcExample,
                   report: EndpointReport) -> None:
        kind, where = ENDPOINTS[endpoint]
        report.examples += 1
        if kind == "http":
            assert isinstance(example, HttpExample)
            problems, status = await self._send_http(where, example)
            size = len(example.body)
        else:
            assert isinstance(example, GrpcExample)
            problems, status = await self._send_grpc(where, example)
            size = len(example.payload)
        report.statuses[status] += 1
        for kind_, code, message in problems:
            report.add(Failure(endpoint, kind_, code, message, example.describe(), size,
                               example.shape))

    async def _send_http(self, path: str, ex: HttpExample
                         ) -> tuple[list[tuple[str, str, str]], str]:
        import aiohttp

        try:
            async with self.session.post(self.config.http_url.rstrip("/") + path,  # type: ignore[union-attr]
                                         data=ex.body, headers=ex.headers) as r:
                body = await r.read()
                status, content_type = r.status, r.headers.get("Content-Type", "")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return [("bad answer", "no answer", f"{type(e).__name__}: {e}")], "no answer"
        return check_http(status, content_type, body), f"{status // 100}xx"

    async def _send_grpc(self, method: str, ex: GrpcExample
                         ) -> tuple[list[tuple[str, str, str]], str]:
        finished = False
        try:
            if method == "Generate":
                async for msg in self.raw_generate(ex.payload, metadata=self.metadata,
                                                   timeout=self.config.request_timeout_s):
                    finished = finished or bool(msg.finish_reason)
            else:
                await self.raw_tokenize(ex.payload, metadata=self.metadata,
                                        timeout=self.config.request_timeout_s)
                finished = True
            code, details = grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details() or ""
        return check_grpc(code, details, finished), code.name

    # -- settling

    async def settle(self, before: set[str], report: EndpointReport) -> None:
        """Wait until every serving worker is idle with every block free; note what is
        not, and workers that stopped serving."""
        deadline = time.monotonic() + self.config.settle_s
        while True:
            try:
                status = await self.status()
            except grpc.aio.AioRpcError as e:
                report.settle_problems.append(f"GetStatus failed, leaks unchecked: "
                                              f"{e.code().name}: {e.details()}")
                return
            serving = {w.address: w for w in status.workers if w.serving}
            busy = busy_workers(status)
            if (not busy and not status.requests_in_flight) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        lost = sorted(set(before) - set(serving))
        if lost:
            report.settle_problems.append(f"workers no longer serving: {', '.join(lost)}")
        report.leaked_blocks = sum(w.total_blocks - w.free_blocks for w in busy)
        for w in busy:
            report.settle_problems.append(
                f"not idle after {self.config.settle_s:.0f} s: {describe_busy(w)}")
        if status.requests_in_flight:
            report.settle_problems.append(
                f"the router still has {status.requests_in_flight} requests in flight")


def _strategy(endpoint: str, vocab: int, model: str) -> Any:
    kind, where = ENDPOINTS[endpoint]
    if kind == "http":
        return http_examples(chat=endpoint == "chat", vocab=vocab or None, model=model)
    return grpc_examples(where, vocab=vocab or None, model=model)


def _draw_and_send(strategy: Any, config: FuzzConfig, io: _LoopThread,
                   send: Callable[[Any], Any], progress: Callable[[int], None]) -> None:
    """Hypothesis draws ``config.examples`` examples; each is handed to ``send`` on the
    I/O loop at once, at most ``config.concurrency`` outstanding."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as with_seed

    slots = threading.BoundedSemaphore(config.concurrency)
    futures: list[concurrent.futures.Future[Any]] = []

    @settings(max_examples=config.examples, database=None, deadline=None,
              derandomize=config.seed is None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
              print_blob=False)
    @given(strategy)
    def draw(example: Any) -> None:
        slots.acquire()
        fut = io.submit(send(example))
        fut.add_done_callback(lambda _: slots.release())
        futures.append(fut)
        progress(len(futures))

    (with_seed(config.seed)(draw) if config.seed is not None else draw)()
    for fut in futures:
        fut.result()  # the harness's own errors surface here


def run(config: FuzzConfig, progress: Callable[[str, int, int], None] | None = None
        ) -> FuzzReport:
    """Fuzz every endpoint of ``config`` in turn (see the module docstring). Blocks;
    ``progress(endpoint, sent, total)`` is called from this thread as examples go out."""
    io = _LoopThread()
    fuzzer = _Fuzzer(config)
    try:
        io.call(fuzzer.open())
        model, vocab = io.call(fuzzer.learn())
        before = {w.address for w in io.call(fuzzer.status()).workers if w.serving}
        report = FuzzReport([], model, vocab, io.call(fuzzer.make_reference()))
        for endpoint in config.endpoints:
            er = EndpointReport(endpoint)
            report.endpoints.append(er)
            started = time.monotonic()
            stop = asyncio.Event()
            victim = io.submit(fuzzer.victim_loop(stop, er))
            try:
                _draw_and_send(_strategy(endpoint, vocab, model), config, io,
                               lambda ex, ep=endpoint, r=er: fuzzer.send(ep, ex, r),
                               lambda n, ep=endpoint: progress and progress(
                                   ep, n, config.examples))
            finally:
                io.loop.call_soon_threadsafe(stop.set)
                victim.result()
            io.call(fuzzer.settle(before, er))
            er.seconds = time.monotonic() - started
        return report
    finally:
        if hasattr(fuzzer, "session"):
            io.call(fuzzer.close())
        io.close()
