"""Router messages out as OpenAI objects (the shaping half of lifecycle step 5).

Nothing here does I/O: these functions build the dicts and bytes that :mod:`.app` sends.

5. **Answer.** Non-streaming: the accumulated messages become one ``text_completion`` /
   ``chat.completion`` body (:meth:`.render.Renderer.body`, which also renders choices,
   ``best_of``, ``echo`` and prompt logprobs). Streaming: one ``data: {chunk}`` event
   per router message that carries text, logprobs or the finish reason (chat's first chunk
   carries ``role: "assistant"``), then, with ``stream_options.include_usage``, a chunk
   with ``choices: []`` and the usage (every other chunk then has ``usage: null``), then
   ``data: [DONE]``. Usage reports the router's ``prompt_tokens``, ``completion_tokens``
   and ``cached_tokens`` (as ``prompt_tokens_details.cached_tokens``).

With tools offered (:mod:`.tools`), the text goes through the request's tool-call reader
(:mod:`.tool_parsers`): the message has ``content`` (null when empty) and, when calls were
read, ``tool_calls`` (``{"id", "type": "function", "function": {"name", "arguments"}}``,
``arguments`` a JSON string) and ``finish_reason: "tool_calls"`` (unless the output was cut
short: ``length`` stays). Streamed, as OpenAI does: a call's first delta is
``tool_calls: [{"index", "id", "type", "function": {"name", "arguments": ""}}]``, then
``{"index", "function": {"arguments": <piece>}}`` deltas; content deltas as usual; text
the reader holds back goes out when it is decided (so one router message may make several
chunks, or none; its logprobs then ride on an empty delta).

Errors take OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: a
:class:`RouterError` keeps the HTTP status of its gRPC code (:func:`router.errors.http_status`),
its field as ``param`` and the code's name as ``code`` (``model_not_found`` for an unknown
model) and, over a limit, a ``Retry-After`` header; any other exception is a 500
``internal``. A 5xx never says more than a fixed message naming the request id: the
details are logged (:func:`router.errors.to_public`). After a stream started, the same
body is sent as an SSE event.

Logprobs are rendered with token strings from the router's optional
``token_strings(ids) -> list[str]`` (each token decoded on its own), else from its
``tokenizer.batch_decode`` (a Hugging Face tokenizer), else a token reads
``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids`` form). Completions'
``text_offset`` counts those strings' lengths from the start of the completion, and
``top_logprobs`` holds the alternatives plus the sampled token (vLLM's convention). A
``-inf``/NaN logprob reads ``LOGPROB_FLOOR`` (JSON has no infinity).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import grpc

from protos.pdserve.v1 import common_pb2
from router.errors import RouterError, http_status, to_public

from .protocol import ApiError, RouterLike, dumps_event

LOGPROB_FLOOR = -9999.0  # what a -inf / NaN logprob is reported as (JSON has no inf)

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + dumps_event(obj).encode() + b"\n\n"


# --------------------------------------------------------------------------- errors


def _error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status == 504:
        return "timeout_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": _error_type(status), "param": param,
                      "code": code}}


def api_error_body(err: ApiError) -> dict[str, Any]:
    """:func:`error_body` of an :class:`ApiError`."""
    return error_body(err.status, err.message, err.param, err.code)


def _from_router_error(exc: RouterError) -> ApiError:
    code = exc.code.name.lower() if isinstance(exc.code, grpc.StatusCode) else None
    if exc.code == grpc.StatusCode.NOT_FOUND and exc.field == "model":
        code = "model_not_found"
    headers = ({"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None
               else None)
    return ApiError(http_status(exc.code), exc.message, exc.field, code, headers)


def as_api_error(exc: BaseException, request_id: str) -> ApiError:
    """Any failure as the status, message, param and code the client is told; a 5xx is
    logged under ``request_id`` and told only that."""
    if isinstance(exc, ApiError):
        return exc
    return _from_router_error(to_public(exc, request_id))


# --------------------------------------------------------------------------- token strings


@runtime_checkable
class TokenStringsLike(Protocol):
    """Optional router method: each token id decoded on its own, for logprobs."""

    def token_strings(self, token_ids: Sequence[int]) -> list[str]: ...


def _token_id_strings(ids: Sequence[int]) -> list[str]:
    return [f"token_id:{i}" for i in ids]


def token_strings_of(router: RouterLike) -> Callable[[Sequence[int]], list[str]]:
    """``router.token_strings``, else each id decoded alone by ``router.tokenizer`` (a
    Hugging Face tokenizer), else ``"token_id:<id>"``."""
    if isinstance(router, TokenStringsLike):
        return router.token_strings
    tokenizer = getattr(router, "tokenizer", None)
    batch_decode = getattr(tokenizer, "batch_decode", None)
    if callable(batch_decode):
        return lambda ids: list(batch_decode([[i] for i in ids]))
    return _token_id_strings
