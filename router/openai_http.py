"""The OpenAI-compatible HTTP front of the router (``/v1/completions``, ``/v1/chat/completions``).

This module only translates: OpenAI JSON in, one :class:`api_pb2.GenerateRequest` to the
router, the router's :class:`api_pb2.GenerateResponse` stream back out as OpenAI JSON or
server-sent events. Everything about *values* (temperature >= 0, the prompt fits the
context, the model is loaded, there is room for one more request) is the router's call; it
raises :class:`RouterError` and the same error reaches the client with
:func:`router.errors.http_status` of its gRPC code, so both APIs say the same thing.

Lifecycle of one request through this front
-------------------------------------------
1. **Body.** aiohttp's ``client_max_size`` is ``max_body_bytes``. A ``Content-Length`` over
   it is answered 413 before a byte of the body is read; a chunked body that grows past it
   is answered 413 once it does. Both as OpenAI error JSON (a middleware turns every aiohttp
   HTTP error, 404 and 405 included, into that shape). aiohttp then drains the unread body
   (up to ``LINGER_S``) so the client can read the answer; this front ends that drain as
   soon as the client disconnects, which aiohttp alone does not notice.
2. **Parse.** The body must be a JSON object (``NaN``/``Infinity`` are refused). Each field
   this front knows is type-checked here; a wrong type is a 400 naming the field. Fields
   that ask for something pdserve does not do (``n`` > 1, ``echo``, penalties, tools, ...)
   are refused with a 400 saying so, unless they carry their neutral value. Unknown fields
   are ignored (see *Fields* below). ``model``, when present, must be the served model
   (else 404, ``code: "model_not_found"``).
3. **Translate.** One ``GenerateRequest``: ``request_id`` is the response id
   (``cmpl-<hex>`` / ``chatcmpl-<hex>``), the prompt is ``text``, ``token_ids`` or
   ``messages`` (chat messages are rendered by the router with the chat template), the
   sampling fields go to ``SamplingParams``, ``cache_salt`` passes through.
4. **Drive.** ``router.generate(req, timeout=request_timeout)``. A driver task owns the
   router's async generator; the handler waits on it and on a watcher polling the
   connection (every ``disconnect_poll_s``). The first message is
   awaited *before* any response byte is sent, so a request the router refuses (bad
   sampling value, prompt too long, overload, unknown model) gets its real HTTP status and
   an OpenAI error body, streaming or not.
5. **Answer.** Non-streaming: messages are accumulated and one JSON body is sent after the
   message carrying ``finish_reason``. Streaming: ``text/event-stream``, one
   ``data: {chunk}`` event per router message that carries text, logprobs or the finish
   reason (chat's first chunk carries ``role: "assistant"``), then, with
   ``stream_options.include_usage``, a chunk with ``choices: []`` and the usage (every
   other chunk then has ``usage: null``), then ``data: [DONE]``. A :class:`RouterError`
   after the stream started becomes an event ``data: {"error": {...}}`` followed by
   ``data: [DONE]``.
6. **Cleanup.** However the request ends, the router generator is closed: after the final
   message (``aclose()``, which must be a no-op for the router once the request finished),
   on an error, or when the client goes away, which is noticed three ways: a write raises
   ``ConnectionResetError`` (``aclose()``), the watcher sees the transport closed (the
   driver task is cancelled, so ``CancelledError`` is thrown into the generator at its
   ``await``), or aiohttp cancels the handler (``handler_cancellation=True``; same as the
   watcher). The router cancels the request and frees its KV blocks in response.

Fields
------
Both endpoints: ``model``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``seed``, ``stop`` (string or list), ``stop_token_ids``, ``ignore_eos``,
``include_stop_str_in_output``, ``cache_salt``, ``stream``, ``stream_options``
(``include_usage``; ignored without ``stream: true``).

``/v1/completions``: ``prompt`` (a string, a list of token ids, or a list holding exactly
one of those: several prompts per request are refused, send one request each),
``logprobs`` (int, 0..20).

``/v1/chat/completions``: ``messages`` (roles ``system``, ``developer`` (sent as
``system``), ``user``, ``assistant``; ``content`` a string or a list of
``{"type": "text", "text"}`` parts, joined with ``"\\n"``), ``max_completion_tokens``
(wins over ``max_tokens``; without either the limit is ``max_model_len``, i.e. the rest
of the context), ``logprobs`` (bool) and ``top_logprobs`` (0..20, needs ``logprobs: true``).

Accepted only at their neutral value (anything else is a 400 naming the field): ``n`` 1,
``best_of`` 1, ``echo`` false, ``suffix`` "", ``repetition_penalty`` 1, ``frequency_penalty``
0, ``presence_penalty`` 0, ``logit_bias`` {}, ``min_tokens`` 0, ``use_beam_search`` false,
``prompt_logprobs`` null, ``tools``/``functions`` empty, ``tool_choice`` "none"/"auto",
``response_format`` ``{"type": "text"}``, ``continue_final_message`` false, the vLLM
``guided_*`` fields and ``structured_outputs`` null.

Ignored: ``user``, ``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls``,
``reasoning_effort``, ``stream_options.continuous_usage_stats``, ``skip_special_tokens``,
``spaces_between_special_tokens``, ``add_generation_prompt`` (the router always adds it),
``chat_template``/``chat_template_kwargs``, ``priority``, a message's ``name``, and any field
not named in this docstring.

Logprobs are rendered with token strings from the router's optional
``token_strings(ids) -> list[str]`` (each token decoded on its own), else from its
``tokenizer.batch_decode`` (a Hugging Face tokenizer), else a token reads
``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids`` form). Completions'
``text_offset`` counts those strings' lengths from the start of the completion, and
``top_logprobs`` holds the alternatives plus the sampled token (vLLM's convention).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import grpc
from aiohttp import web

from protos.pdserve.v1 import api_pb2, common_pb2
from router.errors import RouterError, http_status

log = logging.getLogger(__name__)

UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20
DEFAULT_DISCONNECT_POLL_S = 0.25
LINGER_S = 10.0  # aiohttp's default lingering_time: how long an unread body is drained
CHAT_TEXT_PART_SEPARATOR = "\n"
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


class RouterLike(Protocol):
    """What this front needs from the router core (``router/core.py``)."""

    model_name: str
    max_model_len: int

    def generate(
        self, req: api_pb2.GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[api_pb2.GenerateResponse]: ...


@runtime_checkable
class TokenStringsLike(Protocol):
    """Optional router method: each token id decoded on its own, for logprobs."""

    def token_strings(self, token_ids: Sequence[int]) -> list[str]: ...


# --------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An error answered with an HTTP status that has no gRPC code (413, 404 route, ...)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


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


def _from_router_error(exc: RouterError) -> ApiError:
    code = exc.code.name.lower() if isinstance(exc.code, grpc.StatusCode) else None
    if exc.code == grpc.StatusCode.NOT_FOUND and exc.field == "model":
        code = "model_not_found"
    return ApiError(http_status(exc.code), exc.message, exc.field, code)


def _as_api_error(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RouterError):
        return _from_router_error(exc)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal")


def _error_response(exc: Exception, request_id: str | None = None) -> web.Response:
    err = _as_api_error(exc)
    headers = {"X-Request-Id": request_id} if request_id else None
    return web.json_response(error_body(err.status, err.message, err.param, err.code),
                             status=err.status, headers=headers, dumps=_dumps)


def _bad(param: str, message: str) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, message, param)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _sse(obj: Any) -> bytes:
    return b"data: " + _dumps(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# --------------------------------------------------------------------------- parsing


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class _Fields:
    """Typed reads of the JSON body. JSON ``null`` reads as absent; failures name the field."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def get(self, name: str) -> Any:
        return self.body.get(name)

    def int_(self, name: str, lo: int, hi: int) -> int | None:
        v = self.body.get(name)
        if v is None:
            return None
        if not _is_int(v):
            raise _bad(name, f"{name} must be an integer, got {_describe(v)}")
        if not lo <= v <= hi:
            raise _bad(name, f"{name} must be in [{lo}, {hi}], got {v}")
        return v

    def number(self, name: str) -> float | None:
        v = self.body.get(name)
        if v is None:
            return None
        if not _is_number(v):
            raise _bad(name, f"{name} must be a number, got {_describe(v)}")
        return float(v)

    def bool_(self, name: str) -> bool | None:
        v = self.body.get(name)
        if v is None:
            return None
        if not isinstance(v, bool):
            raise _bad(name, f"{name} must be true or false, got {_describe(v)}")
        return v

    def str_(self, name: str) -> str | None:
        v = self.body.get(name)
        if v is None:
            return None
        if not isinstance(v, str):
            raise _bad(name, f"{name} must be a string, got {_describe(v)}")
        return v

    def str_list(self, name: str) -> list[str]:
        v = self.body.get(name)
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return list(v)
        raise _bad(name, f"{name} must be a string or a list of strings, got {_describe(v)}")

    def int_list(self, name: str, lo: int, hi: int) -> list[int]:
        v = self.body.get(name)
        if v is None:
            return []
        if not isinstance(v, list):
            raise _bad(name, f"{name} must be a list of integers, got {_describe(v)}")
        return _token_ids(v, name, lo, hi)


def _describe(v: Any) -> str:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list",
            dict: "object"}.get(type(v), type(v).__name__)
    text = json.dumps(v) if not isinstance(v, (list, dict)) else ""
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{kind} {text}".strip()


def _token_ids(v: list[Any], name: str, lo: int = 0, hi: int = UINT32_MAX) -> list[int]:
    for i, t in enumerate(v):
        if not _is_int(t) or not lo <= t <= hi:
            raise _bad(name, f"{name}[{i}] must be an integer in [{lo}, {hi}], got "
                             f"{_describe(t)}")
    return list(v)


def _eq(value: Any) -> Callable[[Any], bool]:
    """Accepts exactly ``value`` (numbers compare as numbers, booleans only as booleans)."""
    if isinstance(value, bool):
        return lambda v: v is value
    return lambda v: _is_number(v) and v == value


def _empty(v: Any) -> bool:
    return isinstance(v, (list, dict, str)) and not v


def _never(v: Any) -> bool:
    return False


# name -> (accepts, what to say when it does not). Checked only when the field is non-null.
NEUTRAL_ONLY: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_eq(1), "only n=1 is supported: pdserve returns one choice per request; send "
                  "separate requests for more"),
    "best_of": (_eq(1), "only best_of=1 is supported"),
    "echo": (_eq(False), "echo is not supported"),
    "suffix": (_empty, "suffix is not supported"),
    "repetition_penalty": (_eq(1), "repetition_penalty is not supported (only 1.0 or absent)"),
    "frequency_penalty": (_eq(0), "frequency_penalty is not supported (only 0 or absent)"),
    "presence_penalty": (_eq(0), "presence_penalty is not supported (only 0 or absent)"),
    "logit_bias": (_empty, "logit_bias is not supported"),
    "min_tokens": (_eq(0), "min_tokens is not supported (only 0 or absent)"),
    "use_beam_search": (_eq(False), "beam search is not supported"),
    "prompt_logprobs": (_never, "prompt_logprobs is not supported"),
    "tools": (_empty, "tools are not supported"),
    "functions": (_empty, "functions are not supported"),
    "tool_choice": (lambda v: v in ("none", "auto"), "tool_choice is not supported"),
    "response_format": (lambda v: isinstance(v, dict) and v.get("type") == "text",
                        "response_format other than {\"type\": \"text\"} is not supported"),
    "continue_final_message": (_eq(False), "continue_final_message is not supported"),
    "guided_json": (_never, "guided decoding is not supported"),
    "guided_regex": (_never, "guided decoding is not supported"),
    "guided_choice": (_never, "guided decoding is not supported"),
    "guided_grammar": (_never, "guided decoding is not supported"),
    "structured_outputs": (_never, "structured outputs are not supported"),
}


def _check_neutral(f: _Fields) -> None:
    for name, (accepts, why) in NEUTRAL_ONLY.items():
        v = f.get(name)
        if v is not None and not accepts(v):
            raise _bad(name, f"{why}; got {name}={_dumps(v)}")


def _sampling(f: _Fields, *, chat: bool, max_model_len: int) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams()
    max_tokens = f.int_("max_tokens", 1, UINT32_MAX)
    if chat:
        max_completion = f.int_("max_completion_tokens", 1, UINT32_MAX)
        if max_completion is not None:
            max_tokens = max_completion
        elif max_tokens is None:
            # OpenAI chat has no small default: the limit is the rest of the context.
            max_tokens = max_model_len
    if max_tokens is not None:
        s.max_tokens = max_tokens
    for name in ("temperature", "top_p", "min_p"):
        v = f.number(name)
        if v is not None:
            if not math.isfinite(v):
                raise _bad(name, f"{name} must be finite, got {v}")
            setattr(s, name, v)
    top_k = f.int_("top_k", INT32_MIN, INT32_MAX)
    if top_k is not None:
        s.top_k = top_k
    seed = f.int_("seed", INT64_MIN, INT64_MAX)
    if seed is not None:
        s.seed = seed
    s.stop.extend(f.str_list("stop"))
    s.stop_token_ids.extend(f.int_list("stop_token_ids", 0, UINT32_MAX))
    s.ignore_eos = bool(f.bool_("ignore_eos"))
    s.include_stop_str_in_output = bool(f.bool_("include_stop_str_in_output"))
    if chat:
        want = f.bool_("logprobs")
        top = f.int_("top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and not want:
            raise _bad("top_logprobs", "top_logprobs needs logprobs: true")
        if want:
            s.logprobs = top or 0
    else:
        n = f.int_("logprobs", 0, MAX_LOGPROBS)
        if n is not None:
            s.logprobs = n
    return s


def _completion_prompt(v: Any) -> str | list[int]:
    if v is None:
        raise _bad("prompt", "prompt is required")
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        if not v:
            raise _bad("prompt", "prompt must not be an empty list")
        if all(_is_int(t) for t in v):
            return _token_ids(v, "prompt")
        if len(v) == 1 and (isinstance(v[0], str) or isinstance(v[0], list)):
            if isinstance(v[0], list) and not v[0]:
                raise _bad("prompt", "prompt[0] must not be an empty list")
            if isinstance(v[0], list) and not all(_is_int(t) for t in v[0]):
                raise _bad("prompt", "prompt[0] must be a list of token ids")
            return _completion_prompt(v[0])
        if all(isinstance(p, (str, list)) for p in v):
            raise _bad("prompt", f"batched prompts (a list of {len(v)} prompts) are not "
                                 "supported: send one request per prompt")
    raise _bad("prompt", "prompt must be a string, a list of token ids, or a list holding "
                         f"one of those; got {_describe(v)}")


CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant"}


def _chat_messages(v: Any) -> api_pb2.ChatMessages:
    if not isinstance(v, list) or not v:
        raise _bad("messages", "messages must be a non-empty list of {role, content} objects")
    out = api_pb2.ChatMessages()
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"{where} must be an object with role and content")
        role = m.get("role")
        if not isinstance(role, str):
            raise _bad(f"{where}.role", f"{where}.role must be a string")
        if role not in CHAT_ROLES:
            raise _bad(f"{where}.role", f"{where}.role {role!r} is not supported; use system, "
                                        "developer, user or assistant")
        if m.get("tool_calls") or m.get("function_call"):
            raise _bad(f"{where}.tool_calls", "tool calls are not supported")
        content = m.get("content")
        if content is None:
            if role != "assistant":
                raise _bad(f"{where}.content", f"{where}.content is required")
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                pwhere = f"{where}.content[{j}]"
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else _describe(part)
                    raise _bad(pwhere, f"{pwhere}: only text parts are supported, got {kind!r}")
                text = part.get("text")
                if not isinstance(text, str):
                    raise _bad(f"{pwhere}.text", f"{pwhere}.text must be a string")
                texts.append(text)
            content = CHAT_TEXT_PART_SEPARATOR.join(texts)
        elif not isinstance(content, str):
            raise _bad(f"{where}.content", f"{where}.content must be a string or a list of "
                                           f"text parts, got {_describe(content)}")
        out.messages.add(role=CHAT_ROLES[role], content=content)
    return out


class _Call:
    """One parsed OpenAI request: what to send the router and how to answer."""

    def __init__(self, *, chat: bool, req: api_pb2.GenerateRequest, model: str, stream: bool,
                 include_usage: bool, logprobs: bool) -> None:
        self.chat = chat
        self.req = req
        self.id = req.request_id
        self.model = model
        self.created = int(time.time())
        self.stream = stream
        self.include_usage = include_usage
        self.logprobs = logprobs


def parse_request(body: dict[str, Any], router: RouterLike, *, chat: bool) -> _Call:
    """Validate an OpenAI request body and translate it; raises RouterError/ApiError."""
    f = _Fields(body)
    model = f.str_("model")
    if model is not None and model != router.model_name:
        raise RouterError(grpc.StatusCode.NOT_FOUND,
                          f"The model `{model}` does not exist: this server serves "
                          f"`{router.model_name}` (see GET /v1/models)", "model")
    _check_neutral(f)
    stream = bool(f.bool_("stream"))
    options = f.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", f"stream_options must be an object, got {_describe(options)}")
    include_usage = False
    if options:
        v = options.get("include_usage")
        if v is not None and not isinstance(v, bool):
            raise _bad("stream_options.include_usage",
                       f"stream_options.include_usage must be true or false, got {_describe(v)}")
        include_usage = bool(v) and stream
    cache_salt = f.str_("cache_salt")
    sampling = _sampling(f, chat=chat, max_model_len=router.max_model_len)
    prefix = "chatcmpl-" if chat else "cmpl-"
    req = api_pb2.GenerateRequest(request_id=prefix + uuid.uuid4().hex, model=model or "",
                                  sampling=sampling, cache_salt=cache_salt or "")
    if chat:
        req.messages.CopyFrom(_chat_messages(f.get("messages")))
    else:
        prompt = _completion_prompt(f.get("prompt"))
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
    return _Call(chat=chat, req=req, model=router.model_name, stream=stream,
                 include_usage=include_usage, logprobs=sampling.HasField("logprobs"))


# --------------------------------------------------------------------------- rendering


def _lp(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


class _Renderer:
    """Turns router messages into OpenAI chunks / bodies for one request."""

    def __init__(self, call: _Call, token_strings: Callable[[Sequence[int]], list[str]]) -> None:
        self.call = call
        self.token_strings = token_strings
        self.text_offset = 0  # completions logprobs: where the next token starts
        self.sent_role = False
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.usage: common_pb2.Usage | None = None
        self.finish_reason: str | None = None

    # -- bookkeeping shared by both modes

    def observe(self, msg: api_pb2.GenerateResponse) -> None:
        if msg.prompt_token_ids:
            self.prompt_tokens = len(msg.prompt_token_ids)
        self.completion_tokens += len(msg.token_ids)
        if msg.HasField("usage"):
            self.usage = msg.usage
        if msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = FINISH_REASONS.get(msg.finish_reason, "abort")

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

    def chunk(self, msg: api_pb2.GenerateResponse) -> dict[str, Any] | None:
        """The SSE chunk for one router message, or None when it carries nothing to say."""
        self.observe(msg)
        want_lp = self.call.logprobs and len(msg.logprobs) > 0
        finish = self.finish_reason if msg.finish_reason else None
        if self.call.chat:
            if not (msg.text or want_lp or finish or not self.sent_role):
                return None
            delta: dict[str, Any] = {}
            if not self.sent_role:
                delta["role"] = "assistant"
                self.sent_role = True
            if msg.text or "role" in delta:
                delta["content"] = msg.text
            lp = {"content": self.chat_logprobs(msg.logprobs), "refusal": None} if want_lp \
                else None
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            if not (msg.text or want_lp or finish):
                return None
            lp = self.completion_logprobs(msg.logprobs) if want_lp else None
            choice = {"index": 0, "text": msg.text, "logprobs": lp, "finish_reason": finish}
        return self._envelope([choice])

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
            choice = {"index": 0, "message": {"role": "assistant", "content": text,
                                              "refusal": None},
                      "logprobs": lp, "finish_reason": self.finish_reason}
        else:
            lp = self.completion_logprobs(entries) if call.logprobs else None
            choice = {"index": 0, "text": text, "logprobs": lp,
                      "finish_reason": self.finish_reason}
        return {"id": call.id, "object": "chat.completion" if call.chat else "text_completion",
                "created": call.created, "model": call.model, "system_fingerprint": None,
                "choices": [choice], "usage": self.usage_json()}


# --------------------------------------------------------------------------- driving


async def _next_message(
    gen: AsyncIterator[api_pb2.GenerateResponse],
) -> api_pb2.GenerateResponse:
    """The router's next message; its failures come out as RouterError."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        raise RouterError(grpc.StatusCode.INTERNAL,
                          "the router ended the request without a finish reason") from None
    except RouterError:
        raise
    except Exception as exc:
        log.exception("router generator failed")
        raise RouterError(grpc.StatusCode.INTERNAL,
                          f"internal error: {type(exc).__name__}: {exc}") from exc


async def _close(gen: AsyncIterator[api_pb2.GenerateResponse]) -> None:
    aclose = getattr(gen, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:
        log.exception("closing the router generator failed")


async def _wait_disconnected(request: web.Request, poll_s: float) -> None:
    while True:
        transport = request.transport
        if transport is None or transport.is_closing():
            return
        await asyncio.sleep(poll_s)


class OpenAIFront:
    """The handlers; one per application."""

    def __init__(self, router: RouterLike, *, max_body_bytes: int,
                 request_timeout: float | None, disconnect_poll_s: float) -> None:
        self.router = router
        self.max_body_bytes = max_body_bytes
        self.request_timeout = request_timeout
        self.disconnect_poll_s = disconnect_poll_s
        self.created = int(time.time())
        self.background: set[asyncio.Future[None]] = set()
        self.token_strings = _token_strings_of(router)

    # -- simple endpoints

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.router.model_name, "object": "model", "created": self.created,
                "owned_by": "pdserve", "max_model_len": self.router.max_model_len}

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]}, dumps=_dumps)

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.router.model_name:
            raise ApiError(404, f"The model `{name}` does not exist", "model", "model_not_found")
        return web.json_response(self._model_card(), dumps=_dumps)

    # -- generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _read_body(self, request: web.Request) -> dict[str, Any]:
        limit = self.max_body_bytes
        too_large = ApiError(413, f"request body is larger than the limit of {limit} bytes",
                             None, "request_too_large")
        if request.content_length is not None and request.content_length > limit:
            self._end_drain_on_disconnect(request)
            raise too_large
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self._end_drain_on_disconnect(request)
            raise too_large from None
        try:
            body = json.loads(raw, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}", None,
                           "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"request body must be a JSON object, got {_describe(body)}",
                           None, "invalid_json")
        return body

    def _end_drain_on_disconnect(self, request: web.Request) -> None:
        """After answering 413, aiohttp drains the unread body (up to ``LINGER_S``) so the
        client can read the answer, but it does not notice the client leaving meanwhile and
        would hold the connection (and delay shutdown) until the timeout. End the drain as
        soon as the connection closes."""

        async def watch() -> None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    _wait_disconnected(request, self.disconnect_poll_s), LINGER_S)
            request.content.feed_eof()

        task = asyncio.ensure_future(watch())
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def close(self, app: web.Application | None = None) -> None:
        for task in list(self.background):
            task.cancel()
        if self.background:
            await asyncio.wait(list(self.background))

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            call = parse_request(await self._read_body(request), self.router, chat=chat)
        except (ApiError, RouterError) as exc:
            return _error_response(exc)
        gen = self.router.generate(call.req, timeout=self.request_timeout)
        holder: list[web.StreamResponse] = []
        run: Callable[[], Awaitable[web.StreamResponse]]
        if call.stream:
            async def run() -> web.StreamResponse:
                return await self._stream(request, call, gen, holder)
        else:
            async def run() -> web.StreamResponse:
                return await self._collect(call, gen)
        task = asyncio.ensure_future(run())
        watcher = asyncio.ensure_future(_wait_disconnected(request, self.disconnect_poll_s))
        try:
            await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Reached on completion, on the client going away (watcher) and on aiohttp
            # cancelling this handler: in the last two the driver is cancelled, which throws
            # CancelledError into the router generator, which cancels the request.
            watcher.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))
        if task.cancelled():
            log.info("client went away; request %s cancelled", call.id)
            return holder[0] if holder else web.Response(status=499)
        return task.result()

    async def _collect(self, call: _Call,
                       gen: AsyncIterator[api_pb2.GenerateResponse]) -> web.StreamResponse:
        msgs: list[api_pb2.GenerateResponse] = []
        try:
            while True:
                msg = await _next_message(gen)
                msgs.append(msg)
                if msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    break
        except RouterError as exc:
            return _error_response(exc, call.id)
        finally:
            await _close(gen)
        body = _Renderer(call, self.token_strings).body(msgs)
        return web.json_response(body, headers={"X-Request-Id": call.id}, dumps=_dumps)

    async def _stream(self, request: web.Request, call: _Call,
                      gen: AsyncIterator[api_pb2.GenerateResponse],
                      holder: list[web.StreamResponse]) -> web.StreamResponse:
        renderer = _Renderer(call, self.token_strings)
        try:
            try:
                msg = await _next_message(gen)
            except RouterError as exc:
                return _error_response(exc, call.id)
            resp = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": call.id})
            holder.append(resp)
            await resp.prepare(request)
            try:
                while True:
                    chunk = renderer.chunk(msg)
                    if chunk is not None:
                        await resp.write(_sse(chunk))
                    if msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                        break
                    msg = await _next_message(gen)
                if call.include_usage:
                    await resp.write(_sse(renderer.usage_chunk()))
            except RouterError as exc:
                err = _from_router_error(exc)
                await resp.write(_sse(error_body(err.status, err.message, err.param, err.code)))
            await resp.write(SSE_DONE)
            return resp
        except ConnectionError:
            log.info("client went away; request %s cancelled", call.id)
            return holder[0] if holder else web.Response(status=499)
        finally:
            await _close(gen)


def _token_id_strings(ids: Sequence[int]) -> list[str]:
    return [f"token_id:{i}" for i in ids]


def _token_strings_of(router: RouterLike) -> Callable[[Sequence[int]], list[str]]:
    """``router.token_strings``, else each id decoded alone by ``router.tokenizer`` (a
    Hugging Face tokenizer), else ``"token_id:<id>"``."""
    if isinstance(router, TokenStringsLike):
        return router.token_strings
    tokenizer = getattr(router, "tokenizer", None)
    batch_decode = getattr(tokenizer, "batch_decode", None)
    if callable(batch_decode):
        return lambda ids: list(batch_decode([[i] for i in ids]))
    return _token_id_strings


# --------------------------------------------------------------------------- application


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error leaves as OpenAI error JSON, aiohttp's own (404, 405, 413) included."""
    try:
        return await handler(request)
    except (ApiError, RouterError) as exc:
        return _error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 404:
            message = f"no such endpoint: {request.method} {request.path}"
        elif exc.status == 405:
            message = f"method {request.method} is not allowed on {request.path}"
        else:
            message = exc.text or exc.reason
        return web.json_response(error_body(exc.status, message), status=exc.status,
                                 dumps=_dumps)
    except Exception as exc:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error_response(exc)


FRONT_KEY = web.AppKey("pdserve_openai_front", OpenAIFront)


def create_app(router: RouterLike, max_body_bytes: int = 8 * 2**20, *,
               request_timeout: float | None = None,
               disconnect_poll_s: float = DEFAULT_DISCONNECT_POLL_S) -> web.Application:
    """The OpenAI-compatible aiohttp application in front of ``router``.

    ``request_timeout`` is passed to every ``router.generate`` call; ``disconnect_poll_s``
    is how often a waiting request checks that its client is still connected.
    """
    front = OpenAIFront(router, max_body_bytes=max_body_bytes, request_timeout=request_timeout,
                        disconnect_poll_s=disconnect_poll_s)
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_json_errors])
    app[FRONT_KEY] = front
    app.on_shutdown.append(front.close)
    app.router.add_get("/health", front.health)
    app.router.add_get("/v1/models", front.list_models)
    app.router.add_get("/v1/models/{model}", front.get_model)
    app.router.add_post("/v1/completions", front.completions)
    app.router.add_post("/v1/chat/completions", front.chat_completions)
    return app
