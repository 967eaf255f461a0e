"""The gRPC server's edge: who may call what, and requests protobuf refuses.

Every call passes :class:`EdgeInterceptor` before its handler runs:

1. ``grpc.health.v1.Health/*`` passes untouched: probes carry no keys.
2. With a key file, every other method (the public ``pdserve.v1.PDServe`` service,
   reflection, and names no service has, so a missing key never tells which methods
   exist) needs ``authorization: Bearer KEY`` metadata: none or an unknown key is
   UNAUTHENTICATED; a method of :data:`ADMIN_METHODS` with a key lacking ``admin`` is
   PERMISSION_DENIED. A refused call's body is never parsed.
3. The caller (:class:`router.auth.Principal`; None without a key file) is set in a
   context variable for the handler (:func:`current_caller`); each RPC runs in its own
   task, so it is the call's alone.
4. For the public service's methods the interceptor parses the request itself: a
   message protobuf refuses (a string field that is not UTF-8) is INVALID_ARGUMENT
   naming the field (:func:`router.edge.bad_utf8_field`), where grpc would answer a
   bare error of its own.

Answers about the handlers' own failures (generic 5xx messages) are the servicer's
(:mod:`router.server`).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from protos.pdserve.v1 import api_pb2

from .auth import KeyStore, Principal, bearer_key
from .edge import bad_utf8_field

PUBLIC_SERVICE = api_pb2.DESCRIPTOR.services_by_name["PDServe"]
HEALTH_PREFIX = "/grpc.health.v1.Health/"
ADMIN_METHODS = frozenset({f"/{PUBLIC_SERVICE.full_name}/GetStatus"})
"""Methods only admin keys may call: the status names every worker and its load."""

_CALLER: ContextVar[Principal | None] = ContextVar("pdserve_caller", default=None)

MISSING_KEY = ("this router needs an API key: send metadata `authorization: Bearer KEY`")
UNKNOWN_KEY = "the API key is not valid"


def current_caller() -> Principal | None:
    """The caller of the RPC being handled (None: the router has no key file)."""
    return _CALLER.get()


class EdgeInterceptor(grpc.aio.ServerInterceptor):
    """See the module docstring. ``keys`` None: no authentication (everyone may call)."""

    def __init__(self, keys: KeyStore | None) -> None:
        self._keys = keys
        self._inputs = {f"/{PUBLIC_SERVICE.full_name}/{m.name}": m.input_type
                        for m in PUBLIC_SERVICE.methods}

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if method.startswith(HEALTH_PREFIX):
            return handler
        caller = None
        if self._keys is not None:
            key = bearer_key(_metadata(handler_call_details, "authorization"))
            caller = self._keys.authenticate(key)
            if caller is None:
                return _deny(handler, grpc.StatusCode.UNAUTHENTICATED,
                             UNKNOWN_KEY if key else MISSING_KEY)
            if method in ADMIN_METHODS and not caller.admin:
                return _deny(handler, grpc.StatusCode.PERMISSION_DENIED,
                             f"{method.rsplit('/', 1)[-1]} needs an admin key (the key of "
                             f"tenant {caller.tenant!r} is not one)")
        if handler is None:
            return None
        return _wrap(handler, caller, self._inputs.get(method))


def _metadata(details: grpc.HandlerCallDetails, name: str) -> str | None:
    for key, value in details.invocation_metadata or ():
        if key == name:
            return value if isinstance(value, str) else None
    return None


def _deny(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode,
          message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that answers ``code`` without reading the request."""

    async def deny(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    if handler is None or not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(deny)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    return grpc.unary_stream_rpc_method_handler(deny)


def _wrap(handler: grpc.RpcMethodHandler, caller: Principal | None,
          input_type: Any) -> grpc.RpcMethodHandler:
    """``handler`` run with the caller set; for a public unary-request method, parsing
    the request here (see the module docstring)."""
    serialize = handler.response_serializer
    if handler.request_streaming:  # reflection: nothing of ours to parse
        inner = handler.stream_stream or handler.stream_unary
        make = (grpc.stream_stream_rpc_method_handler if handler.response_streaming
                else grpc.stream_unary_rpc_method_handler)
        deserialize = handler.request_deserializer
    else:
        inner = handler.unary_stream or handler.unary_unary
        make = (grpc.unary_stream_rpc_method_handler if handler.response_streaming
                else grpc.unary_unary_rpc_method_handler)
        deserialize = None if input_type is not None else handler.request_deserializer
    parse = handler.request_deserializer if input_type is not None else None

    async def request_of(raw: Any, context: grpc.aio.ServicerContext) -> Any:
        _CALLER.set(caller)
        if parse is None:
            return raw
        try:
            return parse(raw)
        except DecodeError:
            field = bad_utf8_field(raw, input_type)
            what = (f"{field}: not valid UTF-8 text" if field
                    else f"the request is not a valid {input_type.full_name} message")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, what)

    if inspect.isasyncgenfunction(inner):
        async def streaming(raw: Any, context: grpc.aio.ServicerContext) -> Any:
            request = await request_of(raw, context)
            async for msg in inner(request, context):
                yield msg

        return make(streaming, deserialize, serialize)

    async def unary(raw: Any, context: grpc.aio.ServicerContext) -> Any:
        return await inner(await request_of(raw, context), context)

    return make(unary, deserialize, serialize)
