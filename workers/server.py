"""``pdserve worker``: one engine served over the internal gRPC API.

Lifecycle: load the model and allocate the KV cache (the slow part), start the engine
thread, bind 127.0.0.1:PORT, mark gRPC health SERVING, serve until SIGINT/SIGTERM, then
mark NOT_SERVING, stop accepting, abort what is left (freeing its blocks) and exit.
A ``Generate`` call is a server stream; when the caller cancels or its deadline passes,
gRPC cancels the handler and the engine loop aborts the request at once.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.sampling import InvalidRequestError
from cluster.wire import FINISH_REASONS, sampling_from_proto
from protos.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from .engine.llm_engine import LLMEngine, RequestOutput
from .engine.params import EngineConfig
from .engine_loop import EngineLoop

ROLES = ("mixed",)  # prefill and decode arrive with disaggregation


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig
    model_name: str
    role: str = "mixed"
    host: str = "127.0.0.1"
    port: int = 50061

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


def to_proto(out: RequestOutput, first_index: int) -> worker_pb2.WorkerGenerateResponse:
    msg = worker_pb2.WorkerGenerateResponse(token_ids=out.new_token_ids, text=out.delta_text)
    if out.logprobs is not None:
        for lp in out.logprobs[first_index:]:
            msg.logprobs.append(common_pb2.TokenLogprob(
                token_id=lp.token_id, logprob=lp.logprob,
                top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]))
    if out.finished:
        msg.finish_reason = FINISH_REASONS[out.finish_reason or "abort"]
        msg.usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(out.token_ids),
            cached_tokens=out.num_cached_tokens))
        if out.first_token_time is not None:
            msg.queue_s = max(0.0, out.first_token_time - out.arrival_time)
    return msg


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, loop: EngineLoop, config: WorkerConfig) -> None:
        self._loop = loop
        self._config = config

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        try:
            params = sampling_from_proto(request.sampling)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        sent_logprobs = 0
        try:
            async for out in self._loop.generate(
                request.request_id, list(request.prompt_token_ids), params,
                request.cache_salt or None,
            ):
                yield to_proto(out, sent_logprobs)
                sent_logprobs = len(out.logprobs or ())
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def GetLoad(self, request, context):  # noqa: N802
        load = self._loop.load()
        engine = self._loop.engine
        return worker_pb2.WorkerLoad(
            role=self._config.role, model=self._config.model_name,
            running_requests=load.running, waiting_requests=load.waiting,
            free_blocks=load.free_blocks, total_blocks=load.total_blocks,
            max_model_len=engine.max_model_len)


async def serve(config: WorkerConfig, ready: asyncio.Event | None = None) -> None:
    engine = LLMEngine(config.engine)
    loop = EngineLoop(engine)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(loop, config), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{config.host}:{config.port}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"worker could not bind {address}: is the port in use?")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"pdserve worker ({config.role}) serving {config.model_name} on {address} "
          f"({engine.scheduler.block_manager.num_blocks} KV blocks)", file=sys.stderr,
          flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=2)
    loop.close()
