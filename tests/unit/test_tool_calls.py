"""Tool calling in the OpenAI front: the request fields' checks, the Hermes prompt, the
output reader (whole and streamed at every split) and the grammar that forces calls,
compiled by llguidance against a real tokenizer."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import hypothesis.strategies as st
import llguidance
import llguidance.hf
import pytest
import tiny_models
from hypothesis import given, settings
from transformers import AutoTokenizer

from common.sampling import MAX_STRUCTURED_SPEC_BYTES
from common.wire import sampling_from_proto
from protos.pdserve.v1 import common_pb2
from router.errors import RouterError
from router.openai.protocol import parse_request
from router.openai.render import Renderer
from router.openai.tool_parsers import (
    HERMES,
    Arguments,
    CallStart,
    Content,
    Parsed,
    fold,
    parse,
    tool_parser,
)
from router.openai.tools import MAX_TOOLS, Tool, ToolCall

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop"}}]
NAMES = frozenset({"get_weather", "noop"})
USER = [{"role": "user", "content": "Weather in Paris?"}]

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n' \
       '</tool_call>'
NOOP = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'


class Router:
    model_name = "m"
    max_model_len = 4096


def request(**body: Any) -> Any:
    return parse_request({"messages": USER, **body}, Router(), chat=True)


def refused(**body: Any) -> RouterError:
    with pytest.raises(RouterError) as info:
        request(**body)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return info.value


def ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def read(text: str, forced: bool = False, names: frozenset[str] = NAMES) -> Parsed:
    return parse(HERMES.stream(names, forced, ids()), text)


# --------------------------------------------------------------------------- request fields


@pytest.mark.parametrize(
    ("body", "param", "contains"),
    [
        ({"tools": {"a": 1}}, "tools", "list"),
        ({"tools": [TOOLS[0]] * (MAX_TOOLS + 1)}, "tools", f"at most {MAX_TOOLS}"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "function"),
        ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "bad name"}}]},
         "tools[1].function.name", "^[a-zA-Z0-9_-]{1,64}$"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
         "tools[0].function.name", "{1,64}"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "twice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         "tools[0].function.parameters", "JSON schema object"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"description": "x" * MAX_STRUCTURED_SPEC_BYTES}}}]},
         "tools[0].function.parameters", f"at most {MAX_STRUCTURED_SPEC_BYTES}"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
         "tools[0].function.description", "string"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "required"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "not one of the declared tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_json": {"type": "object"}},
         "tool_choice", "guided_json"),
        ({"tools": [{"type": "function", "function": {
            "name": f"f{i}", "parameters": {"description": "x" * 600}}} for i in range(120)],
          "tool_choice": "required"}, "tools", f"at most {MAX_STRUCTURED_SPEC_BYTES}"),
    ],
)
def test_bad_tool_fields_are_refused_naming_the_field_and_limit(
        body: dict[str, Any], param: str, contains: str) -> None:
    err = refused(**body)
    assert err.field == param and contains in err.message, (err.field, err.message)


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "tool", "content": "1"}], "messages[0].role"),
        ([*USER, {"role": "tool", "content": "1"}], "messages[1].role"),
        ([*USER, {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": "{nope"}}]}], "messages[1].tool_calls[0].function.arguments"),
        ([*USER, {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": "[1]"}}]}], "messages[1].tool_calls[0].function.arguments"),
        ([*USER, {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "f f", "arguments": "{}"}}]}], "messages[1].tool_calls[0].function.name"),
        ([{"role": "user", "content": "x", "tool_calls": []},
          {"role": "user", "content": "x", "tool_calls": [{}]}], "messages[1].tool_calls"),
    ],
)
def test_bad_tool_turns_are_refused_naming_the_message(messages: list[dict[str, Any]],
                                                       param: str) -> None:
    with pytest.raises(RouterError) as info:
        parse_request({"messages": messages}, Router(), chat=True)
    assert info.value.field == param, info.value.message


def test_tool_choice_none_offers_nothing_and_auto_constrains_nothing() -> None:
    plain = request()
    none = request(tools=TOOLS, tool_choice="none")
    assert none.tools is None and none.req.messages == plain.req.messages
    auto = request(tools=TOOLS)
    assert auto.tools is not None and auto.tools.choice == "auto"
    assert not auto.req.sampling.HasField("structured")
    system = auto.req.messages.messages[0]
    assert system.role == "system" and "<tools>" in system.content
    assert json.loads(system.content.split("<tools>\n")[1].split("\n")[0]) == TOOLS[0]


def test_forced_choices_send_a_grammar_of_the_allowed_functions() -> None:
    required = request(tools=TOOLS, tool_choice="required")
    s = sampling_from_proto(required.req.sampling).structured
    assert s is not None and s.kind == "grammar"
    assert '"get_weather"' in s.spec and '"noop"' in s.spec and "call)*" in s.spec
    named = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "noop"}},
                    parallel_tool_calls=False)
    s = sampling_from_proto(named.req.sampling).structured
    assert s is not None and '"noop"' in s.spec and "get_weather" not in s.spec
    assert "call)*" not in s.spec and named.tools is not None and named.tools.names == {"noop"}


def test_history_renders_calls_and_results_in_hermes_turns() -> None:
    messages = [
        {"role": "system", "content": "Be brief."}, *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":1}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "noop", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "ok"}]},
        {"role": "user", "content": "Thanks"},
    ]
    call = parse_request({"messages": messages, "tools": TOOLS}, Router(), chat=True)
    turns = [(m.role, m.content) for m in call.req.messages.messages]
    assert [r for r, _ in turns] == ["system", "user", "assistant", "user", "user"]
    assert turns[0][1].startswith("Be brief.\n\n# Tools")
    assert turns[2][1] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n'
        '</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
    assert turns[3][1] == ("<tool_response>\nsunny\n</tool_response>\n"
                           "<tool_response>\nok\n</tool_response>")
    # what the model is shown is what the reader reads back
    assert read(turns[2][1]).calls == (
        ToolCall("get_weather", '{"city": "Paris", "days": 1}', "call_0"),
        ToolCall("noop", "{}", "call_1"))


def test_unknown_parser_name_is_refused() -> None:
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("mistral")


# --------------------------------------------------------------------------- output reader


def test_calls_are_read_with_the_text_outside_them_as_content() -> None:
    out = read(f"Let me check.\n{CALL}\n{NOOP}")
    assert out.content == "Let me check."
    assert out.calls == (ToolCall("get_weather", '{"city": "Paris", "days": 3}', "call_0"),
                         ToolCall("noop", "{}", "call_1"))
    assert read(CALL).content is None
    assert read("no calls here").calls == ()
    assert read("no calls here").content == "no calls here"


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',  # bad JSON
        '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',  # not declared
        '<tool_call>\n{"name": "noop", "arguments": "{}"}\n</tool_call>',  # not an object
        '<tool_call>\n{"name": "noop", "arguments": {}, "x": 1}\n</tool_call>',  # extra key
        '<tool_call>\n{"name": "noop", "arguments": {"a": NaN}}\n</tool_call>',  # not JSON
        "a <tool_call without its bracket",
        "<tool_call>\n{\"name\": \"noop\", \"argu",  # cut short
    ],
)
def test_what_only_looks_like_a_call_stays_content(text: str) -> None:
    out = read(f"Hi {text} bye")
    assert out.calls == () and out.content == f"Hi {text} bye"


def test_an_unclosed_but_complete_call_at_the_end_is_a_call() -> None:
    out = read('<tool_call>\n{"name": "noop", "arguments": {}}')
    assert out.calls == (ToolCall("noop", "{}", "call_0"),) and out.content is None


def test_a_forced_call_cut_short_is_a_call_with_the_arguments_it_has() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Li</tool_'
    assert read(text, forced=True).calls == (
        ToolCall("get_weather", '{"city": "Li</tool_', "call_0"),)
    assert read(text).calls == ()  # unforced, it is only text


def test_arguments_keep_the_generated_json_text() -> None:
    text = '<tool_call>{"name":"get_weather","arguments":{"city":"P\\u00e9","days":2}}' \
           '</tool_call>'
    assert read(text).calls[0].arguments == '{"city":"P\\u00e9","days":2}'
    dup = '<tool_call>{"name": "noop", "arguments": {"a": 1}, "arguments": {}}</tool_call>'
    assert read(dup).calls[0].arguments == "{}"  # the last one, as JSON parsers read it


SAMPLES = [
    f"Let me check.\n{CALL}\n{NOOP}",
    f"{CALL}\n{CALL}",
    f"<tool_ca{CALL}</tool_call> <tool_call>\n{{\"name\": \"x\"}}</tool_call>\n\nbye <",
    "plain text with a < and a </tool_call> in it\n\n",
    f"  \n{NOOP}  trailing \n",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "days": 7}}',
    '<tool_call>\n{"name": "noop", "arguments": {"nested": {"a": [1, {"b": "}"}]}}}\n'
    "</tool_call>",
    'x <tool_call>\n{"name": "noop", "arguments": {"a": "</tool_call>"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Li',  # cut short
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Li</tool_',
    '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_',
]


def stream(text: str, cuts: list[int], forced: bool) -> Parsed:
    s = HERMES.stream(NAMES, forced, ids())
    events = []
    bounds = [0, *cuts, len(text)]
    for a, b in itertools.pairwise(bounds):
        events += s.feed(text[a:b])
    events += s.finish()
    assert all(not isinstance(e, Content) or e.text for e in events), events
    return fold(events)


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("text", SAMPLES)
def test_streaming_at_any_split_reads_what_the_whole_text_reads(text: str,
                                                                forced: bool) -> None:
    whole = read(text, forced)
    for cut in range(len(text) + 1):
        assert stream(text, [cut], forced) == whole, cut
    rng = random.Random(text)  # seeded by the text: the same splits every run
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        assert stream(text, cuts, forced) == whole, cuts
    assert stream(text, list(range(1, len(text))), forced) == whole  # character by character


def test_forced_calls_stream_as_they_are_generated_and_auto_ones_when_closed() -> None:
    pieces = list(CALL)
    for forced in (True, False):
        s = HERMES.stream(NAMES, forced, ids())
        before_close = []
        for ch in pieces[:-len("</tool_call>")]:
            before_close += s.feed(ch)
        rest = []
        for ch in pieces[-len("</tool_call>"):]:
            rest += s.feed(ch)
        rest += s.finish()
        args = [e.text for e in before_close if isinstance(e, Arguments)]
        if forced:
            assert before_close[0] == CallStart(0, "call_0", "get_weather")
            assert len(args) > 5 and "".join(args) == '{"city": "Paris", "days": 3'
            assert rest == [Arguments(0, "}")]
        else:
            assert before_close == []
            assert rest == [CallStart(0, "call_0", "get_weather"),
                            Arguments(0, '{"city": "Paris", "days": 3}')]


def test_a_reader_costs_microseconds_per_token() -> None:
    """The reader's work per streamed token: a ~1000-token output (one char a token
    would be worse than real: tokens are ~4 chars) read in well under a millisecond per
    token, forced and not."""
    import time

    text = "Sure, " * 100 + "\n" + "\n".join([CALL] * 20)
    for forced in (False, True):
        s = HERMES.stream(NAMES, forced, ids())
        t0 = time.perf_counter()
        for i in range(0, len(text), 4):
            s.feed(text[i:i + 4])
        s.finish()
        per_token = (time.perf_counter() - t0) / (len(text) / 4)
        assert per_token < 1e-4, per_token


# --------------------------------------------------------------------------- responses


def scripted(texts: list[str], finish: int = common_pb2.FINISH_REASON_STOP) -> list[Any]:
    from protos.pdserve.v1 import api_pb2

    msgs = [api_pb2.GenerateResponse(request_id="r", token_ids=[i], text=t)
            for i, t in enumerate(texts)]
    msgs[-1].finish_reason = finish
    return msgs


def test_renderer_answers_tool_calls_whole_and_streamed_alike() -> None:
    texts = ["Checking", ".\n<tool", "_call>\n", CALL[len("<tool_call>\n"):20], CALL[20:], "\n",
             NOOP]
    for forced in (False, True):
        kw = {"tool_choice": "required"} if forced else {}
        body = Renderer(request(tools=TOOLS, **kw), list).body(scripted(texts))
        [choice] = body["choices"]
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert message["content"] == "Checking."
        calls = message["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["get_weather", "noop"]
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
        renderer = Renderer(request(tools=TOOLS, **kw), list)
        chunks = [c for m in scripted(texts) for c in renderer.chunks(m)]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert deltas[0]["role"] == "assistant"
        assert "".join(d.get("content") or "" for d in deltas) == "Checking."
        streamed: dict[int, dict[str, str]] = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                entry = streamed.setdefault(tc["index"], {"name": "", "arguments": ""})
                entry["name"] += tc["function"].get("name", "")
                entry["arguments"] += tc["function"]["arguments"]
        assert [streamed[i] for i in sorted(streamed)] == [c["function"] for c in calls]
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_a_call_cut_short_keeps_finish_reason_length() -> None:
    body = Renderer(request(tools=TOOLS), list).body(
        scripted([CALL, "\n<tool_call>\n{"], finish=common_pb2.FINISH_REASON_LENGTH))
    [choice] = body["choices"]
    assert choice["finish_reason"] == "length" and len(choice["message"]["tool_calls"]) == 1


def test_without_tools_the_message_has_no_tool_calls() -> None:
    body = Renderer(request(), list).body(scripted([CALL]))
    message = body["choices"][0]["message"]
    assert message["content"] == CALL and "tool_calls" not in message
    assert body["choices"][0]["finish_reason"] == "stop"


# --------------------------------------------------------------------------- grammar


@pytest.fixture(scope="module")
def lltok(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """A real byte-level BPE tokenizer (the test suite's tiny one) for llguidance."""
    tok = AutoTokenizer.from_pretrained(
        tiny_models.train_tokenizer(Path(tmp_path_factory.mktemp("tok"))))
    return tok, llguidance.hf.from_tokenizer(tok, n_vocab=len(tok),
                                             eos_token=tok.eos_token_id)


def matches(lltok: tuple[Any, Any], grammar: str, text: str) -> bool:
    """Whether the grammar accepts exactly ``text`` (then end of sequence)."""
    tok, ll = lltok
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(grammar),
                                   log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    token_ids = tok(text, add_special_tokens=False).input_ids
    if matcher.validate_tokens(token_ids) != len(token_ids):
        return False
    assert matcher.consume_tokens(token_ids)
    return matcher.is_accepting()


def declared(tools: list[dict[str, Any]]) -> list[Tool]:
    call = parse_request({"messages": USER, "tools": tools}, Router(), chat=True)
    assert call.tools is not None
    return list(call.tools.tools)


def test_the_call_grammar_accepts_declared_calls_with_valid_arguments(lltok: Any) -> None:
    one = HERMES.grammar(declared(TOOLS), parallel=False)
    many = HERMES.grammar(declared(TOOLS), parallel=True)
    for g in (one, many):
        assert matches(lltok, g, CALL) and matches(lltok, g, NOOP)
        for bad in [
            CALL.replace("Paris", "Rome"),  # not in the enum
            CALL.replace('"days": 3', '"days": 9'),  # above the maximum
            CALL.replace(', "days": 3', ""),  # a required argument missing
            CALL.replace('"days": 3', '"days": 3, "x": 1'),  # additionalProperties false
            CALL.replace("get_weather", "get_time"),  # not declared
            CALL.replace('": "', '":"'),  # not the one spelling
            "Sure! " + CALL,  # text before the call
            CALL[:-1],  # unfinished
        ]:
            assert not matches(lltok, g, bad), bad
    assert matches(lltok, many, f"{CALL}\n{NOOP}")
    assert not matches(lltok, one, f"{CALL}\n{NOOP}")


def test_the_grammar_keeps_references_of_the_parameters(lltok: Any) -> None:
    params = {"type": "object", "$defs": {"unit": {"enum": ["C", "F"]}},
              "properties": {"unit": {"$ref": "#/$defs/unit"}}, "required": ["unit"]}
    tools = declared([{"type": "function", "function": {"name": "temp", "parameters": params}}])
    g = HERMES.grammar(tools, parallel=False)
    ok = '<tool_call>\n{"name": "temp", "arguments": {"unit": "C"}}\n</tool_call>'
    assert matches(lltok, g, ok) and not matches(lltok, g, ok.replace('"C"', '"K"'))


def test_tool_descriptions_cannot_break_out_of_the_grammar(lltok: Any) -> None:
    params = {"type": "object", "description": '"} \n%ignore /x/\nstart: "pwned"',
              "properties": {}}
    tools = declared([{"type": "function", "function": {"name": "f", "parameters": params}}])
    g = HERMES.grammar(tools, parallel=False)
    assert matches(lltok, g, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    assert not matches(lltok, g, "pwned")



# --------------------------------------------------------------------------- hostile input

KEYS = st.sampled_from(["type", "function", "name", "parameters", "arguments", "id",
                        "description", "role", "content", "tool_calls", "tool_call_id"])
ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | st.sampled_from(
        ["function", "noop", "get_weather", "required", "auto", "tool", "assistant", "{}",
         '{"a": 1}', "user"]) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=12)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(tools=ANY, choice=ANY, parallel=ANY, extra=st.lists(ANY, max_size=3))
def test_any_tool_fields_are_served_or_refused_naming_a_field(
        tools: Any, choice: Any, parallel: Any, extra: list[Any]) -> None:
    body = {"messages": [*USER, *extra], "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": parallel}
    try:
        call = parse_request(body, Router(), chat=True)
    except RouterError as e:
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT and e.field, e
        return
    Renderer(call, list).body(scripted([CALL, NOOP]))


def test_the_deployment_file_offers_every_parser_by_name() -> None:
    from cluster.deployment import TOOL_CALL_PARSERS
    from router.openai.tool_parsers import PARSERS

    assert TOOL_CALL_PARSERS == tuple(PARSERS)
