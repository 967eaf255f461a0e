"""The router's request path, shared by the gRPC API and the OpenAI HTTP front.

Lifecycle of a request: validate (prompt present, sampling values, length against the
model's context) and tokenize (chat template for messages) -> admit (at most
``max_in_flight`` at once; beyond it RESOURCE_EXHAUSTED at once, never a queue that
hangs) -> route -> stream the tokens back, adding prompt ids first and usage/timings
last. When the consumer stops early (client cancelled or disconnected, deadline passed)
every worker call is cancelled, and the workers abort the request and free its blocks.

Routing. With prefill and decode workers (roles come from each worker's ``GetLoad``)
a request is disaggregated (worker.proto gives the message order): open ``Decode`` on
the least-loaded decode worker and get its reservation (a decode worker that does not
answer is skipped for ``down_s`` and the next one tried); unless the reservation is
local, call ``Prefill`` on the least-loaded prefill worker, relay its first token at
once (TTFT never waits for the KV transfer), ``commit`` it to the decode worker and
relay the rest. A prefill that fails (worker died, transport error) is recomputed on
the decode worker: the request still completes. Without both pools, requests go to the
least-loaded mixed worker.

Migration (Dynamo's name for it). When the worker generating a request fails mid-stream
(it died, its transport broke), the request moves to another worker with the prompt
plus the tokens already streamed as its new prompt and ``max_tokens`` reduced by them,
at most ``migration_limit`` times; the client sees one uninterrupted stream. Greedy
output is unchanged by a move. Seeded sampling restarts its random stream at the move,
and text a stop-string check was still holding back on the failed worker is lost (the
token ids are not). Past the limit the request fails with UNAVAILABLE.

Metrics (``common.metrics``, names after vLLM's and Dynamo's frontend): requests by
final status, in flight, TTFT, inter-token latency, end-to-end latency, tokens, cached
tokens, routing decisions by policy and reason, migrations.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import redis
from transformers import AutoTokenizer

from common.hashing import block_hashes
from common.metrics import Metrics
from common.prefix_index import PrefixIndex
from common.registry import WorkerRegistry
from common.sampling import InvalidRequestError, check_prompt
from common.wire import sampling_from_proto
from protos.pdserve.v1 import api_pb2, common_pb2, worker_pb2, worker_pb2_grpc

from .errors import RouterError, WorkerFailed
from .policies import Candidate, Decision, RoutedPrefixes, make_policy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    workers: tuple[str, ...]
    model_path: str  # tokenizer and chat template come from here
    model_name: str
    max_in_flight: int = 256
    connect_timeout_s: float = 120.0
    down_s: float = 5.0
    """How long a worker that failed a call is passed over (unless all are)."""
    redis_url: str | None = None
    """The shared prefix index and worker registry; workers found there join the pools
    (beside any given in ``workers``) and leave when their heartbeat expires."""
    policy: str = "cache_aware"
    """How prefill (or mixed) workers are chosen: see :mod:`router.policies`."""
    discovery_interval_s: float = 1.0
    migration_limit: int = 3
    """How many times a request may move to another worker after its worker failed."""

    def __post_init__(self) -> None:
        if not self.workers and not self.redis_url:
            raise ValueError("the router needs worker addresses or a registry (redis_url)")
        make_policy(self.policy)  # validates the name
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")


@dataclass
class _Worker:
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    role: str = "mixed"
    in_flight: int = 0
    queued_tokens: int = 0  # prompt tokens sent here whose first token has not come
    down_until: float = 0.0
    block_size: int = 16
    model_id: str = ""
    free_blocks: int = 0  # last reported (registry heartbeat); breaks in-flight ties
    static: bool = True  # given on the command line; False: found in the registry
    gone: bool = False  # left the registry: no new requests


class _Relay:
    """Worker stream messages -> public responses: prompt ids first, timings last."""

    def __init__(self, request_id: str, prompt_ids: list[int], received: float) -> None:
        self.request_id, self.prompt_ids, self.received = request_id, prompt_ids, received
        self.first = True
        self.first_token_at: float | None = None

    def convert(self, msg: worker_pb2.WorkerGenerateResponse) -> api_pb2.GenerateResponse:
        out = api_pb2.GenerateResponse(request_id=self.request_id, token_ids=msg.token_ids,
                                       text=msg.text, logprobs=msg.logprobs)
        if self.first:
            out.prompt_token_ids.extend(self.prompt_ids)
            self.first = False
        if self.first_token_at is None and msg.token_ids:
            self.first_token_at = time.monotonic()
        if msg.finish_reason:
            now = time.monotonic()
            out.finish_reason = msg.finish_reason
            out.usage.CopyFrom(msg.usage)
            out.timings.CopyFrom(common_pb2.Timings(
                ttft_s=(self.first_token_at or now) - self.received, e2e_s=now - self.received,
                queue_s=msg.queue_s))
        return out


class Router:
    def __init__(self, config: RouterConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics({"model": config.model_name})
        self.model_name = config.model_name
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.max_model_len = 0
        self._workers: list[_Worker] = []
        self._in_flight = 0
        self._ids = itertools.count()
        self._nonce = uuid.uuid4().hex[:8]  # router replicas and restarts never collide
        self.policy = make_policy(config.policy)
        self.decisions: Counter[tuple[str, str]] = Counter()  # (policy, reason) -> count
        self._redis: redis.Redis | None = None
        self._index: PrefixIndex | None = None
        self._registry: WorkerRegistry | None = None
        self._redis_down = False
        self._redis_retry_at = 0.0
        self._routed = RoutedPrefixes()
        self._discovery: asyncio.Task | None = None

    def pool(self, role: str) -> list[_Worker]:
        return [w for w in self._workers if w.role == role and not w.gone]

    @property
    def disaggregated(self) -> bool:
        return bool(self.pool("prefill")) and bool(self.pool("decode"))

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def start(self) -> None:
        """Connect to every worker given and found in the registry, and wait until each
        answers (loading takes a while) and the pools can serve."""
        if self.config.redis_url:
            self._redis = redis.Redis.from_url(self.config.redis_url, socket_timeout=2,
                                               socket_connect_timeout=2)
            self._index = PrefixIndex(self._redis, self.model_name)
            self._registry = WorkerRegistry(self._redis, self.model_name)
        deadline = time.monotonic() + self.config.connect_timeout_s
        for address in self.config.workers:
            self._workers.append(await self._connect(address, True, deadline))
        while True:
            await self._discover(deadline)
            if self.disaggregated or self.pool("mixed"):
                break
            if self._registry is None or time.monotonic() > deadline:
                roles = sorted({w.role for w in self._workers})
                raise RuntimeError(f"workers with roles {roles} cannot serve alone: give the "
                                   "router prefill and decode workers, or mixed ones")
            await asyncio.sleep(0.5)
        self._count_workers()
        if self._registry is not None:
            self._discovery = asyncio.create_task(self._discover_forever())

    def _count_workers(self) -> None:
        for role in ("prefill", "decode", "mixed"):
            self.metrics.set("workers", len(self.pool(role)), role=role)

    async def _connect(self, address: str, static: bool, deadline: float) -> _Worker:
        channel = grpc.aio.insecure_channel(address)
        stub = worker_pb2_grpc.WorkerStub(channel)
        while True:
            try:
                load = await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
                break
            except grpc.aio.AioRpcError as e:
                if time.monotonic() > deadline:
                    await channel.close()
                    raise RuntimeError(f"worker {address} did not answer within "
                                       f"{self.config.connect_timeout_s:.0f}s: "
                                       f"{e.details()}") from e
                await asyncio.sleep(0.5)
        limit = load.max_model_len
        self.max_model_len = min(self.max_model_len, limit) if self.max_model_len else limit
        return _Worker(address, channel, stub, role=load.role or "mixed",
                       block_size=load.block_size or 16, model_id=load.model_id, static=static)

    async def _discover(self, deadline: float | None = None) -> None:
        """Join workers new in the registry; retire those whose heartbeat expired."""
        if self._registry is None:
            return
        try:
            entries = await asyncio.to_thread(self._registry.live)
        except redis.RedisError as e:
            self._note_redis(e)
            return
        self._note_redis(None)
        live = {w.info.address for w in entries}
        known = {w.address: w for w in self._workers}
        for entry in entries:
            if entry.info.address in known:
                known[entry.info.address].free_blocks = int(entry.load.get("free_blocks", 0))
        for address in sorted(live - known.keys()):
            try:
                self._workers.append(await self._connect(
                    address, False, deadline or time.monotonic() + 10))
                log.info("worker %s joined from the registry", address)
            except RuntimeError as e:
                log.warning("registry lists %s but it does not answer: %s", address, e)
        for w in self._workers:
            if not w.static and w.gone == (w.address in live):
                w.gone = w.address not in live
                log.info("worker %s %s the registry", w.address,
                         "left" if w.gone else "rejoined")
        self._count_workers()

    async def _discover_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.discovery_interval_s)
            await self._discover()

    def _note_redis(self, error: Exception | None) -> None:
        if error is not None and not self._redis_down:
            log.warning("prefix index / registry unreachable (%s): routing by load until it "
                        "is back", error)
        elif error is None and self._redis_down:
            log.info("prefix index / registry reachable again")
        self._redis_down = error is not None

    async def close(self) -> None:
        if self._discovery is not None:
            self._discovery.cancel()
        for w in self._workers:
            await w.channel.close()
        if self._redis is not None:
            self._redis.close()

    # -- validation ----------------------------------------------------------------------

    def tokenize(self, req: api_pb2.GenerateRequest | api_pb2.TokenizeRequest) -> list[int]:
        kind = req.WhichOneof("prompt")
        if kind is None:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              "prompt: set one of text, token_ids or messages", "prompt")
        if kind == "text":
            return list(self.tokenizer(req.text).input_ids)
        if kind == "token_ids":
            return list(req.token_ids.ids)
        messages = [{"role": m.role, "content": m.content} for m in req.messages.messages]
        if not messages:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              "messages: must contain at least one message", "messages")
        bad = next((m["role"] for m in messages
                    if m["role"] not in ("system", "user", "assistant")), None)
        if bad is not None:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"messages: unknown role {bad!r}; use system, user or assistant",
                              "messages")
        return list(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    def validate(self, req: api_pb2.GenerateRequest) -> tuple[list[int], common_pb2.SamplingParams]:
        if req.model and req.model != self.model_name:
            raise RouterError(grpc.StatusCode.NOT_FOUND,
                              f"model: {req.model!r} is not served here; this router serves "
                              f"{self.model_name!r}", "model")
        try:
            sampling_from_proto(req.sampling)  # validation only: the worker rebuilds it
            ids = self.tokenize(req)
            check_prompt(ids, self.max_model_len, len(self.tokenizer))
        except InvalidRequestError as e:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field) from e
        return ids, req.sampling

    # -- the request path ----------------------------------------------------------------

    def _by_load(self, role: str) -> list[_Worker]:
        """Least-loaded first; workers that failed lately go last."""
        now = time.monotonic()
        return sorted(self.pool(role),
                      key=lambda w: (w.down_until > now, w.in_flight, -w.free_blocks))

    async def _choose(self, role: str, wreq: worker_pb2.WorkerGenerateRequest
                      ) -> tuple[_Worker, Decision]:
        """The policy's pick among the pool's workers, with their cached prefix of this
        prompt from the shared index (one round trip; none when Redis is down)."""
        pool = self.pool(role)
        if not pool:
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              f"no {role} worker is serving right now; retry later")
        now = time.monotonic()
        cached: dict[str, int] = {}
        hashes: list[int] = []
        if self.policy.name == "cache_aware":
            w0 = pool[0]
            hashes = block_hashes(list(wreq.prompt_token_ids), w0.block_size, w0.model_id,
                                  wreq.cache_salt or None)
            cached = self._routed.lookup(hashes, now)  # routed here, maybe not yet published
            if self._index is not None and not (self._redis_down and now < self._redis_retry_at):
                try:
                    published = await asyncio.to_thread(self._index.lookup, hashes)
                    self._note_redis(None)
                    for w, n in published.items():
                        cached[w] = max(cached.get(w, 0), n)
                except redis.RedisError as e:
                    self._note_redis(e)
                    self._redis_retry_at = now + 1.0
        cands = [Candidate(w.address, w.in_flight, w.queued_tokens,
                           cached.get(w.address, 0) * w.block_size, w.down_until <= now)
                 for w in pool]
        decision = self.policy.choose(cands, len(wreq.prompt_token_ids))
        self._decided(decision.policy, decision.reason)
        if hashes:
            self._routed.add(hashes, decision.address, now)
        worker = next(w for w in pool if w.address == decision.address)
        return worker, decision

    def _decided(self, policy: str, reason: str) -> None:
        self.decisions[(policy, reason)] += 1
        self.metrics.inc("routing_decisions_total", policy=policy, reason=reason)

    def _failed(self, worker: _Worker, e: grpc.aio.AioRpcError) -> None:
        worker.down_until = time.monotonic() + self.config.down_s
        log.warning("worker %s (%s) failed: %s: %s", worker.address, worker.role,
                    e.code().name, e.details())

    async def generate(
        self, req: api_pb2.GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        """Validated, admitted, routed, relayed, migrated. See the module docstring."""
        received = time.monotonic()
        status = "OK"
        try:
            ids, sampling = self.validate(req)
            if self._in_flight >= self.config.max_in_flight:
                raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"the router has {self._in_flight} requests in flight, its "
                                  f"limit (max_in_flight={self.config.max_in_flight}); retry "
                                  "later")
        except RouterError as e:
            self.metrics.inc("requests_total", status=e.code.name)
            raise
        request_id = req.request_id or f"req-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        relay = _Relay(request_id, ids, received)
        generated: list[int] = []
        migrations = 0
        last_token_at = received
        self._in_flight += 1
        self.metrics.set("requests_in_flight", self._in_flight)
        try:
            while True:
                wreq = self._worker_request(request_id, ids, generated, sampling, req.cache_salt)
                routing = api_pb2.Routing()
                source = (self._disaggregated(wreq, timeout, routing) if self.disaggregated
                          else self._mixed(wreq, timeout, routing))
                try:
                    async for msg in source:
                        if msg.token_ids:
                            now = time.monotonic()
                            if generated:
                                gap = (now - last_token_at) / len(msg.token_ids)
                                for _ in msg.token_ids:
                                    self.metrics.observe("inter_token_latency_seconds", gap)
                            else:
                                self.metrics.observe("time_to_first_token_seconds",
                                                     now - received)
                            last_token_at = now
                            generated.extend(msg.token_ids)
                        out = relay.convert(msg)
                        if msg.finish_reason:
                            self._finish(out, routing, ids, generated, migrations, received)
                        yield out
                    return
                except WorkerFailed as e:
                    if migrations >= self.config.migration_limit:
                        raise
                    migrations += 1
                    self.metrics.inc("request_migrations_total")
                    log.warning("request %s moves to another worker after %d tokens (move %d "
                                "of at most %d): %s", request_id, len(generated), migrations,
                                self.config.migration_limit, e.message)
                finally:
                    await source.aclose()
        except RouterError as e:
            status = e.code.name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = "CANCELLED"
            raise
        except Exception:
            status = "INTERNAL"
            raise
        finally:
            self._in_flight -= 1
            self.metrics.set("requests_in_flight", self._in_flight)
            self.metrics.inc("requests_total", status=status)

    def _worker_request(self, request_id: str, ids: list[int], generated: list[int],
                        sampling: common_pb2.SamplingParams, cache_salt: str
                        ) -> worker_pb2.WorkerGenerateRequest:
        """The request a worker sees: a unique id (this router's nonce and a counter;
        clients may reuse theirs, and one request's cancellation must never reach
        another's); after a migration, the tokens so far continue the prompt."""
        if generated:
            sampling = common_pb2.SamplingParams.FromString(sampling.SerializeToString())
            if sampling.HasField("max_tokens"):
                sampling.max_tokens -= len(generated)
        return worker_pb2.WorkerGenerateRequest(
            request_id=f"{request_id}#{self._nonce}-{next(self._ids)}",
            prompt_token_ids=ids + generated, sampling=sampling, cache_salt=cache_salt)

    def _finish(self, out: api_pb2.GenerateResponse, routing: api_pb2.Routing, ids: list[int],
                generated: list[int], migrations: int, received: float) -> None:
        """The last message: usage over the whole request (a migrated one's last worker
        saw part of the output as prompt), routing, and the request's metrics."""
        out.usage.prompt_tokens = len(ids)
        out.usage.completion_tokens = len(generated)
        out.usage.cached_tokens = min(out.usage.cached_tokens, len(ids))
        routing.migrations = migrations
        out.routing.CopyFrom(routing)
        m = self.metrics
        m.observe("e2e_request_latency_seconds", time.monotonic() - received)
        m.inc("prompt_tokens_total", len(ids))
        m.inc("generation_tokens_total", len(generated))
        m.inc("cached_prompt_tokens_total", out.usage.cached_tokens)

    async def _mixed(self, wreq: worker_pb2.WorkerGenerateRequest, timeout: float | None,
                     routing: api_pb2.Routing
                     ) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        worker, decision = await self._choose("mixed", wreq)
        _record(routing, decision)
        queued = decision.estimated_tokens - worker.queued_tokens
        worker.in_flight += 1
        worker.queued_tokens += queued
        call = None
        try:
            call = worker.stub.Generate(wreq, timeout=timeout)
            async for msg in call:
                if queued and msg.token_ids:
                    worker.queued_tokens -= queued  # prefilled
                    queued = 0
                yield msg
        except grpc.aio.AioRpcError as e:
            if e.code() not in _CALLER_CODES:
                self._failed(worker, e)
            raise _from_worker(e, worker.address) from e
        finally:
            if call is not None:
                call.cancel()  # no-op when finished; frees the worker's blocks otherwise
            worker.in_flight -= 1
            worker.queued_tokens -= queued

    async def _disaggregated(self, wreq: worker_pb2.WorkerGenerateRequest,
                             timeout: float | None, routing: api_pb2.Routing
                             ) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        deadline = None if timeout is None else time.monotonic() + timeout
        decode, call, reservation = await self._reserve(wreq, deadline)
        routing.decode_worker = decode.address
        try:
            prefilled = None
            if reservation.local:
                routing.MergeFrom(api_pb2.Routing(policy=self.policy.name, reason="local",
                                                  worker=decode.address))
                self._decided(self.policy.name, "local")
            else:
                prefilled = await self._prefill(wreq, reservation.target, deadline, routing)
                if prefilled is None:  # compute the whole prompt on the decode worker
                    await _write(call, worker_pb2.DecodeRequest(commit=worker_pb2.DecodeCommit()))
                else:
                    first = prefilled.first
                    if first.finish_reason:  # ended at the first token; cancel frees the rest
                        yield first
                        return
                    # Commit first: a slow consumer must not hold the decode worker back.
                    await _write(call, worker_pb2.DecodeRequest(
                        commit=worker_pb2.DecodeCommit(first_token=first.token_ids[0])))
                    yield worker_pb2.WorkerGenerateResponse(
                        token_ids=first.token_ids, text=first.text, logprobs=first.logprobs)
                await _write(call, None)
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    decode.down_until = time.monotonic() + self.config.down_s
                    raise WorkerFailed(f"decode worker {decode.address} ended the stream early")
                out = msg.output
                if out.finish_reason and prefilled is not None:
                    # The prompt was computed (or reused) on the prefill worker.
                    out.usage.cached_tokens = prefilled.first.usage.cached_tokens
                    out.queue_s = prefilled.first.queue_s
                yield out
                if out.finish_reason:
                    return
        except grpc.aio.AioRpcError as e:
            if e.code() not in _CALLER_CODES:
                self._failed(decode, e)
            raise _from_worker(e, decode.address) from e
        finally:
            call.cancel()  # no-op when finished; frees the reservation otherwise
            decode.in_flight -= 1

    async def _reserve(self, wreq: worker_pb2.WorkerGenerateRequest, deadline: float | None
                       ) -> tuple[_Worker, grpc.aio.StreamStreamCall, worker_pb2.Reservation]:
        """Open Decode on the least-loaded decode worker that answers."""
        errors = []
        for worker in self._by_load("decode"):
            timeout = _left(deadline)
            worker.in_flight += 1
            call = worker.stub.Decode(timeout=timeout)
            try:
                await call.write(worker_pb2.DecodeRequest(start=wreq))
                msg = await call.read()
                if msg is grpc.aio.EOF or msg.WhichOneof("kind") != "reservation":
                    raise RouterError(grpc.StatusCode.UNAVAILABLE,
                                      f"decode worker {worker.address} sent no reservation")
                return worker, call, msg.reservation
            except grpc.aio.AioRpcError as e:
                call.cancel()
                worker.in_flight -= 1
                if e.code() in _CALLER_CODES:
                    raise _from_worker(e, worker.address) from e
                self._failed(worker, e)
                errors.append(f"{worker.address}: {e.code().name}")
            except BaseException:
                call.cancel()
                worker.in_flight -= 1
                raise
        raise RouterError(grpc.StatusCode.UNAVAILABLE,
                          f"no decode worker could take the request ({'; '.join(errors)}); "
                          "retry later")

    async def _prefill(self, wreq: worker_pb2.WorkerGenerateRequest,
                       target: worker_pb2.KVTarget, deadline: float | None,
                       routing: api_pb2.Routing) -> worker_pb2.PrefillResponse | None:
        """The first token from the prefill worker the policy picks; None when it failed
        (the caller recomputes on the decode worker). Bad input raises."""
        worker, decision = await self._choose("prefill", wreq)
        _record(routing, decision)
        timeout = _left(deadline)
        queued = decision.estimated_tokens - worker.queued_tokens
        worker.in_flight += 1
        worker.queued_tokens += queued
        try:
            return await worker.stub.Prefill(
                worker_pb2.PrefillRequest(request=wreq, target=target), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() in _CALLER_CODES:
                raise _from_worker(e, worker.address) from e
            self._failed(worker, e)
            return None
        finally:
            worker.in_flight -= 1
            worker.queued_tokens -= queued

    async def status(self) -> api_pb2.GetStatusResponse:
        resp = api_pb2.GetStatusResponse(
            model=self.model_name, requests_in_flight=self._in_flight,
            max_requests_in_flight=self.config.max_in_flight,
            routing_decisions={f"{p}/{r}": n for (p, r), n in self.decisions.items()},
            prefix_index_up=self._index is not None and not self._redis_down)
        for w in self._workers:
            try:
                load = await w.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=2)
                resp.workers.append(api_pb2.WorkerStatus(
                    address=w.address, role=load.role, serving=True,
                    running_requests=load.running_requests,
                    waiting_requests=load.waiting_requests, free_blocks=load.free_blocks,
                    total_blocks=load.total_blocks, reserved_requests=load.reserved_requests,
                    transfers=load.transfers, prompt_tokens=load.prompt_tokens,
                    cached_prompt_tokens=load.cached_prompt_tokens))
            except grpc.aio.AioRpcError:
                resp.workers.append(api_pb2.WorkerStatus(address=w.address, serving=False))
        return resp


_CALLER_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED,
                 grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED)
"""Worker answers about the request or its caller, not about the worker's health."""


async def _write(call: grpc.aio.StreamStreamCall, msg: worker_pb2.DecodeRequest | None) -> None:
    """Write (None: done writing); a call the worker already ended raises its status."""
    try:
        await (call.done_writing() if msg is None else call.write(msg))
    except asyncio.InvalidStateError:
        await call.wait_for_connection()  # raises AioRpcError with the call's status
        raise grpc.aio.AioRpcError(await call.code(), grpc.aio.Metadata(),
                                   grpc.aio.Metadata(), await call.details()) from None


def _record(routing: api_pb2.Routing, d: Decision) -> None:
    routing.MergeFrom(api_pb2.Routing(policy=d.policy, reason=d.reason, worker=d.address,
                                      indexed_cached_tokens=d.cached_tokens,
                                      estimated_prefill_tokens=d.estimated_tokens))


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
    return left


def _from_worker(e: grpc.aio.AioRpcError, address: str) -> RouterError:
    code = e.code()
    if code in _CALLER_CODES:
        return RouterError(code, e.details() or code.name)
    return WorkerFailed(f"worker {address} failed: {code.name}: {e.details()}; retry the "
                        "request")
