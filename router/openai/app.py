"""The aiohttp application: reading bodies, driving the router, sending answers, cleaning up.

Lifecycle steps 0, 1, 4, 6 and the sending half of 5 (parsing is :mod:`.protocol`, the shape
of every answer is :mod:`.responses`).

0. **Authenticate** (with a key file, :class:`router.auth.KeyStore`): a middleware, so
   every route has it unless it is in the public set (``/health``; ``/metrics`` with
   ``metrics_public``). ``Authorization: Bearer KEY`` missing or unknown: 401 with
   ``WWW-Authenticate: Bearer``; a route of the admin set (``/metrics`` otherwise) with
   a key lacking ``admin``: 403. The caller goes with the request to the router, which
   salts, limits and strips by it. A refused request's body is never read.
1. **Body.** aiohttp's ``client_max_size`` is ``max_body_bytes``. A ``Content-Length`` over
   it is answered 413 before a byte of the body is read; a chunked body that grows past it
   is answered 413 once it does. Both as OpenAI error JSON (a middleware turns every aiohttp
   HTTP error, 404 and 405 included, into that shape). aiohttp then drains the unread body
   (up to ``LINGER_S``) so the client can read the answer; this front ends that drain as
   soon as the client disconnects, which aiohttp alone does not notice.
4. **Drive.** ``router.generate(req, timeout=request_timeout)``. A driver task owns the
   router's async generator; the handler waits on it and on a watcher polling the
   connection (every ``disconnect_poll_s``). The first message is
   awaited *before* any response byte is sent, so a request the router refuses (bad
   sampling value, prompt too long, overload, unknown model) gets its real HTTP status and
   an OpenAI error body, streaming or not.
5. **Answer.** Non-streaming: messages are accumulated and one JSON body is sent after the
   message carrying ``finish_reason`` (of every choice, with ``n``/``best_of``).
   Streaming: ``text/event-stream``, the events each
   router message makes (:meth:`.render.Renderer.chunks`: one per message that has
   something to say, or several when a tool-call reader releases held text), the usage
   chunk when asked for, then ``data: [DONE]``. A :class:`RouterError` after the stream
   started becomes an event ``data: {"error": {...}}`` followed by ``data: [DONE]``.
   How a route answers is its :class:`Answer` (``/v1/responses``:
   :class:`.responses_api.ResponsesRenderer`, with its own events and no ``[DONE]``); the
   driving, disconnect handling and cleanup are shared (:meth:`OpenAIFront._drive`).
6. **Cleanup.** However the request ends, the router generator is closed: after the final
   message (``aclose()``, which must be a no-op for the router once the request finished),
   on an error, or when the client goes away, which is noticed three ways: a write raises
   ``ConnectionResetError`` (``aclose()``), the watcher sees the transport closed (the
   driver task is cancelled, so ``CancelledError`` is thrown into the generator at its
   ``await``), or aiohttp cancels the handler (``handler_cancellation=True``; same as the
   watcher). The router cancels the request and frees its KV blocks in response.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE

from common.wire import MAX_MESSAGE_BYTES
from protos.pdserve.v1 import api_pb2, common_pb2
from router.auth import KeyStore, Principal, bearer_key
from router.errors import RouterError, to_public

from .protocol import ApiError, Call, RouterLike, decode_body, dumps, parse_request
from .render import Renderer
from .responses import (
    SSE_DONE,
    SSE_HEADERS,
    api_error_body,
    as_api_error,
    error_body,
    sse,
    token_strings_of,
)
from .responses_api import parse_responses
from .responses_events import ResponsesRenderer
from .tokenization import TokenizingRouter, parse_detokenize, parse_tokenize
from .tool_parsers import DEFAULT_PARSER, tool_parser

log = logging.getLogger(__name__)

DEFAULT_DISCONNECT_POLL_S = 0.25
LINGER_S = 10.0  # aiohttp's default lingering_time: how long an unread body is drained

HEALTH_PATHS = frozenset({"/health"})
"""Routes open to everyone, key file or not: probes carry no keys."""
METRICS_PATH = "/metrics"

CALLER_KEY = web.RequestKey("pdserve_caller", object)
"""The request's :class:`router.auth.Principal` (absent without a key file)."""
REQUEST_ID_KEY = web.RequestKey("pdserve_request_id", str)
"""The id a failure of this HTTP request is logged under (the generation's id, once
known)."""


def _package_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a tree that is not installed
        return "unknown"


def _request_id(request: web.Request) -> str:
    rid = request.get(REQUEST_ID_KEY)
    if rid is None:
        rid = request[REQUEST_ID_KEY] = f"http-{uuid.uuid4().hex[:12]}"
    return rid


def _error_response(exc: BaseException, request_id: str) -> web.Response:
    err = as_api_error(exc, request_id)
    headers = {**err.headers, "X-Request-Id": request_id}
    return web.json_response(api_error_body(err), status=err.status, headers=headers,
                             dumps=dumps)


def _client_gone(call: Call, holder: list[web.StreamResponse]) -> web.StreamResponse:
    """What a request whose client went away returns: its stream if it had begun, else 499."""
    log.info("client went away; request %s cancelled", call.id)
    return holder[0] if holder else web.Response(status=499)


# --------------------------------------------------------------------------- driving


async def _next_message(
    gen: AsyncIterator[api_pb2.GenerateResponse], request_id: str,
) -> api_pb2.GenerateResponse:
    """The router's next message; its failures come out as RouterError (an unexpected
    exception logged under ``request_id`` and told as a bare INTERNAL)."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        raise RouterError(grpc.StatusCode.INTERNAL,
                          "the router ended the request without a finish reason") from None
    except RouterError:
        raise
    except Exception as exc:
        raise to_public(exc, request_id) from exc


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


class Answer(Protocol):
    """How one request's router messages are answered (lifecycle step 5): ``body`` of the
    messages when not streamed; streamed, ``opening`` after the headers, ``events`` per
    message, then ``closing``, or ``failure`` when the router fails after the stream began.
    The stream methods return server-sent events, framed. One per request, not shared."""

    def body(self, msgs: Sequence[api_pb2.GenerateResponse]) -> dict[str, Any]: ...

    def opening(self) -> list[bytes]: ...

    def events(self, msg: api_pb2.GenerateResponse) -> list[bytes]: ...

    def closing(self) -> list[bytes]: ...

    def failure(self, err: ApiError) -> list[bytes]: ...


class _ChatAnswer:
    """``/v1/completions`` and ``/v1/chat/completions``: the :class:`.render.Renderer`'s
    chunks as ``data:`` events, then the usage chunk when asked for and ``data: [DONE]``;
    a failure is an error event and ``[DONE]``."""

    def __init__(self, call: Call, renderer: Renderer) -> None:
        self.call = call
        self.renderer = renderer

    def body(self, msgs: Sequence[api_pb2.GenerateResponse]) -> dict[str, Any]:
        return self.renderer.body(msgs)

    def opening(self) -> list[bytes]:
        return []

    def events(self, msg: api_pb2.GenerateResponse) -> list[bytes]:
        return [sse(chunk) for chunk in self.renderer.chunks(msg)]

    def closing(self) -> list[bytes]:
        usage = [sse(self.renderer.usage_chunk())] if self.call.include_usage else []
        return [*usage, SSE_DONE]

    def failure(self, err: ApiError) -> list[bytes]:
        return [sse(api_error_body(err)), SSE_DONE]


class OpenAIFront:
    """The handlers; one per application."""

    def __init__(self, router: RouterLike, *, max_body_bytes: int,
                 request_timeout: float | None, disconnect_poll_s: float,
                 metrics_text: Callable[[], str] | None = None,
                 tool_format: str = DEFAULT_PARSER) -> None:
        tool_parser(tool_format)  # an unknown name fails here, not on the first request
        self.tool_format = tool_format
        self.router = router
        self.metrics_text = metrics_text
        self.max_body_bytes = max_body_bytes
        self.request_timeout = request_timeout
        self.disconnect_poll_s = disconnect_poll_s
        self.created = int(time.time())
        self.background: set[asyncio.Future[None]] = set()
        self.token_strings = token_strings_of(router)
        tokenizer = getattr(router, "tokenizer", None)
        self.decode = tokenizer.decode if callable(getattr(tokenizer, "decode", None)) \
            else None
        """``echo`` of a token-id prompt (bounded by the context: fast, on the loop)."""

    # -- simple endpoints

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.router.model_name, "object": "model", "created": self.created,
                "owned_by": "pdserve", "max_model_len": self.router.max_model_len}

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(self, request: web.Request) -> web.Response:
        assert self.metrics_text is not None
        return web.Response(body=self.metrics_text().encode(),
                            headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]}, dumps=dumps)

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.router.model_name:
            raise ApiError(404, f"The model `{name}` does not exist", "model", "model_not_found")
        return web.json_response(self._model_card(), dumps=dumps)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": _package_version()}, dumps=dumps)

    # -- tokenizer endpoints (vLLM's shapes; router/openai/tokenization.py)

    def _caller(self, request: web.Request) -> Principal | None:
        caller = request.get(CALLER_KEY)
        return caller if isinstance(caller, Principal) else None

    async def tokenize(self, request: web.Request) -> web.Response:
        assert isinstance(self.router, TokenizingRouter)
        call = parse_tokenize(await self._read_body(request), self.router.model_name)
        if call.messages is not None:
            ids = await self.router.tokenize_as(
                api_pb2.TokenizeRequest(messages=call.messages), self._caller(request))
        else:
            assert call.text is not None
            ids = await self.router.encode_as(call.text, call.add_special_tokens,
                                              self._caller(request))
        return web.json_response({"tokens": ids, "count": len(ids),
                                  "max_model_len": self.router.max_model_len}, dumps=dumps)

    async def detokenize(self, request: web.Request) -> web.Response:
        assert isinstance(self.router, TokenizingRouter)
        ids = parse_detokenize(await self._read_body(request), self.router.model_name)
        text = await self.router.detokenize_as(ids, self._caller(request))
        return web.json_response({"prompt": text}, dumps=dumps)

    # -- generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _read_body(self, request: web.Request) -> dict[str, Any]:
        limit = self.max_body_bytes
        too_large = ApiError(413, f"request body is larger than the limit of {limit} bytes",
                             None, "request_too_large")
        coding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if coding not in ("", "identity"):
            # The server runs with auto_decompress=False (router/server.py): a compressed
            # body would be a decompression bomb to size, and OpenAI clients never send one.
            raise ApiError(415, f"Content-Encoding {coding[:32]!r} is not supported: send the "
                                "body uncompressed", "Content-Encoding", "unsupported_encoding")
        if request.content_length is not None and request.content_length > limit:
            self._end_drain_on_disconnect(request)
            raise too_large
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self._end_drain_on_disconnect(request)
            raise too_large from None
        return decode_body(raw)

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

    async def responses(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_responses(await self._read_body(request), self.router,
                                 tool_format=self.tool_format)
        return await self._drive(request, parsed.call,
                                 ResponsesRenderer(parsed, self.token_strings, self.decode))

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        # A body or request refused here raises ApiError/RouterError; _json_errors answers it.
        call = parse_request(await self._read_body(request), self.router, chat=chat,
                             tool_format=self.tool_format)
        renderer = Renderer(call, self.token_strings, self.decode)
        return await self._drive(request, call, _ChatAnswer(call, renderer))

    async def _drive(self, request: web.Request, call: Call, answer: Answer
                     ) -> web.StreamResponse:
        """Lifecycle steps 4 to 6 for a parsed request, answered by ``answer``."""
        request[REQUEST_ID_KEY] = call.id
        caller = request.get(CALLER_KEY)
        gen = self.router.generate(call.req, timeout=self.request_timeout,
                                   caller=caller if isinstance(caller, Principal) else None)
        holder: list[web.StreamResponse] = []
        driver = (self._stream(request, call, answer, gen, holder) if call.stream
                  else self._collect(call, answer, gen))
        task = asyncio.ensure_future(driver)
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
            return _client_gone(call, holder)
        return task.result()

    async def _collect(self, call: Call, answer: Answer,
                       gen: AsyncIterator[api_pb2.GenerateResponse]) -> web.StreamResponse:
        msgs: list[api_pb2.GenerateResponse] = []
        open_ = max(call.req.n, 1)  # choices not ended yet
        try:
            while open_:
                msg = await _next_message(gen, call.id)
                msgs.append(msg)
                if msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    open_ -= 1
        except RouterError as exc:
            return _error_response(exc, call.id)
        finally:
            await _close(gen)
        return web.json_response(answer.body(msgs), headers={"X-Request-Id": call.id},
                                 dumps=dumps)

    async def _stream(self, request: web.Request, call: Call, answer: Answer,
                      gen: AsyncIterator[api_pb2.GenerateResponse],
                      holder: list[web.StreamResponse]) -> web.StreamResponse:
        open_ = max(call.req.n, 1)  # choices not ended yet
        try:
            try:
                msg = await _next_message(gen, call.id)
            except RouterError as exc:
                return _error_response(exc, call.id)
            resp = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": call.id})
            holder.append(resp)
            await resp.prepare(request)
            try:
                for event in answer.opening():
                    await resp.write(event)
                while True:
                    for event in answer.events(msg):
                        self.router.count_sent("http", len(event))
                        await resp.write(event)
                    if msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                        open_ -= 1
                        if not open_:
                            break
                    msg = await _next_message(gen, call.id)
                tail = answer.closing()
            except RouterError as exc:
                tail = answer.failure(as_api_error(exc, call.id))
            for event in tail:
                await resp.write(event)
            return resp
        except ConnectionError:
            return _client_gone(call, holder)
        finally:
            await _close(gen)


# --------------------------------------------------------------------------- application


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error leaves as OpenAI error JSON, aiohttp's own (404, 405, 413) included;
    an unexpected exception as a bare 500 naming the id it is logged under."""
    try:
        return await handler(request)
    except (ApiError, RouterError) as exc:
        return _error_response(exc, _request_id(request))
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
                                 dumps=dumps)
    except Exception as exc:
        rid = _request_id(request)
        log.error("unhandled error in %s %s (request %s)", request.method, request.path, rid)
        return _error_response(exc, rid)


def _auth(keys: KeyStore, public: frozenset[str], admin: frozenset[str]) -> Any:
    """The authentication middleware (lifecycle step 0). ``public`` and ``admin`` are
    route paths as registered (``/v1/models/{model}``)."""

    @web.middleware
    async def authenticate(
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None else ""  # no route: 401 first
        if path in public:
            return await handler(request)
        key = bearer_key(request.headers.get("Authorization"))
        caller = keys.authenticate(key)
        if caller is None:
            challenge = 'Bearer realm="pdserve"' + (', error="invalid_token"' if key else "")
            raise ApiError(401, "the API key is not valid" if key else
                           "this server needs an API key: send `Authorization: Bearer KEY`",
                           None, "invalid_api_key", {"WWW-Authenticate": challenge})
        if path in admin and not caller.admin:
            raise ApiError(403, f"{request.method} {path} needs an admin key (the key of "
                                f"tenant {caller.tenant!r} is not one)", None,
                           "permission_denied")
        request[CALLER_KEY] = caller
        return await handler(request)

    return authenticate


FRONT_KEY = web.AppKey("pdserve_openai_front", OpenAIFront)


def create_app(router: RouterLike, max_body_bytes: int = MAX_MESSAGE_BYTES, *,
               request_timeout: float | None = None,
               disconnect_poll_s: float = DEFAULT_DISCONNECT_POLL_S,
               keys: KeyStore | None = None, metrics_text: Callable[[], str] | None = None,
               metrics_public: bool = False, tool_format: str = DEFAULT_PARSER
               ) -> web.Application:
    """The OpenAI-compatible aiohttp application in front of ``router``.

    ``request_timeout`` is passed to every ``router.generate`` call; ``disconnect_poll_s``
    is how often a waiting request checks that its client is still connected. ``keys``
    None: no authentication. ``metrics_text`` (the Prometheus exposition) adds
    ``GET /metrics``: admin keys only, unless ``metrics_public``. ``GET /version`` and,
    when the router tokenizes (:class:`.tokenization.TokenizingRouter`), ``POST
    /tokenize`` and ``POST /detokenize`` need a key like every route but ``/health``.
    ``tool_format`` names the tool-call parser (:data:`.tool_parsers.PARSERS`) that writes
    tools into chat prompts and reads calls out of the output.
    """
    front = OpenAIFront(router, max_body_bytes=max_body_bytes, request_timeout=request_timeout,
                        disconnect_poll_s=disconnect_poll_s, metrics_text=metrics_text,
                        tool_format=tool_format)
    public = HEALTH_PATHS | ({METRICS_PATH} if metrics_public else set())
    admin = frozenset() if metrics_public else frozenset({METRICS_PATH})
    middlewares: list[Any] = [_json_errors]
    if keys is not None:
        middlewares.append(_auth(keys, frozenset(public), admin))
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    app[FRONT_KEY] = front
    app.on_shutdown.append(front.close)
    app.router.add_get("/health", front.health)
    if metrics_text is not None:
        app.router.add_get(METRICS_PATH, front.metrics)
    app.router.add_get("/v1/models", front.list_models)
    app.router.add_get("/v1/models/{model}", front.get_model)
    app.router.add_get("/version", front.version)
    if isinstance(router, TokenizingRouter):  # the real router; test stand-ins may lack it
        app.router.add_post("/tokenize", front.tokenize)
        app.router.add_post("/detokenize", front.detokenize)
    app.router.add_post("/v1/completions", front.completions)
    app.router.add_post("/v1/chat/completions", front.chat_completions)
    app.router.add_post("/v1/responses", front.responses)
    return app
