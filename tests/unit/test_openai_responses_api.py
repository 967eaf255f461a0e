"""``POST /v1/responses`` (router/openai/responses_api.py) against a scripted router: the
Responses body checked and translated into one chat GenerateRequest, refusals naming the
Responses field, and the router's messages rendered back as a response object and as the
Responses event stream, both validated against the ``openai`` SDK's own models."""

from __future__ import annotations

import asyncio
import json
import typing
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp.test_utils import TestClient
from openai.types.responses import Response, ResponseStreamEvent
from test_openai_http import (
    MODEL,
    TEXTS,
    ScriptedRouter,
    assert_error,
    post_json,
    script,
    serve,
)

from common.wire import sampling_from_proto
from protos.pdserve.v1 import common_pb2
from router.auth import KeyStore
from router.errors import RouterError
from router.openai.responses_api import parse_responses

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather now.",
          "parameters": WEATHER, "strict": True}]
CALL_TEXTS = ["Checking.", "\n<tool_call>\n", '{"name": "get_weather", ',
              '"arguments": {"city": "Paris"}}', "\n</tool_call>"]

EVENT_MODELS = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
                for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
"""Event type -> the SDK model it must validate against (strictly: every required field)."""


class Router:
    model_name = MODEL
    max_model_len = 4096


def parse(**body: Any) -> Any:
    body.setdefault("input", "hi")
    return parse_responses(body, Router())


def refused(**body: Any) -> RouterError:
    with pytest.raises(RouterError) as info:
        parse(**body)
    return info.value


def turns(parsed: Any) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in parsed.call.req.messages.messages]


# --------------------------------------------------------------------------- parsing


def test_fields_translate_into_one_chat_request() -> None:
    parsed = parse(model=MODEL, input="Say hi", instructions="Be brief.",
                   max_output_tokens=7, temperature=0.5, top_p=0.9, stream=True, seed=3,
                   metadata={"k": "v"}, user="u", store=False, include=[],
                   truncation="disabled", reasoning={"effort": None}, top_logprobs=0)
    call = parsed.call
    assert call.id.startswith("resp_") and call.req.request_id == call.id
    assert call.chat and call.stream and call.req.n == 0
    assert turns(parsed) == [("system", "Be brief."), ("user", "Say hi")]
    s = call.req.sampling
    assert s.max_tokens == 7 and s.seed == 3 and not s.HasField("structured")
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)
    assert parsed.echo["metadata"] == {"k": "v"} and parsed.echo["user"] == "u"
    assert parsed.echo["tool_choice"] == "none" and parsed.echo["tools"] == []
    assert parse().call.req.sampling.max_tokens == Router.max_model_len  # the rest of it


def test_input_items_become_the_chat_history_the_tool_parser_renders() -> None:
    parsed = parse(tools=TOOLS, input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather"},
                     {"type": "input_text", "text": "in Paris?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 21}'},
        {"role": "user", "content": "Thanks"},
    ])
    (sys_role, system), user, (asst_role, assistant), (res_role, result), last = turns(parsed)
    assert sys_role == "system" and system.startswith("Use tools.\n\n# Tools")
    assert '"name": "get_weather"' in system
    assert user == ("user", "Weather\nin Paris?")
    assert asst_role == "assistant" and assistant.startswith("Checking.")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in assistant
    assert res_role == "user" and '<tool_response>\n{"temp": 21}\n</tool_response>' in result
    assert last == ("user", "Thanks")
    assert parsed.call.tools is not None and not parsed.call.tools.forced  # auto


def test_tool_choice_forces_calls_with_the_chat_grammar() -> None:
    required = parse(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    named = parse(tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"})
    for parsed in (required, named):
        structured = sampling_from_proto(parsed.call.req.sampling).structured
        assert structured is not None and structured.kind == "grammar"
        assert "get_weather" in structured.spec
    assert not required.call.tools.parallel and not required.echo["parallel_tool_calls"]
    assert named.echo["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert named.echo["tools"][0] == {**TOOLS[0]}
    off = parse(tools=TOOLS, tool_choice="none")
    assert off.call.tools is None and len(turns(off)) == 1  # no tool listing


@pytest.mark.parametrize(("fmt", "kind", "spec"), [
    ({"type": "json_schema", "name": "s", "schema": SCHEMA, "strict": True}, "json_schema",
     SCHEMA),
    ({"type": "json_object"}, "json_object", ""),
    ({"type": "text"}, None, None),
])
def test_text_format_is_the_structured_output(fmt: dict[str, Any], kind: str | None,
                                              spec: Any) -> None:
    parsed = parse(text={"format": fmt, "verbosity": "low"})
    structured = sampling_from_proto(parsed.call.req.sampling).structured
    assert (structured.kind if structured else None) == kind
    if spec:
        assert json.loads(structured.spec) == spec
    assert parsed.echo["text"] == {"format": fmt}


CALL_ITEM = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores nothing"),
    ({"conversation": "conv_1"}, "conversation", "stores nothing"),
    ({"store": True}, "store", "leave store unset or false"),
    ({"background": True}, "background", "background"),
    ({"prompt": {"id": "p"}}, "prompt", "stored prompt"),
    ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"truncation": "auto"}, "truncation", "never truncated"),
    ({"max_tool_calls": 2}, "max_tool_calls", "parallel_tool_calls"),
    ({"top_logprobs": 3}, "top_logprobs", "/v1/chat/completions"),
    ({"input": None}, "input", "input is required"),
    ({"input": 5}, "input", "integer 5"),
    ({"input": []}, "input", "non-empty list"),
    ({"input": ["hi"]}, "input[0]", "must be an object"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "\"reasoning\""),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "user, system"),
    ({"input": [{"role": "user"}]}, "input[0].content", "must be a string"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].type", "only text parts"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
     "input[0].content[0].text", "must be a string"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]},
     "input[0]", "must follow one"),
    ({"input": [CALL_ITEM, {"type": "function_call_output", "call_id": "c2", "output": "x"}]},
     "input[1].call_id", "answers no function_call"),
    ({"input": [{**CALL_ITEM, "arguments": "[1]"}]}, "input[0].arguments", "of an object"),
    ({"input": [{**CALL_ITEM, "name": "a b"}]}, "input[0].name", "must match"),
    ({"input": [{**CALL_ITEM, "call_id": None}]}, "input[0].call_id", "must be a string"),
    ({"instructions": 3}, "instructions", "must be a string"),
    ({"max_output_tokens": 0}, "max_output_tokens", "[1, "),
    ({"temperature": "hot"}, "temperature", "must be a number"),
    ({"stream": "yes"}, "stream", "true or false"),
    ({"tools": {"type": "function"}}, "tools", "must be a list"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0]", "flat"),
    ({"tools": [{"type": "function", "name": "f", "parameters": [1]}]},
     "tools[0].parameters", "JSON schema object"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "other"}},
     "tool_choice.name", "not one of the declared tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice",
     "\"type\": \"function\", \"name\""),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls", "true or false"),
    ({"text": "json"}, "text", "must be an object"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format", "must be {"),
    ({"text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format.schema",
     "JSON schema object"),
    ({"text": {"format": {"type": "json_schema", "schema": SCHEMA, "strict": "y"}}},
     "text.format.strict", "true or false"),
    ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "tool_choice", "structured output (text.format)"),
])
def test_refusals_name_the_responses_field(body: dict[str, Any], param: str,
                                           words: str) -> None:
    err = refused(**body)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.field == param, err.message
    assert words in err.message, err.message
    assert "messages" not in err.message and ".function." not in err.message


def test_unknown_model_is_not_found() -> None:
    err = refused(model="gpt-4o")
    assert err.code == grpc.StatusCode.NOT_FOUND and err.field == "model"


# --------------------------------------------------------------------------- answers


def post_stream(body: dict[str, Any], router: ScriptedRouter,
                **app_kwargs: Any) -> tuple[int, dict[str, str], list[dict[str, Any]]]:
    """The events of a streamed request, each checked against its ``event:`` name."""
    async def fn(client: TestClient) -> tuple[int, dict[str, str], str]:
        resp = await client.post("/v1/responses", json={**body, "stream": True})
        return resp.status, dict(resp.headers), await resp.text()

    status, headers, raw = serve(router, fn, **app_kwargs)
    if status != 200:
        return status, headers, [json.loads(raw)]
    assert raw.endswith("\n\n") and "[DONE]" not in raw
    events = []
    for block in raw.split("\n\n")[:-1]:
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return status, headers, events


def validated(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``events`` after checking each against the SDK's model and the numbering."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        EVENT_MODELS[e["type"]].model_validate(e)
    return events


def test_answer_is_a_response_object_the_sdk_validates() -> None:
    router = ScriptedRouter()

    async def fn(client: TestClient) -> tuple[int, str, Any]:
        resp = await client.post("/v1/responses", json={"input": "hi", "metadata": {"a": "b"},
                                                        "max_output_tokens": 9})
        return resp.status, resp.headers["X-Request-Id"], await resp.json()

    status, rid, out = serve(router, fn)
    assert status == 200, out
    response = Response.model_validate(out)
    assert response.id == rid == router.requests[0].request_id and rid.startswith("resp_")
    assert response.status == "completed" and response.incomplete_details is None
    assert response.output_text == "Hello, world!" and response.model == MODEL
    [item] = out["output"]
    assert item["type"] == "message" and item["id"].startswith("msg_")
    assert item["status"] == "completed" and item["role"] == "assistant"
    assert item["content"] == [{"type": "output_text", "text": "Hello, world!",
                                "annotations": []}]
    assert out["usage"] == {"input_tokens": 5, "output_tokens": 5, "total_tokens": 10,
                            "input_tokens_details": {"cached_tokens": 3,
                                                     "cache_write_tokens": 0},
                            "output_tokens_details": {"reasoning_tokens": 0}}
    assert out["metadata"] == {"a": "b"} and out["max_output_tokens"] == 9
    assert out["store"] is False and out["previous_response_id"] is None


def test_cut_short_is_incomplete_with_the_reason() -> None:
    router = ScriptedRouter(script(TEXTS, finish=common_pb2.FINISH_REASON_LENGTH))
    status, out = serve(router, post_json("/v1/responses", {"input": "hi"}))
    assert status == 200
    response = Response.model_validate(out)
    assert response.status == "incomplete"
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["output"][0]["status"] == "incomplete"
    _, _, events = post_stream({"input": "hi"}, ScriptedRouter(
        script(TEXTS, finish=common_pb2.FINISH_REASON_LENGTH)))
    last = validated(events)[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_stream_is_the_responses_event_sequence() -> None:
    status, headers, events = post_stream({"input": "hi"}, ScriptedRouter())
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    kinds = [e["type"] for e in validated(events)]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * len(TEXTS),
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [e["delta"] for e in deltas] == TEXTS
    item_id = events[2]["item"]["id"]
    assert {e["item_id"] for e in deltas} == {item_id}
    assert events[-4]["text"] == "Hello, world!"
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "completed" and final.output_text == "Hello, world!"
    assert final.output[0].id == item_id and final.usage.output_tokens == 5
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == [] and events[0]["response"]["usage"] is None


def test_calls_are_function_call_items_streamed_or_whole() -> None:
    body = {"input": "Weather in Paris?", "tools": TOOLS}
    status, out = serve(ScriptedRouter(script(CALL_TEXTS)), post_json("/v1/responses", body))
    assert status == 200, out
    response = Response.model_validate(out)
    message, call = out["output"]
    assert message["content"][0]["text"] == "Checking." and response.status == "completed"
    assert call["type"] == "function_call" and call["id"].startswith("fc_")
    assert call["call_id"].startswith("call_") and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["status"] == "completed" and out["tools"] == TOOLS

    _, _, events = post_stream(body, ScriptedRouter(script(CALL_TEXTS)))
    kinds = [e["type"] for e in validated(events)]
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_"
                                                                   "arguments.delta")
    args_done, done = events[-3:-1]
    assert args_done["arguments"] == call["arguments"] and args_done["name"] == "get_weather"
    assert done["item"]["arguments"] == call["arguments"] and done["output_index"] == 1
    streamed = events[-1]["response"]["output"]
    assert [i["type"] for i in streamed] == ["message", "function_call"]
    assert streamed[1]["arguments"] == call["arguments"]


def test_forced_call_alone_has_no_message_item() -> None:
    texts = ["<tool_call>\n", '{"name": "get_weather", "arguments": {"city": "Lima"}}',
             "\n</tool_call>"]
    status, out = serve(ScriptedRouter(script(texts)), post_json("/v1/responses", {
        "input": "x", "tools": TOOLS, "tool_choice": "required"}))
    assert status == 200, out
    [call] = out["output"]
    assert call["type"] == "function_call" and call["arguments"] == '{"city": "Lima"}'


def test_an_empty_answer_is_one_empty_message() -> None:
    status, out = serve(ScriptedRouter(script([""])), post_json("/v1/responses",
                                                                {"input": "x"}))
    assert status == 200
    assert Response.model_validate(out).output_text == ""
    assert [i["type"] for i in out["output"]] == ["message"]
    _, _, events = post_stream({"input": "x"}, ScriptedRouter(script([""])))
    assert "response.output_text.delta" not in [e["type"] for e in validated(events)]


def test_router_refusal_keeps_its_status_streamed_or_not() -> None:
    busy = RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests", retry_after_s=2)
    status, out = serve(ScriptedRouter(error=busy), post_json("/v1/responses", {"input": "x"}))
    assert status == 429
    assert_error(out, contains="too many requests")
    status, headers, [body] = post_stream({"input": "x"}, ScriptedRouter(error=busy))
    assert status == 429 and headers["Retry-After"] == "2"
    assert_error(body, contains="too many requests")
    status, out = serve(ScriptedRouter(), post_json("/v1/responses", {"store": True,
                                                                      "input": "x"}))
    assert status == 400
    assert_error(out, param="store")


def test_failure_after_the_stream_began_is_an_error_then_response_failed() -> None:
    died = RouterError(grpc.StatusCode.UNAVAILABLE, "worker died")
    router = ScriptedRouter(error=died, error_after=2)
    status, _, events = post_stream({"input": "x"}, router)
    assert status == 200
    *_, error, failed = validated(events)
    assert error["type"] == "error" and error["code"] == "unavailable"
    assert router.requests[0].request_id in error["message"]
    assert "worker died" not in error["message"]
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error",
                                           "message": error["message"]}


def test_api_key_is_required_like_every_route(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-acme-0123456789abcdef acme\n")
    path.chmod(0o600)

    async def fn(client: TestClient) -> tuple[int, int]:
        anon = await client.post("/v1/responses", json={"input": "x"})
        keyed = await client.post("/v1/responses", json={"input": "x"}, headers={
            "Authorization": "Bearer sk-acme-0123456789abcdef"})
        return anon.status, keyed.status

    router = ScriptedRouter()
    assert serve(router, fn, keys=KeyStore(path)) == (401, 200)
    assert len(router.requests) == 1 and router.callers[0].tenant == "acme"


def test_disconnect_while_streaming_closes_the_generator() -> None:
    router = ScriptedRouter(endless=True)

    async def fn(client: TestClient) -> None:
        resp = await client.post("/v1/responses", json={"input": "x", "stream": True})
        assert resp.status == 200
        assert (await resp.content.readuntil(b"\n\n")).startswith(b"event: response.created")
        resp.close()
        await asyncio.wait_for(router.closed.wait(), 5)

    serve(router, fn, disconnect_poll_s=0.02)
    assert router.exit in ("GeneratorExit", "CancelledError")
