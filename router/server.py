"""``pdserve router``: the public gRPC API and the OpenAI HTTP front on one event loop.

Lifecycle: load the tokenizer, connect to the workers and wait until they answer, bind
gRPC (with health checking and reflection), HTTP and Prometheus ``/metrics`` on
127.0.0.1, mark SERVING, serve until SIGINT/SIGTERM (or until the launcher sets
``stop``: a Ray actor), then mark NOT_SERVING and drain for a couple of seconds.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.metrics import Metrics
from protos.pdserve.v1 import api_pb2, api_pb2_grpc

from .core import Router, RouterConfig
from .errors import RouterError

MAX_MESSAGE_BYTES = 8 * 2**20


@dataclass(frozen=True)
class ServerConfig:
    router: RouterConfig
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int | None = 8000
    metrics_port: int | None = None
    """Serve Prometheus ``/metrics`` here (0: any free port); None: no endpoint."""
    ray_metrics: bool = False
    """Mirror the metrics into ``ray.util.metrics`` (inside a Ray actor)."""


@dataclass(frozen=True)
class Serving:
    """What a started router tells whoever launched it."""

    address: str
    http_port: int | None
    metrics_port: int | None


class PDServeServicer(api_pb2_grpc.PDServeServicer):
    def __init__(self, router: Router) -> None:
        self._router = router

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        try:
            async for msg in self._router.generate(request, context.time_remaining()):
                yield msg
        except RouterError as e:
            await context.abort(e.code, e.message)

    async def ListModels(self, request, context):  # noqa: N802
        return api_pb2.ListModelsResponse(models=[api_pb2.ModelInfo(
            id=self._router.model_name, max_model_len=self._router.max_model_len)])

    async def Tokenize(self, request, context):  # noqa: N802
        if request.model and request.model != self._router.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"model: {request.model!r} is not served here")
        try:
            return api_pb2.TokenizeResponse(token_ids=self._router.tokenize(request))
        except RouterError as e:
            await context.abort(e.code, e.message)

    async def GetStatus(self, request, context):  # noqa: N802
        return await self._router.status()


async def serve(config: ServerConfig, on_ready: Callable[[Serving], None] | None = None,
                stop: asyncio.Event | None = None) -> None:
    metrics = Metrics({"model": config.router.model_name}, ray=config.ray_metrics)
    router = Router(config.router, metrics)
    await router.start()
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)])
    api_pb2_grpc.add_PDServeServicer_to_server(PDServeServicer(router), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (api_pb2.DESCRIPTOR.services_by_name["PDServe"].full_name,
         health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"router could not bind {address}: is the port in use?")
    await server.start()
    runner = None
    if config.http_port is not None:
        from .openai import create_app

        runner = web.AppRunner(create_app(router, max_body_bytes=MAX_MESSAGE_BYTES))
        await runner.setup()
        await web.TCPSite(runner, config.host, config.http_port).start()
    metrics_port = (metrics.serve(config.metrics_port, config.host)
                    if config.metrics_port is not None else None)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    http = f", HTTP on {config.host}:{config.http_port}" if runner else ""
    print(f"pdserve router serving {router.model_name} on {address}{http} "
          f"({len(router.pool('prefill') + router.pool('decode') + router.pool('mixed'))} "
          "workers" + (f"; metrics on :{metrics_port}" if metrics_port else "") + ")",
          file=sys.stderr, flush=True)
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    if on_ready is not None:
        on_ready(Serving(address, config.http_port if runner else None, metrics_port))
    await stop.wait()
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=2)
    if runner is not None:
        await runner.cleanup()
    await router.close()
    metrics.close()
