"""Tool calling and ``guided_grammar`` through the HTTP front with the official ``openai``
client, on the real default model (SmolLM2-135M; the shared tiny-model cluster's 512
positions cannot hold a tool listing): forced calls are always well-formed calls of a
declared function with valid arguments, streamed calls add up to the whole ones, grammar
output follows the grammar, and the cluster is idle afterwards."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from cluster_helpers import assert_cluster_idle, start

pytestmark = pytest.mark.slow

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object",
        "properties": {"timezone": {"type": "string", "maxLength": 20}},
        "required": ["timezone"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "description": desc,
                                           "parameters": SCHEMAS[name]}}
         for name, desc in [("get_weather", "Current weather in a city."),
                            ("get_time", "Current time in a time zone.")]]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Perth", "Quito", "Seoul", "Rome", "Dakar"]


@pytest.fixture(scope="module")
def smol(smollm2_path, tmp_path_factory):  # noqa: ANN001, ANN201
    """One mixed worker on SmolLM2, room for ten tool prompts at once."""
    c = start(smollm2_path, tmp_path_factory.mktemp("tools-logs"), kv_cache_gb=0.3,
              max_model_len=2048)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(smol) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=smol.http_url + "/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, city: str, max_tokens: int = 60, **kw: Any) -> Any:
    """One question about ``city``; 60 tokens hold any one call of ``TOOLS``."""
    return client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=max_tokens, tools=TOOLS,
        messages=[{"role": "user", "content": f"What is the weather in {city} right now?"}],
        **kw)


def assert_valid(call: Any, names: set[str]) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_required_tool_choice_always_returns_a_valid_call(smol, client) -> None:  # noqa: ANN001
    def required(city: str) -> Any:
        return ask(client, city, tool_choice="required", parallel_tool_calls=False)

    answers = [required(CITIES[0])]  # then the others reuse its cached tool listing
    with ThreadPoolExecutor(len(CITIES) - 1) as pool:
        answers += pool.map(required, CITIES[1:])
    for answer in answers:
        [choice] = answer.choices
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert_valid(call, set(SCHEMAS))
        assert choice.message.content is None
    assert_cluster_idle(smol)


def test_named_tool_choice_calls_that_function_and_streams_alike(smol, client) -> None:  # noqa: ANN001
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = ask(client, "Oslo", tool_choice=named, parallel_tool_calls=False)
    [choice] = whole.choices
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time" and choice.finish_reason == "tool_calls"
    assert_valid(call, {"get_time"})
    chunks = list(ask(client, "Oslo", tool_choice=named, parallel_tool_calls=False,
                      stream=True))
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for tc in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += tc.id or ""
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    assert calls[0]["name"] == call.function.name
    assert calls[0]["arguments"] == call.function.arguments  # greedy: the same call
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert sum(len(c.choices[0].delta.tool_calls or []) for c in chunks) > 2  # streamed
    assert_cluster_idle(smol)


def test_auto_and_a_tool_history_are_served(smol, client) -> None:  # noqa: ANN001
    answer = ask(client, "Lima", max_tokens=24, tool_choice="auto")
    message = answer.choices[0].message
    assert message.content or message.tool_calls
    for call in message.tool_calls or []:
        assert_valid(call, set(SCHEMAS))
    history = [
        {"role": "user", "content": "Weather in Lima?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Lima", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 19}'},
    ]
    done = client.chat.completions.create(model=answer.model, messages=history, tools=TOOLS,
                                          temperature=0, max_tokens=8)
    assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert_cluster_idle(smol)


def test_guided_grammar_output_follows_lark_and_gbnf_grammars(smol, client) -> None:  # noqa: ANN001
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct"
    grammars = [('start: "yes" | "no"', r"yes|no"),
                ('root ::= [0-9] [0-9] [0-9] [0-9] "-" [0-1] [0-9] "-" [0-3] [0-9]',
                 r"[0-9]{4}-[01][0-9]-[0-3][0-9]")]
    for grammar, pattern in grammars:
        for extra in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
            done = client.chat.completions.create(
                model=model, temperature=0, max_tokens=16, extra_body=extra,
                messages=[{"role": "user", "content": "When did it rain? Is it raining?"}])
            assert re.fullmatch(pattern, done.choices[0].message.content), done
            assert done.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, max_tokens=4,
                                       messages=[{"role": "user", "content": "x"}],
                                       extra_body={"guided_grammar": "start: undefined"})
    # the worker's compile error, which names the field in its message
    assert info.value.body["message"].startswith("structured: the grammar spec does not "
                                                 "compile"), info.value.body
    assert_cluster_idle(smol)


def test_responses_api_function_tools_and_their_history(smol, client) -> None:  # noqa: ANN001
    """``/v1/responses`` (flat function tools): a required call is the chat API's call as a
    function_call item, a named one streams its arguments, and the call sent back with its
    output as input items continues the conversation."""
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    question = "What is the weather in Paris right now?"
    done = client.responses.create(model="SmolLM2-135M-Instruct", temperature=0,
                                   max_output_tokens=60, tools=tools, input=question,
                                   tool_choice="required", parallel_tool_calls=False)
    [call] = done.output
    assert done.status == "completed" and call.type == "function_call", done
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    [chat] = ask(client, "Paris", tool_choice="required",
                 parallel_tool_calls=False).choices[0].message.tool_calls
    assert (call.name, call.arguments) == (chat.function.name, chat.function.arguments)

    named = {"type": "function", "name": "get_time"}
    events = list(client.responses.create(model="SmolLM2-135M-Instruct", temperature=0,
                                          max_output_tokens=60, tools=tools, input=question,
                                          tool_choice=named, parallel_tool_calls=False,
                                          stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [item] = events[-1].response.output
    assert events[-1].type == "response.completed" and item.name == "get_time"
    assert len(deltas) > 1 and "".join(deltas) == item.arguments
    jsonschema.validate(json.loads(item.arguments), TIME)

    history = [{"role": "user", "content": question}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id,
                "output": '{"temperature": 19}'}]
    after = client.responses.create(model="SmolLM2-135M-Instruct", temperature=0,
                                    max_output_tokens=8, tools=tools, input=history)
    assert after.status in ("completed", "incomplete") and after.output
    assert_cluster_idle(smol)
