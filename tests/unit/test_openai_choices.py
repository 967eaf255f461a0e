"""Choices, best_of, echo and prompt logprobs in the OpenAI front: parsing into one
GenerateRequest, and rendering interleaved router messages back, choice by choice."""

from __future__ import annotations

from typing import Any

import pytest

from protos.pdserve.v1 import api_pb2, common_pb2
from router.errors import RouterError
from router.openai.protocol import parse_request
from router.openai.render import Renderer

PROMPT = [10, 11, 12]
STOP = common_pb2.FINISH_REASON_STOP


class Router:
    model_name = "m"
    max_model_len = 64


def strings(ids: list[int]) -> list[str]:
    return [f"<{i}>" for i in ids]


def msg(index: int, ids: list[int], lps: list[float] | None = None, *, first: bool = False,
        finish: bool = False, prompt_lp: bool = False) -> api_pb2.GenerateResponse:
    m = api_pb2.GenerateResponse(index=index, token_ids=ids, text="".join(strings(ids)))
    for t, lp in zip(ids, lps or [], strict=False):
        m.logprobs.add(token_id=t, logprob=lp, top=[common_pb2.TopLogprob(token_id=t,
                                                                          logprob=lp)])
    if first:
        m.prompt_token_ids.extend(PROMPT)
    if prompt_lp:
        for t, lp in zip(PROMPT[1:], (-1.5, -0.25), strict=True):
            m.prompt_logprobs.add(token_id=t, logprob=lp, rank=2,
                                  top=[common_pb2.TopLogprob(token_id=99, logprob=-0.125)])
    if finish:
        m.finish_reason = STOP
        m.usage.CopyFrom(common_pb2.Usage(prompt_tokens=3, completion_tokens=len(ids) + 1,
                                          cached_tokens=1))
    return m


def call(chat: bool = False, **body: Any):  # noqa: ANN201
    body.setdefault("messages" if chat else "prompt",
                    [{"role": "user", "content": "hi"}] if chat else "Hello")
    return parse_request(body, Router(), chat=chat)


def test_n_and_best_of_go_to_the_router_as_one_request_of_several_choices() -> None:
    c = call(n=2)
    assert c.req.n == 2 and c.n == 2 and not c.req.sampling.HasField("logprobs")
    c = call(n=2, best_of=3)
    assert c.req.n == 3 and c.n == 2
    assert c.req.sampling.logprobs == 0 and not c.logprobs  # ranked by; not shown
    assert call(chat=True, n=3).req.n == 3
    assert call().req.n == 0  # one choice: the field's default
    with pytest.raises(RouterError) as e:
        call(chat=True, echo=True)
    assert e.value.field == "echo"


def test_echo_with_logprobs_asks_for_prompt_logprobs() -> None:
    assert call(echo=True, logprobs=2).req.prompt_logprobs == 2
    assert not call(echo=True).req.HasField("prompt_logprobs")
    assert call(prompt_logprobs=0).req.prompt_logprobs == 0
    assert call(chat=True, prompt_logprobs=5).req.prompt_logprobs == 5


def test_interleaved_choices_render_each_with_its_own_index_and_usage_sums() -> None:
    c = call(n=2)
    msgs = [msg(1, [5], first=True), msg(0, [6]), msg(0, [7], finish=True),
            msg(1, [8], finish=True)]
    body = Renderer(c, strings).body(msgs)
    assert [(ch["index"], ch["text"]) for ch in body["choices"]] == [
        (0, "<6><7>"), (1, "<5><8>")]
    assert body["usage"]["prompt_tokens"] == 3
    assert body["usage"]["completion_tokens"] == 2 + 2  # each choice's usage, summed
    r = Renderer(call(chat=True, n=2, stream=True), strings)
    chunks = [ch for m in msgs for ch in r.chunks(m)]
    firsts = {}
    for ch in chunks:
        (choice,) = ch["choices"]
        firsts.setdefault(choice["index"], choice["delta"])
    assert all(d.get("role") == "assistant" for d in firsts.values())  # once per choice
    ends = [ch["choices"][0]["index"] for ch in chunks if ch["choices"][0]["finish_reason"]]
    assert ends == [0, 1]


def test_best_of_answers_the_likeliest_choices_best_first() -> None:
    c = call(n=2, best_of=3)
    msgs = [msg(0, [1, 2], [-3.0, -1.0], first=True, finish=True),
            msg(1, [3, 4], [-0.5, -0.5], finish=True),
            msg(2, [5, 6], [-1.0, -0.75], finish=True)]
    body = Renderer(c, strings).body(msgs)
    assert [(ch["index"], ch["text"]) for ch in body["choices"]] == [
        (0, "<3><4>"), (1, "<5><6>")]
    assert all(ch["logprobs"] is None for ch in body["choices"])  # not asked for
    assert body["usage"]["completion_tokens"] == 9  # every generated token


def test_echo_prepends_the_prompt_text_and_its_logprobs() -> None:
    c = call(echo=True, logprobs=1)
    msgs = [msg(0, [7], [-0.5], first=True, prompt_lp=True), msg(0, [8], [-0.75], finish=True)]
    (choice,) = Renderer(c, strings).body(msgs)["choices"]
    assert choice["text"] == "Hello<7><8>"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["<10>", "<11>", "<12>", "<7>", "<8>"]
    assert lp["token_logprobs"] == [None, -1.5, -0.25, -0.5, -0.75]
    assert lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [0, 4, 8, 12, 15]
    decoded = Renderer(call(prompt=PROMPT, echo=True), strings, lambda ids: "DECODED")
    (choice,) = decoded.body(msgs)["choices"]
    assert choice["text"].startswith("DECODED")  # a token-id prompt is decoded
    streamed = Renderer(call(echo=True, stream=True), strings)
    texts = [ch["choices"][0]["text"] for m in msgs for ch in streamed.chunks(m)]
    assert texts == ["Hello<7>", "<8>"]


def test_prompt_logprobs_take_vllms_shape() -> None:
    msgs = [msg(0, [7], first=True, prompt_lp=True, finish=True)]
    (choice,) = Renderer(call(prompt_logprobs=1), strings).body(msgs)["choices"]
    assert choice["prompt_logprobs"] == [
        None,
        {"99": {"logprob": -0.125, "rank": 1, "decoded_token": "<99>"},
         "11": {"logprob": -1.5, "rank": 2, "decoded_token": "<11>"}},
        {"99": {"logprob": -0.125, "rank": 1, "decoded_token": "<99>"},
         "12": {"logprob": -0.25, "rank": 2, "decoded_token": "<12>"}},
    ]
    chat = Renderer(call(chat=True, prompt_logprobs=0), strings).body(msgs)
    assert chat["prompt_logprobs"][1] == {
        "11": {"logprob": -1.5, "rank": 2, "decoded_token": "<11>"}}
    first = Renderer(call(chat=True, prompt_logprobs=0, stream=True), strings).chunks(msgs[0])
    assert first[0]["prompt_logprobs"] == chat["prompt_logprobs"]
