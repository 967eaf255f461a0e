"""One error type for everything the router refuses, carrying its gRPC status.

The gRPC server aborts with ``code`` and ``message``; the OpenAI HTTP front maps the same
codes to HTTP statuses (see :data:`HTTP_STATUS`), so both APIs say the same thing.
Messages name the field, the value and the limit, and say what to do.

What leaves the router: a refusal of the client's request (a 4xx) is told as it is. A
failure inside the cluster (a 5xx: a worker died, an exception in the router) carries
worker addresses, worker error text or exception text, none of which is the client's
business: :func:`to_public` logs it with the request id and gives the client a fixed
message naming that id (:func:`internal_error` for an exception that is no RouterError).
Both edges, gRPC and HTTP, answer through them.
"""

from __future__ import annotations

import logging

import grpc

log = logging.getLogger(__name__)


class RouterError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None, *,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s
        """RESOURCE_EXHAUSTED: when to try again (HTTP ``Retry-After``, gRPC trailing
        metadata ``retry-after``), in whole seconds."""


class WorkerFailed(RouterError):
    """A worker failed the request (died, transport error, ended its stream early): the
    request itself was fine and may move to another worker."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
}


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)


RETRY_AFTER_METADATA = "retry-after"
"""The gRPC trailing metadata key carrying :attr:`RouterError.retry_after_s`."""

_PUBLIC_5XX = {
    grpc.StatusCode.UNAVAILABLE: "no worker could serve the request right now; retry later "
                                 "(the router log has details under request {id})",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the request's deadline passed (request {id})",
}


def internal_error(request_id: str) -> RouterError:
    """What the client is told about a failure it cannot act on; the details are in the
    router's log under ``request_id``."""
    return RouterError(grpc.StatusCode.INTERNAL,
                       f"internal error; see the router log for request {request_id}")


def to_public(exc: BaseException, request_id: str) -> RouterError:
    """``exc`` as the client may see it (see the module docstring). A 4xx RouterError is
    returned as it is; anything else is logged here, with ``request_id``, and replaced by a
    fixed message of the same code (INTERNAL for an exception that is no RouterError)."""
    if isinstance(exc, RouterError):
        if http_status(exc.code) < 500:
            return exc
        log.warning("request %s failed: %s: %s", request_id, exc.code.name, exc.message)
        text = _PUBLIC_5XX.get(exc.code)
        if text is None:
            return internal_error(request_id)
        return RouterError(exc.code, text.format(id=request_id), exc.field)
    log.error("request %s failed with an unexpected exception", request_id,
              exc_info=(type(exc), exc, exc.__traceback__))
    return internal_error(request_id)
