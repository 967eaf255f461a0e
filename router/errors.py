"""One error type for everything the router refuses, carrying its gRPC status.

The gRPC server aborts with ``code`` and ``message``; the OpenAI HTTP front maps the same
codes to HTTP statuses (see :data:`HTTP_STATUS`), so both APIs say the same thing.
Messages name the field, the value and the limit, and say what to do.
"""

from __future__ import annotations

import grpc


class RouterError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


class WorkerFailed(RouterError):
    """A worker failed the request (died, transport error, ended its stream early): the
    request itself was fine and may move to another worker."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
}


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)
