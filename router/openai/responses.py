"""Router messages out as OpenAI objects (the shaping half of lifecycle step 5).

Nothing here does I/O: these functions build the dicts and bytes that :mod:`.app` sends.

5. **Answer.** Non-streaming: the accumulated messages become one ``text_completion`` /
   ``chat.completion`` body (:meth:`Renderer.body`). Streaming: one ``data: {chunk}`` event
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

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import grpc

from protos.pdserve.v1 import api_pb2, common_pb2
from router.errors import RouterError, http_status, to_public

from .protocol import ApiError, Call, RouterLike, dumps
from .tool_parsers import Arguments, CallStart, Content, Event, ToolStream, fold

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
    return b"data: " + dumps(obj).encode() + b"\n\n"


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


# --------------------------------------------------------------------------- rendering


def _lp(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


class Renderer:
    """Turns router messages into OpenAI chunks / bodies for one request."""

    def __init__(self, call: Call, token_strings: Callable[[Sequence[int]], list[str]]) -> None:
        self.call = call
        self.token_strings = token_strings
        self.text_offset = 0  # completions logprobs: where the next token starts
        self.sent_role = False
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.usage: common_pb2.Usage | None = None
        self.finish_reason: str | None = None
        self.tool_stream: ToolStream | None = None
        if call.tools is not None and call.tool_parser is not None:
            self.tool_stream = call.tool_parser.stream(call.tools.names, call.tools.forced)
        self.called = False
        """A tool call was read (the finish reason is then ``tool_calls``)."""

    # -- bookkeeping shared by both modes

    def observe(self, msg: api_pb2.GenerateResponse) -> None:
        if msg.prompt_token_ids:
            self.prompt_tokens = len(msg.prompt_token_ids)
        self.completion_tokens += len(msg.token_ids)
        if msg.HasField("usage"):
            self.usage = msg.usage
        if msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = FINISH_REASONS.get(msg.finish_reason, "abort")

    def _finish_reason(self) -> str | None:
        if self.called and self.finish_reason == "stop":
            return "tool_calls"
        return self.finish_reason

    def usage_json(self) -> dict[str, Any]:
        if self.usage is not None:
            p, c, k = (self.usage.prompt_tokens, self.usage.completion_tokens,
                       self.usage.cached_tokens)
        else:
            p, c, k = self.prompt_tokens, self.completion_tokens, 0
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": k}}

    # -- logprobs

    def _strings(self, entries: Sequence[common_pb2.TokenLogprob]) -> tuple[list[str], list[str]]:
        ids = [e.token_id for e in entries]
        top_ids = [t.token_id for e in entries for t in e.top]
        strings = self.token_strings(ids + top_ids)
        return strings[:len(ids)], strings[len(ids):]

    def completion_logprobs(self, entries: Sequence[common_pb2.TokenLogprob]) -> dict[str, Any]:
        tokens, top_strings = self._strings(entries)
        out: dict[str, Any] = {"tokens": tokens, "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        k = 0
        for e, tok in zip(entries, tokens, strict=True):
            top: dict[str, float] = {}
            for t in e.top:
                top[top_strings[k]] = _lp(t.logprob)
                k += 1
            top.setdefault(tok, _lp(e.logprob))
            out["token_logprobs"].append(_lp(e.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(tok)
        return out

    def chat_logprobs(self, entries: Sequence[common_pb2.TokenLogprob]) -> list[dict[str, Any]]:
        tokens, top_strings = self._strings(entries)
        content = []
        k = 0
        for e, tok in zip(entries, tokens, strict=True):
            top = []
            for t in e.top:
                s = top_strings[k]
                k += 1
                top.append({"token": s, "logprob": _lp(t.logprob), "bytes": list(s.encode())})
            content.append({"token": tok, "logprob": _lp(e.logprob),
                            "bytes": list(tok.encode()), "top_logprobs": top})
        return content

    # -- streaming

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        call = self.call
        out: dict[str, Any] = {
            "id": call.id,
            "object": "chat.completion.chunk" if call.chat else "text_completion",
            "created": call.created, "model": call.model, "system_fingerprint": None,
            "choices": choices,
        }
        if call.include_usage:
            out["usage"] = None
        return out

    def chunks(self, msg: api_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """The SSE chunks for one router message (none when it carries nothing to say)."""
        self.observe(msg)
        want_lp = self.call.logprobs and len(msg.logprobs) > 0
        finish = self._finish_reason() if msg.finish_reason else None
        if not self.call.chat:
            if not (msg.text or want_lp or finish):
                return []
            lp = self.completion_logprobs(msg.logprobs) if want_lp else None
            return [self._envelope([{"index": 0, "text": msg.text, "logprobs": lp,
                                     "finish_reason": finish}])]
        deltas = self._deltas(msg.text, final=bool(msg.finish_reason))
        finish = self._finish_reason() if msg.finish_reason else None  # after the reading
        if not self.sent_role:
            first = deltas[0] if deltas else {"content": ""}
            deltas[:1] = [{"role": "assistant", **first}]
            self.sent_role = True
        if not deltas and (want_lp or finish):
            deltas = [{}]
        lp = {"content": self.chat_logprobs(msg.logprobs), "refusal": None} if want_lp \
            else None
        out = []
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            out.append(self._envelope([{"index": 0, "delta": delta,
                                        "logprobs": lp if i == 0 else None,
                                        "finish_reason": finish if last else None}]))
        return out

    def _deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The chat deltas for new text: the text itself, or what the tool-call reader
        decides of it."""
        if self.tool_stream is None:
            return [{"content": text}] if text else []
        events = self.tool_stream.feed(text) if text else []
        if final:
            events += self.tool_stream.finish()
        return [self._delta(e) for e in events]

    def _delta(self, event: Event) -> dict[str, Any]:
        if isinstance(event, Content):
            return {"content": event.text}
        self.called = True
        if isinstance(event, CallStart):
            return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}]}
        assert isinstance(event, Arguments)
        return {"tool_calls": [{"index": event.index,
                                "function": {"arguments": event.text}}]}

    def usage_chunk(self) -> dict[str, Any]:
        out = self._envelope([])
        out["usage"] = self.usage_json()
        return out

    # -- non-streaming

    def body(self, msgs: Sequence[api_pb2.GenerateResponse]) -> dict[str, Any]:
        for m in msgs:
            self.observe(m)
        text = "".join(m.text for m in msgs)
        entries = [e for m in msgs for e in m.logprobs]
        call = self.call
        if call.chat:
            lp = {"content": self.chat_logprobs(entries), "refusal": None} \
                if call.logprobs else None
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            if self.tool_stream is not None:
                parsed = fold(self.tool_stream.feed(text) + self.tool_stream.finish())
                message["content"] = parsed.content
                if parsed.calls:
                    self.called = True
                    message["tool_calls"] = [
                        {"id": c.id, "type": "function",
                         "function": {"name": c.name, "arguments": c.arguments}}
                        for c in parsed.calls]
            choice = {"index": 0, "message": message, "logprobs": lp,
                      "finish_reason": self._finish_reason()}
        else:
            lp = self.completion_logprobs(entries) if call.logprobs else None
            choice = {"index": 0, "text": text, "logprobs": lp,
                      "finish_reason": self.finish_reason}
        return {"id": call.id, "object": "chat.completion" if call.chat else "text_completion",
                "created": call.created, "model": call.model, "system_fingerprint": None,
                "choices": [choice], "usage": self.usage_json()}
