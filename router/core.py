"""The router's request path, shared by the gRPC API and the OpenAI HTTP front.

Lifecycle of a request: validate (prompt present, sampling values, length against the
model's context) and tokenize (chat template for messages) -> admit (at most
``max_in_flight`` at once; beyond it RESOURCE_EXHAUSTED at once, never a queue that
hangs) -> pick the least-loaded worker (fewest requests this router has in flight there)
-> stream the worker's tokens back, adding prompt ids first and usage/timings last.
When the consumer stops early (client cancelled or disconnected, deadline passed) the
worker call is cancelled, and the worker aborts the request and frees its KV blocks.
Workers that fail to answer are reported as UNAVAILABLE; the router never guesses.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from transformers import AutoTokenizer

from cluster.sampling import InvalidRequestError, check_prompt
from cluster.wire import sampling_from_proto
from protos.pdserve.v1 import api_pb2, common_pb2, worker_pb2, worker_pb2_grpc

from .errors import RouterError


@dataclass(frozen=True)
class RouterConfig:
    workers: tuple[str, ...]
    model_path: str  # tokenizer and chat template come from here
    model_name: str
    max_in_flight: int = 256
    connect_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("the router needs at least one worker address")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")


@dataclass
class _Worker:
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    in_flight: int = 0


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.model_name = config.model_name
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.max_model_len = 0
        self._workers: list[_Worker] = []
        self._in_flight = 0
        self._ids = itertools.count()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def start(self) -> None:
        """Connect to every worker and wait until each answers (loading takes a while)."""
        for address in self.config.workers:
            channel = grpc.aio.insecure_channel(address)
            self._workers.append(_Worker(address, channel, worker_pb2_grpc.WorkerStub(channel)))
        deadline = time.monotonic() + self.config.connect_timeout_s
        loads = []
        for w in self._workers:
            while True:
                try:
                    loads.append(await w.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5))
                    break
                except grpc.aio.AioRpcError as e:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"worker {w.address} did not answer within "
                                           f"{self.config.connect_timeout_s:.0f}s: "
                                           f"{e.details()}") from e
                    await asyncio.sleep(0.5)
        self.max_model_len = min(load.max_model_len for load in loads)

    async def close(self) -> None:
        for w in self._workers:
            await w.channel.close()

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

    def _pick(self) -> _Worker:
        return min(self._workers, key=lambda w: w.in_flight)

    async def generate(
        self, req: api_pb2.GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        """Validated, admitted, routed, relayed. See the module docstring."""
        received = time.monotonic()
        ids, sampling = self.validate(req)
        if self._in_flight >= self.config.max_in_flight:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the router has {self._in_flight} requests in flight, its limit "
                              f"(max_in_flight={self.config.max_in_flight}); retry later")
        request_id = req.request_id or f"req-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        # Workers see a router-unique id: clients may reuse theirs, and one request's
        # cancellation must never reach another's.
        worker_request_id = f"{request_id}#{next(self._ids)}"
        worker = self._pick()
        self._in_flight += 1
        worker.in_flight += 1
        call = None
        first = True
        first_token_at: float | None = None
        try:
            call = worker.stub.Generate(
                worker_pb2.WorkerGenerateRequest(
                    request_id=worker_request_id, prompt_token_ids=ids, sampling=sampling,
                    cache_salt=req.cache_salt),
                timeout=timeout,
            )
            async for msg in call:
                out = api_pb2.GenerateResponse(request_id=request_id, token_ids=msg.token_ids,
                                               text=msg.text, logprobs=msg.logprobs)
                if first:
                    out.prompt_token_ids.extend(ids)
                    first = False
                if first_token_at is None and msg.token_ids:
                    first_token_at = time.monotonic()
                if msg.finish_reason:
                    now = time.monotonic()
                    out.finish_reason = msg.finish_reason
                    out.usage.CopyFrom(msg.usage)
                    out.timings.CopyFrom(common_pb2.Timings(
                        ttft_s=(first_token_at or now) - received, e2e_s=now - received,
                        queue_s=msg.queue_s))
                yield out
        except grpc.aio.AioRpcError as e:
            raise _from_worker(e, worker.address) from e
        finally:
            if call is not None:
                call.cancel()  # no-op when finished; frees the worker's blocks otherwise
            self._in_flight -= 1
            worker.in_flight -= 1

    async def status(self) -> api_pb2.GetStatusResponse:
        resp = api_pb2.GetStatusResponse(model=self.model_name, requests_in_flight=self._in_flight,
                                         max_requests_in_flight=self.config.max_in_flight)
        for w in self._workers:
            try:
                load = await w.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=2)
                resp.workers.append(api_pb2.WorkerStatus(
                    address=w.address, role=load.role, serving=True,
                    running_requests=load.running_requests,
                    waiting_requests=load.waiting_requests, free_blocks=load.free_blocks,
                    total_blocks=load.total_blocks))
            except grpc.aio.AioRpcError:
                resp.workers.append(api_pb2.WorkerStatus(address=w.address, serving=False))
        return resp


def _from_worker(e: grpc.aio.AioRpcError, address: str) -> RouterError:
    code = e.code()
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return RouterError(code, e.details() or code.name)
    return RouterError(grpc.StatusCode.UNAVAILABLE,
                       f"worker {address} failed: {code.name}: {e.details()}; retry the request")
