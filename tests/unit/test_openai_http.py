"""The OpenAI HTTP front (router/openai/) against a scripted router.

Only the translation layer is tested here: OpenAI JSON <-> GenerateRequest/GenerateResponse,
SSE framing, error shapes and statuses, and that a client going away closes the router's
generator. The router is a stand-in that records what it was asked and yields scripted
messages.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from common.wire import sampling_from_proto
from protos.pdserve.v1 import api_pb2, common_pb2
from router.auth import Principal
from router.errors import RouterError
from router.openai import create_app

MODEL = "SmolLM2-135M-Instruct"
PROMPT_IDS = [11, 12, 13, 14, 15]


def script(texts: Sequence[str], *, finish: int = common_pb2.FINISH_REASON_STOP,
           cached: int = 3, logprobs: bool = False) -> list[api_pb2.GenerateResponse]:
    """One router message per text; the first carries the prompt, the last finish + usage."""
    msgs = []
    for i, text in enumerate(texts):
        m = api_pb2.GenerateResponse(request_id="r", token_ids=[100 + i], text=text)
        if i == 0:
            m.prompt_token_ids.extend(PROMPT_IDS)
        if logprobs:
            m.logprobs.add(token_id=100 + i, logprob=-0.25 * (i + 1),
                           top=[common_pb2.TopLogprob(token_id=200 + i, logprob=-1.5)])
        msgs.append(m)
    last = msgs[-1]
    last.finish_reason = finish
    last.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(PROMPT_IDS),
                                         completion_tokens=len(texts), cached_tokens=cached))
    return msgs


TEXTS = ["Hello", ",", " wor", "ld", "!"]


class ScriptedRouter:
    """A RouterLike that yields ``messages``; optionally fails or hangs partway."""

    model_name = MODEL
    max_model_len = 2048

    def __init__(self, messages: Sequence[api_pb2.GenerateResponse] | None = None, *,
                 error: RouterError | None = None, error_after: int = 0,
                 hang_after: int | None = None, endless: bool = False) -> None:
        self.messages = list(messages if messages is not None else script(TEXTS))
        self.error = error
        self.error_after = error_after
        self.hang_after = hang_after
        self.endless = endless
        self.requests: list[api_pb2.GenerateRequest] = []
        self.timeouts: list[float | None] = []
        self.callers: list[Principal | None] = []
        self.exit: str | None = None
        self.closed = asyncio.Event()
        self.sent: list[tuple[str, int]] = []

    def count_sent(self, hop: str, nbytes: int) -> None:
        self.sent.append((hop, nbytes))

    async def generate(self, req: api_pb2.GenerateRequest, timeout: float | None = None,
                       caller: Principal | None = None
                       ) -> AsyncIterator[api_pb2.GenerateResponse]:
        self.requests.append(req)
        self.timeouts.append(timeout)
        self.callers.append(caller)
        try:
            if self.endless:
                i = 0
                while True:
                    m = api_pb2.GenerateResponse(token_ids=[i], text="x")
                    if i == 0:
                        m.prompt_token_ids.extend(PROMPT_IDS)
                    yield m
                    i += 1
                    await asyncio.sleep(0.001)
            for i, m in enumerate(self.messages):
                if self.error is not None and i == self.error_after:
                    raise self.error
                yield m
                if self.hang_after is not None and i == self.hang_after:
                    await asyncio.Event().wait()
            self.exit = "done"
        except GeneratorExit:
            self.exit = "GeneratorExit"
            raise
        except asyncio.CancelledError:
            self.exit = "CancelledError"
            raise
        finally:
            self.closed.set()


class TokenStringRouter(ScriptedRouter):
    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [f"<{t}>" for t in token_ids]


class Server(TestServer):
    """TestServer always cancels handlers on disconnect; production (``web.run_app``,
    ``AppRunner``) does not by default. This one lets the test choose."""

    def __init__(self, app: web.Application, *, handler_cancellation: bool) -> None:
        super().__init__(app)
        self.handler_cancellation = handler_cancellation

    async def _make_runner(self, **kwargs: Any) -> web.BaseRunner:
        kwargs["handler_cancellation"] = self.handler_cancellation
        kwargs["auto_decompress"] = False  # as router/server.py serves it
        return await super()._make_runner(**kwargs)


def serve(router: Any, fn: Callable[[TestClient], Awaitable[Any]], *,
          handler_cancellation: bool = False, **app_kwargs: Any) -> Any:
    """Runs ``fn(client)`` against a test server of ``create_app(router)``."""

    async def main() -> Any:
        app = create_app(router, **app_kwargs)
        server = Server(app, handler_cancellation=handler_cancellation)
        async with TestClient(server) as client:
            return await fn(client)

    return asyncio.run(main())


def post_json(path: str, body: Any) -> Callable[[TestClient], Awaitable[tuple[int, Any]]]:
    async def fn(client: TestClient) -> tuple[int, Any]:
        resp = await client.post(path, json=body)
        return resp.status, await resp.json()

    return fn


def sse_events(raw: str) -> list[str]:
    assert raw.endswith("\n\n"), raw[-50:]
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def post_stream(path: str, body: Any) -> Callable[[TestClient], Awaitable[tuple[int, str, str]]]:
    async def fn(client: TestClient) -> tuple[int, str, str]:
        resp = await client.post(path, json=body)
        return resp.status, resp.headers.get("Content-Type", ""), await resp.text()

    return fn


def assert_usage(usage: dict[str, Any], cached: int = 3) -> None:
    assert usage == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                     "prompt_tokens_details": {"cached_tokens": cached}}


def assert_error(body: dict[str, Any], *, param: str | None = None,
                 contains: str = "") -> dict[str, Any]:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and contains in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


# --------------------------------------------------------------------------- simple endpoints


def test_models_and_health() -> None:
    async def fn(client: TestClient) -> None:
        resp = await client.get("/v1/models")
        assert resp.status == 200
        body = await resp.json()
        assert body["object"] == "list" and len(body["data"]) == 1
        card = body["data"][0]
        assert card["id"] == MODEL and card["object"] == "model"
        assert card["owned_by"] == "pdserve" and card["max_model_len"] == 2048
        assert isinstance(card["created"], int)
        health = await client.get("/health")
        assert health.status == 200 and await health.text() == "ok"
        missing = await client.get("/v1/nope")
        assert missing.status == 404
        assert_error(await missing.json())

    serve(ScriptedRouter(), fn)


# --------------------------------------------------------------------------- non-streaming


def test_completion_shape_usage_and_request_translation() -> None:
    router = ScriptedRouter()
    body = {"model": MODEL, "prompt": "Say hi", "max_tokens": 7, "temperature": 0.5,
            "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 1234, "stop": ["\n", "###"],
            "stop_token_ids": [2, 3], "ignore_eos": True, "include_stop_str_in_output": True,
            "cache_salt": "tenant-a", "user": "ignored", "repetition_penalty": 1.0,
            "frequency_penalty": 0, "presence_penalty": 0.0, "n": 1, "best_of": 1,
            "echo": False, "some_future_field": {"x": 1}}
    status, out = serve(router, post_json("/v1/completions", body), request_timeout=12.5)
    assert status == 200, out
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
    assert out["model"] == MODEL and isinstance(out["created"], int)
    assert out["choices"] == [{"index": 0, "text": "Hello, world!", "logprobs": None,
                               "finish_reason": "stop"}]
    assert_usage(out["usage"])

    (req,) = router.requests
    assert router.timeouts == [12.5]
    assert req.request_id == out["id"] and req.model == MODEL
    assert req.WhichOneof("prompt") == "text" and req.text == "Say hi"
    s = req.sampling
    assert s.max_tokens == 7 and s.top_k == 40 and s.seed == 1234
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
    assert s.min_p == pytest.approx(0.05)
    assert list(s.stop) == ["\n", "###"] and list(s.stop_token_ids) == [2, 3]
    assert s.ignore_eos and s.include_stop_str_in_output
    assert not s.HasField("logprobs")
    assert req.cache_salt == "tenant-a"


@pytest.mark.parametrize("chat", [False, True])
def test_sampling_controls_reach_the_generate_request(chat: bool) -> None:
    router = ScriptedRouter()
    prompt = ({"messages": [{"role": "user", "content": "hi"}]} if chat
              else {"prompt": "hi"})
    body = {**prompt, "repetition_penalty": 1.25, "frequency_penalty": 0.5,
            "presence_penalty": -1, "logit_bias": {"50256": -100, "7": 2.5},
            "min_tokens": 3, "allowed_token_ids": [7, 8, 50256]}
    status, out = serve(router, post_json("/v1/chat/completions" if chat
                                          else "/v1/completions", body))
    assert status == 200, out
    s = router.requests[0].sampling
    assert s.repetition_penalty == pytest.approx(1.25)
    assert s.frequency_penalty == pytest.approx(0.5) and s.presence_penalty == -1.0
    assert dict(s.logit_bias) == {50256: -100.0, 7: 2.5}
    assert s.min_tokens == 3 and list(s.allowed_token_ids) == [7, 8, 50256]
    p = sampling_from_proto(s)  # what the router core builds from it
    assert p.logit_bias == ((7, 2.5), (50256, -100.0)) and p.min_tokens == 3


def test_completion_defaults_leave_sampling_unset() -> None:
    router = ScriptedRouter()
    status, _ = serve(router, post_json("/v1/completions", {"prompt": "x", "stop": "END"}))
    assert status == 200
    s = router.requests[0].sampling
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs",
                 "repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens"):
        assert not s.HasField(name), name
    assert not s.logit_bias and not s.allowed_token_ids
    assert list(s.stop) == ["END"]
    assert router.requests[0].model == "" and router.timeouts == [None]


@pytest.mark.parametrize(
    ("prompt", "oneof", "value"),
    [
        ([5, 6, 7], "token_ids", [5, 6, 7]),
        (["only one"], "text", "only one"),
        ([[8, 9]], "token_ids", [8, 9]),
    ],
)
def test_completion_prompt_forms(prompt: Any, oneof: str, value: Any) -> None:
    router = ScriptedRouter()
    status, _ = serve(router, post_json("/v1/completions", {"prompt": prompt}))
    assert status == 200
    req = router.requests[0]
    assert req.WhichOneof("prompt") == oneof
    assert (list(req.token_ids.ids) if oneof == "token_ids" else req.text) == value


def test_chat_shape_messages_and_default_max_tokens() -> None:
    router = ScriptedRouter(script(TEXTS, finish=common_pb2.FINISH_REASON_LENGTH, cached=0))
    body = {"model": MODEL, "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                     {"type": "text", "text": "there"}], "name": "bob"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Again"},
    ]}
    status, out = serve(router, post_json("/v1/chat/completions", body))
    assert status == 200, out
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    assert out["model"] == MODEL
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == "Hello, world!"
    assert choice["logprobs"] is None
    assert_usage(out["usage"], cached=0)

    req = router.requests[0]
    assert req.WhichOneof("prompt") == "messages"
    assert [(m.role, m.content) for m in req.messages.messages] == [
        ("system", "Be brief."), ("user", "Hello\nthere"), ("assistant", ""), ("user", "Again")]
    assert req.sampling.max_tokens == ScriptedRouter.max_model_len


def test_chat_max_completion_tokens_wins_and_logprobs() -> None:
    router = TokenStringRouter(script(TEXTS, logprobs=True))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50,
            "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 1}
    status, out = serve(router, post_json("/v1/chat/completions", body))
    assert status == 200, out
    s = router.requests[0].sampling
    assert s.max_tokens == 9 and s.logprobs == 1
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    assert content[0] == {"token": "<100>", "logprob": -0.25, "bytes": list(b"<100>"),
                          "top_logprobs": [{"token": "<200>", "logprob": -1.5,
                                            "bytes": list(b"<200>")}]}


def test_completion_logprobs_legacy_format() -> None:
    router = TokenStringRouter(script(TEXTS, logprobs=True))
    status, out = serve(router, post_json("/v1/completions", {"prompt": "p", "logprobs": 1}))
    assert status == 200, out
    assert router.requests[0].sampling.logprobs == 1
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"<{100 + i}>" for i in range(5)]
    assert lp["token_logprobs"] == [-0.25, -0.5, -0.75, -1.0, -1.25]
    assert lp["top_logprobs"][0] == {"<200>": -1.5, "<100>": -0.25}
    assert lp["text_offset"] == [0, 5, 10, 15, 20]


def test_logprobs_use_the_router_tokenizer_when_there_is_one() -> None:
    class Tokenizer:
        def batch_decode(self, seqs: list[list[int]]) -> list[str]:
            return ["".join(chr(ord("a") + t % 26) for t in s) for s in seqs]

    router = ScriptedRouter(script(TEXTS, logprobs=True))
    router.tokenizer = Tokenizer()  # type: ignore[attr-defined]
    status, out = serve(router, post_json("/v1/completions", {"prompt": "p", "logprobs": 1}))
    assert status == 200
    assert out["choices"][0]["logprobs"]["tokens"] == ["w", "x", "y", "z", "a"]


def test_logprobs_without_token_strings_use_token_id_form() -> None:
    router = ScriptedRouter(script(TEXTS, logprobs=True))
    status, out = serve(router, post_json("/v1/completions", {"prompt": "p", "logprobs": 0}))
    assert status == 200
    assert router.requests[0].sampling.logprobs == 0
    assert out["choices"][0]["logprobs"]["tokens"][0] == "token_id:100"


# --------------------------------------------------------------------------- streaming


def test_completion_stream_concatenates_and_ends_with_done() -> None:
    router = ScriptedRouter()
    status, ctype, raw = serve(router, post_stream(
        "/v1/completions", {"prompt": "p", "stream": True, "max_tokens": 5}))
    assert status == 200 and ctype.startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == len(TEXTS)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello, world!"
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for c in chunks:
        assert c["object"] == "text_completion" and c["model"] == MODEL
        assert "usage" not in c
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["stop"]
    assert router.exit in ("done", "GeneratorExit")
    # Every content event is counted on the http hop, with its bytes (the profile's input).
    events_bytes = [len(b"data: " + e.encode() + b"\n\n") for e in events[:-1]]
    assert router.sent == [("http", n) for n in events_bytes]


def test_chat_stream_with_include_usage() -> None:
    router = ScriptedRouter()
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}}
    status, _, raw = serve(router, post_stream("/v1/chat/completions", body))
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *content, usage = chunks
    assert usage["choices"] == [] and usage["object"] == "chat.completion.chunk"
    assert_usage(usage["usage"])
    assert all(c["usage"] is None for c in content)
    assert all(c["object"] == "chat.completion.chunk" for c in content)
    assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in content) \
        == "Hello, world!"
    assert content[-1]["choices"][0]["finish_reason"] == "stop"


def test_stream_skips_empty_messages_but_keeps_finish() -> None:
    msgs = script(["Hi", "", ""])  # e.g. held-back stop-string text; last one finishes
    status, _, raw = serve(ScriptedRouter(msgs), post_stream(
        "/v1/completions", {"prompt": "p", "stream": True}))
    chunks = [json.loads(e) for e in sse_events(raw)[:-1]]
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] \
        == [("Hi", None), ("", "stop")]


# --------------------------------------------------------------------------- official client


def test_official_openai_client_completes_and_streams() -> None:
    openai = pytest.importorskip("openai")

    async def fn(client: TestClient) -> None:
        async with openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x",
                                      max_retries=0) as oai:
            models = await oai.models.list()
            assert [m.id for m in models.data] == [MODEL]

            c = await oai.completions.create(model=MODEL, prompt="p", max_tokens=5)
            assert c.choices[0].text == "Hello, world!"
            assert c.choices[0].finish_reason == "stop"
            assert c.usage.total_tokens == 10
            assert c.usage.prompt_tokens_details.cached_tokens == 3

            stream = await oai.completions.create(model=MODEL, prompt="p", stream=True,
                                                  stream_options={"include_usage": True})
            text, usage = "", None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                if chunk.usage is not None:
                    usage = chunk.usage
            assert text == "Hello, world!" and usage.completion_tokens == 5

            chat = await oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
            assert chat.choices[0].message.content == "Hello, world!"
            assert chat.usage.prompt_tokens_details.cached_tokens == 3

            cstream = await oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
            parts = [ch.choices[0].delta.content or "" async for ch in cstream]
            assert "".join(parts) == "Hello, world!"

            with pytest.raises(openai.NotFoundError):
                await oai.completions.create(model="gpt-4", prompt="p")
            with pytest.raises(openai.BadRequestError, match="cannot be streamed"):
                await oai.completions.create(model=MODEL, prompt="p", best_of=2, stream=True)

    serve(ScriptedRouter(), fn)


# --------------------------------------------------------------------------- errors


def test_malformed_json_and_non_object_body() -> None:
    async def fn(client: TestClient) -> None:
        for data in (b"{not json", b'{"prompt": NaN}', b"[1, 2]", b"\xff\xfe"):
            resp = await client.post("/v1/completions", data=data,
                                     headers={"Content-Type": "application/json"})
            assert resp.status == 400, data
            err = assert_error(await resp.json())
            assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"

    serve(ScriptedRouter(), fn)


def test_compressed_bodies_are_415_json_never_a_500_or_plain_text() -> None:
    """Found by the fuzz suite: a gzip/deflate header on a plain body was a 500, br or a
    broken deflate body aiohttp's own text/plain 400 naming a missing library."""
    async def fn(client: TestClient) -> None:
        for coding, data in (("gzip", b"null"), ("deflate", b"r"), ("br", b"{}"),
                             ("gzip", gzip.compress(b'{"prompt": "hi"}'))):
            resp = await client.post("/v1/completions", data=data, headers={
                "Content-Type": "application/json", "Content-Encoding": coding})
            assert resp.status == 415, coding
            err = assert_error(await resp.json(), contains="uncompressed")
            assert err["code"] == "unsupported_encoding"

    serve(ScriptedRouter(), fn)


def test_a_number_too_large_for_a_neutral_field_is_a_400_naming_it() -> None:
    """Found by the fuzz suite: 1e400 parses to inf, and showing it in the 400 raised."""
    async def fn(client: TestClient) -> None:
        for path, body in (("/v1/completions", '{"prompt": "hi", "echo": -1e400}'),
                           ("/v1/chat/completions",
                            '{"messages": [{"role": "user", "content": "x"}], "n": 1e400}')):
            resp = await client.post(path, data=body,
                                     headers={"Content-Type": "application/json"})
            assert resp.status == 400, body
            err = assert_error(await resp.json(), contains="Infinity")
            assert err["param"] in ("echo", "n")

    serve(ScriptedRouter(), fn)


def test_unknown_model_is_404_in_openai_shape() -> None:
    router = ScriptedRouter()
    status, out = serve(router, post_json("/v1/chat/completions", {
        "model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}))
    assert status == 404
    err = assert_error(out, param="model", contains="gpt-4")
    assert err["code"] == "model_not_found"
    assert router.requests == []


@pytest.mark.parametrize(
    ("extra", "param", "contains"),
    [
        ({"n": 17}, "n", "[1, 16]"),
        ({"repetition_penalty": "high"}, "repetition_penalty", "number"),
        ({"frequency_penalty": 10**400}, "frequency_penalty", "finite"),
        ({"presence_penalty": True}, "presence_penalty", "number"),
        ({"logit_bias": [[5, 1]]}, "logit_bias", "object"),
        ({"logit_bias": {"a5": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"-5": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": "1"}}, "logit_bias", "finite number"),
        ({"logit_bias": {"5": 10**400}}, "logit_bias", "finite number"),
        ({"min_tokens": -1}, "min_tokens", "[0, "),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids", "allowed_token_ids[1]"),
        ({"echo": "yes"}, "echo", "true or false"),
        ({"n": 3, "best_of": 2}, "best_of", "at least n"),
        ({"best_of": 3, "stream": True}, "best_of", "cannot be streamed"),
        ({"n": True}, "n", "integer"),
        ({"prompt": ["a", "b"]}, "prompt", "one request per prompt"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": None}, "prompt", "required"),
        ({"prompt": [1, "a"]}, "prompt", "prompt must be"),
        ({"prompt": [-1]}, "prompt", "prompt[0]"),
        ({"max_tokens": "10"}, "max_tokens", "integer"),
        ({"max_tokens": 0}, "max_tokens", "[1, "),
        ({"temperature": "hot"}, "temperature", "number"),
        ({"temperature": True}, "temperature", "number"),
        ({"top_k": 1.5}, "top_k", "integer"),
        ({"seed": 2**70}, "seed", "seed"),
        ({"stop": 5}, "stop", "string"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids", "stop_token_ids[1]"),
        ({"ignore_eos": "yes"}, "ignore_eos", "true or false"),
        ({"logprobs": 21}, "logprobs", "[0, 20]"),
        ({"stream": 1}, "stream", "true or false"),
        ({"stream_options": []}, "stream_options", "object"),
        ({"cache_salt": 3}, "cache_salt", "string"),
        ({"model": 3}, "model", "string"),
    ],
)
def test_completion_rejections_name_the_field(extra: dict[str, Any], param: str,
                                              contains: str) -> None:
    router = ScriptedRouter()
    status, out = serve(router, post_json("/v1/completions", {"prompt": "p", **extra}))
    assert status == 400, out
    err = assert_error(out, param=param, contains=contains)
    assert err["type"] == "invalid_request_error"
    assert router.requests == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "tools[0].function"),
        ({"messages": [{"role": "user", "content": "x"}],
          "response_format": {"type": "xml"}}, "response_format"),
        ({"messages": [{"role": "user", "content": "x"}],
          "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format"),
        ({"messages": [{"role": "user", "content": "x"}], "guided_choice": []},
         "guided_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "guided_regex": 5}, "guided_regex"),
        ({"messages": [{"role": "user", "content": "x"}], "guided_json": [1]}, "guided_json"),
        ({"messages": [{"role": "user", "content": "x"}], "guided_grammar": 5},
         "guided_grammar"),
        ({"messages": [{"role": "user", "content": "x"}],
          "structured_outputs": {"grammar": ""}}, "structured_outputs"),
        ({"messages": [{"role": "user", "content": "x"}], "guided_regex": "a+",
          "response_format": {"type": "json_object"}}, "guided_regex"),
    ],
)
def test_chat_rejections_name_the_field(body: dict[str, Any], param: str) -> None:
    status, out = serve(ScriptedRouter(), post_json("/v1/chat/completions", body))
    assert status == 400, out
    assert_error(out, param=param)


def test_body_over_limit_is_413_json() -> None:
    async def fn(client: TestClient) -> None:
        body = io.BytesIO(b"x" * (50 * 2**20))  # with a Content-Length
        resp = await client.post("/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
        assert resp.status == 413
        err = assert_error(await resp.json(), contains="limit")
        assert err["code"] == "request_too_large"

    serve(ScriptedRouter(), fn)


def test_chunked_body_over_limit_is_413_json() -> None:
    async def body() -> AsyncIterator[bytes]:
        for _ in range(64):
            yield b" " * 1024

    async def fn(client: TestClient) -> None:
        resp = await client.post("/v1/completions", data=body(),
                                 headers={"Content-Type": "application/json"})
        assert resp.status == 413
        assert_error(await resp.json(), contains="16384")

    serve(ScriptedRouter(), fn, max_body_bytes=16384)


@pytest.mark.parametrize(
    ("code", "status", "etype"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_router_errors_map_to_http_status(code: grpc.StatusCode, status: int, etype: str,
                                          stream: bool) -> None:
    message = "prompt is 5000 tokens; max_model_len is 2048: shorten it"
    router = ScriptedRouter(error=RouterError(code, message, "prompt"))
    got, out = serve(router, post_json("/v1/completions", {"prompt": "p", "stream": stream}))
    assert got == status  # before the first message: a real status even when streaming
    if status < 500:
        err = assert_error(out, param="prompt", contains=message)
    else:  # what failed inside is logged; the client learns the request id to quote
        err = assert_error(out, param="prompt", contains=f"request {router.requests[0].request_id}")
        assert message not in err["message"]
    assert err["type"] == etype and err["code"] == code.name.lower()


def test_router_error_mid_stream_is_an_sse_error_event() -> None:
    router = ScriptedRouter(error=RouterError(grpc.StatusCode.UNAVAILABLE, "worker died"),
                            error_after=2)
    status, _, raw = serve(router, post_stream("/v1/completions",
                                               {"prompt": "p", "stream": True}))
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    *chunks, error = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello,"
    err = assert_error(error, contains=f"request {router.requests[0].request_id}")
    assert err["code"] == "unavailable" and "worker died" not in err["message"]


def test_router_ending_without_finish_is_500() -> None:
    msgs = script(TEXTS)
    msgs[-1].finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
    status, out = serve(ScriptedRouter(msgs), post_json("/v1/completions", {"prompt": "p"}))
    assert status == 500
    err = assert_error(out, contains="internal error; see the router log for request cmpl-")
    assert err["type"] == "server_error"


def test_unexpected_router_exception_is_500() -> None:
    class Broken(ScriptedRouter):
        async def generate(self, req: api_pb2.GenerateRequest,
                           timeout: float | None = None, caller: Any = None
                           ) -> AsyncIterator[Any]:
            raise ZeroDivisionError("oops")
            yield  # pragma: no cover

    status, out = serve(Broken(), post_json("/v1/completions", {"prompt": "p"}))
    assert status == 500
    err = assert_error(out, contains="internal error; see the router log for request cmpl-")
    assert "ZeroDivisionError" not in err["message"] and "oops" not in err["message"]


# --------------------------------------------------------------------------- disconnects


async def _disconnect_after_first_event(client: TestClient, router: ScriptedRouter,
                                        path: str, body: dict[str, Any]) -> None:
    resp = await client.post(path, json={**body, "stream": True})
    assert resp.status == 200
    first = await resp.content.readuntil(b"\n\n")
    assert first.startswith(b"data: {")
    resp.close()  # drops the connection
    await asyncio.wait_for(router.closed.wait(), 5)


@pytest.mark.parametrize("handler_cancellation", [False, True])
def test_disconnect_while_router_waits_cancels_the_generator(handler_cancellation: bool) -> None:
    router = ScriptedRouter(hang_after=0)
    serve(router, lambda c: _disconnect_after_first_event(c, router, "/v1/completions",
                                                          {"prompt": "p"}),
          handler_cancellation=handler_cancellation, disconnect_poll_s=0.02)
    assert router.exit == "CancelledError"


def test_disconnect_while_streaming_closes_the_generator() -> None:
    router = ScriptedRouter(endless=True)
    serve(router, lambda c: _disconnect_after_first_event(
        c, router, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        disconnect_poll_s=0.02)
    assert router.exit in ("GeneratorExit", "CancelledError")


def test_disconnect_before_first_token_non_streaming() -> None:
    router = ScriptedRouter()

    async def never(req: api_pb2.GenerateRequest, timeout: float | None = None,
                    caller: Any = None) -> AsyncIterator[Any]:
        router.requests.append(req)
        try:
            await asyncio.Event().wait()
            yield  # pragma: no cover
        except asyncio.CancelledError:
            router.exit = "CancelledError"
            raise
        finally:
            router.closed.set()

    router.generate = never  # type: ignore[method-assign]

    async def fn(client: TestClient) -> None:
        task = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "p"}))
        while not router.requests:
            await asyncio.sleep(0.005)
        task.cancel()  # the client gives up: its connection is closed
        await asyncio.wait_for(router.closed.wait(), 5)

    serve(router, fn, disconnect_poll_s=0.02)
    assert router.exit == "CancelledError"


def test_app_is_an_aiohttp_application() -> None:
    assert isinstance(create_app(ScriptedRouter()), web.Application)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    ("fields", "kind", "spec"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", ""),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
         "json_schema", SCHEMA),
        ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
        ({"guided_json": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
        ({"guided_regex": "[0-9]{3}"}, "regex", "[0-9]{3}"),
        ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
        ({"structured_outputs": {"json_object": True}}, "json_object", ""),
    ],
)
def test_structured_output_fields_reach_the_generate_request(
        chat: bool, fields: dict[str, Any], kind: str, spec: Any) -> None:
    router = ScriptedRouter()
    prompt = ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    status, out = serve(router, post_json("/v1/chat/completions" if chat
                                          else "/v1/completions", {**prompt, **fields}))
    assert status == 200, out
    structured = sampling_from_proto(router.requests[0].sampling).structured
    assert structured is not None and structured.kind == kind
    as_json = structured.spec and kind != "regex"
    assert (json.loads(structured.spec) if as_json else structured.spec) == spec


def test_response_format_text_leaves_output_unconstrained() -> None:
    router = ScriptedRouter()
    status, _ = serve(router, post_json("/v1/completions", {
        "prompt": "x", "response_format": {"type": "text"}}))
    assert status == 200
    assert not router.requests[0].sampling.HasField("structured")
