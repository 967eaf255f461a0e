"""``pdserve router``: the public gRPC API and the OpenAI HTTP front on one event loop.

Lifecycle: load the API keys (if a key file is given; a bad file stops the start), load
the tokenizer, connect to the workers and wait until they answer, bind gRPC (with health
checking and reflection), HTTP and Prometheus ``/metrics`` on ``host``, mark SERVING,
serve until SIGINT/SIGTERM (or until the launcher sets ``stop``: a Ray actor), then mark
NOT_SERVING and drain for a couple of seconds.

Trust boundary: every gRPC call passes :class:`router.interceptor.EdgeInterceptor`
(API keys, admin-only methods, requests protobuf refuses), every HTTP request the
OpenAI front's middleware (the same rules). Health checks are open. The servicer
answers a failure inside the cluster with a fixed message naming the request id
(:func:`router.errors.to_public`), never with exception or worker text. Messages are
bounded by :data:`common.wire.MAX_MESSAGE_BYTES` both ways, as on the workers.

What stays outside: the Prometheus listener on ``metrics_port`` (``common.metrics``, a
``prometheus_client`` HTTP server on its own thread) has no authentication; with keys,
serve no ``metrics_port`` beyond a trusted network and scrape ``/metrics`` on the HTTP
port with an admin key (or ``metrics_public``) instead.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.metrics import Metrics
from common.tls import ClusterTLS, ServerTLS
from common.wire import MAX_MESSAGE_BYTES
from protos.pdserve.v1 import api_pb2, api_pb2_grpc

from .auth import KeyStore
from .core import Router, RouterConfig
from .errors import RETRY_AFTER_METADATA, to_public
from .interceptor import EdgeInterceptor, current_caller
from .pool import grpc_connect

log = logging.getLogger(__name__)

GRPC_OPTIONS = (("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0))


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
    api_keys_file: str | None = None
    """The API key file (:mod:`router.auth`); None: no authentication."""
    metrics_public: bool = False
    """``/metrics`` on the HTTP port without a key (else it needs an admin key)."""
    tool_call_parser: str = "hermes"
    """How tool calls are written in prompts and read from outputs (the HTTP front's
    :data:`router.openai.tool_parsers.PARSERS`)."""
    tls: ServerTLS | None = None
    """TLS on the public gRPC and HTTP ports (no client certificates asked); None:
    plaintext."""
    cluster_tls: ClusterTLS | None = None
    """Mutual TLS on the channels to the workers; None: plaintext."""


@dataclass(frozen=True)
class Serving:
    """What a started router tells whoever launched it."""

    address: str
    http_port: int | None
    metrics_port: int | None


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException,
                 request_id: str) -> None:
    """Answer the call with ``exc`` as the client may see it (raises, as abort does)."""
    e = to_public(exc, request_id)
    trailing = (((RETRY_AFTER_METADATA, str(e.retry_after_s)),)
                if e.retry_after_s is not None else ())
    await context.abort(e.code, e.message, trailing_metadata=trailing)


class PDServeServicer(api_pb2_grpc.PDServeServicer):
    """The public API over a :class:`Router`; each method answers every failure through
    :func:`_abort` (CancelledError, the client gone, passes)."""

    def __init__(self, router: Router) -> None:
        self._router = router

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        if not request.request_id:  # named now, so a failure is logged under it
            request.request_id = self._router.new_request_id()
        try:
            async for msg in self._router.generate(request, context.time_remaining(),
                                                   caller=current_caller()):
                self._router.count_sent("grpc", msg.ByteSize())
                yield msg
        except Exception as e:  # noqa: BLE001 - every failure leaves through _abort
            await _abort(context, e, request.request_id)

    async def ListModels(self, request, context):  # noqa: N802
        return api_pb2.ListModelsResponse(models=[api_pb2.ModelInfo(
            id=self._router.model_name, max_model_len=self._router.max_model_len)])

    async def Tokenize(self, request, context):  # noqa: N802
        if request.model and request.model != self._router.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"model: {request.model[:100]!r} is not served here")
        request_id = self._router.new_request_id()
        try:
            return api_pb2.TokenizeResponse(
                token_ids=await self._router.tokenize_as(request, current_caller()))
        except Exception as e:  # noqa: BLE001
            await _abort(context, e, request_id)

    async def GetStatus(self, request, context):  # noqa: N802
        try:
            return await self._router.status()
        except Exception as e:  # noqa: BLE001
            await _abort(context, e, self._router.new_request_id())


def grpc_server(router: Router, keys: KeyStore | None
                ) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """The public service, health checking and reflection behind the edge interceptor
    (``keys`` None: no authentication); not bound or started yet."""
    server = grpc.aio.server(interceptors=[EdgeInterceptor(keys)], options=list(GRPC_OPTIONS))
    api_pb2_grpc.add_PDServeServicer_to_server(PDServeServicer(router), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (api_pb2.DESCRIPTOR.services_by_name["PDServe"].full_name,
         health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    return server, health_servicer


async def serve(config: ServerConfig, on_ready: Callable[[Serving], None] | None = None,
                stop: asyncio.Event | None = None) -> None:
    keys = KeyStore(config.api_keys_file) if config.api_keys_file else None
    metrics = Metrics({"model": config.router.model_name}, ray=config.ray_metrics)
    router = Router(config.router, metrics, connect=partial(grpc_connect, tls=config.cluster_tls))
    await router.start()
    server, health_servicer = grpc_server(router, keys)
    address = f"{config.host}:{config.port}"
    bound = (server.add_secure_port(address, config.tls.grpc_credentials()) if config.tls
             else server.add_insecure_port(address))
    if bound == 0:
        raise OSError(f"router could not bind {address}: is the port in use?")
    await server.start()
    runner = None
    if config.http_port is not None:
        from .openai import create_app

        runner = web.AppRunner(create_app(router, max_body_bytes=MAX_MESSAGE_BYTES, keys=keys,
                                          metrics_text=metrics.text,
                                          metrics_public=config.metrics_public,
                                          tool_format=config.tool_call_parser),
                                 auto_decompress=False)  # compressed bodies: 415, see app
        await runner.setup()
        await web.TCPSite(runner, config.host, config.http_port,
                          ssl_context=config.tls.ssl_context() if config.tls else None).start()
    metrics_port = (metrics.serve(config.metrics_port, config.host)
                    if config.metrics_port is not None else None)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    _log_trust(keys, config, metrics_port)
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


def _log_trust(keys: KeyStore | None, config: ServerConfig, metrics_port: int | None) -> None:
    """Say at start whom this router serves."""
    if keys is None:
        log.warning("serving WITHOUT authentication (no --api-keys file): any client that "
                    "reaches %s may call every route and see worker addresses", config.host)
        return
    log.info("API keys from %s: %d keys, %d tenants; reloaded when the file changes",
             keys.path, len(keys), len(keys.tenants))
    if metrics_port is not None:
        log.warning("the Prometheus listener on %s:%d has no authentication; the HTTP "
                    "port's /metrics %s", config.host, metrics_port,
                    "is open too (--metrics-public)" if config.metrics_public
                    else "needs an admin key")
