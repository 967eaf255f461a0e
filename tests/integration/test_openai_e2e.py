"""The OpenAI-compatible HTTP front against a real cluster: the official ``openai``
client, raw HTTP for bad input, and the leak check after each test."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest
from cluster_helpers import assert_cluster_idle

from router.client import Client


def post(cluster, path: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(cluster.http_url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_openai_client_completes_and_streams(cluster) -> None:
    client = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused")
    [model] = [m.id for m in client.models.list().data]
    done = client.completions.create(model=model, prompt="Hello there", max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True})
    with Client(cluster.target) as grpc_client:
        ref = grpc_client.generate("Hello there", max_tokens=12, temperature=0.0,
                                   ignore_eos=True)
    assert done.choices[0].text == ref.text and done.usage.completion_tokens == 12
    pieces = [c.choices[0].text for c in client.completions.create(
        model=model, prompt="Hello there", max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices]
    assert "".join(pieces) == ref.text
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens > 0
    assert chat.usage.prompt_tokens_details.cached_tokens is not None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content and chunks[-1].usage.completion_tokens > 0
    assert_cluster_idle(cluster)


def test_penalties_and_logit_bias_change_greedy_output_on_both_apis(cluster) -> None:
    client = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused")
    [model] = [m.id for m in client.models.list().data]
    kw = {"model": model, "prompt": "A A A A A A", "max_tokens": 8, "temperature": 0}
    extra = {"ignore_eos": True, "repetition_penalty": 1.0}  # what `vllm bench serve` sends
    with Client(cluster.target) as grpc_client:
        plain = grpc_client.generate(kw["prompt"], max_tokens=8, temperature=0.0,
                                     ignore_eos=True)
        first = plain.token_ids[0]
        controls = {"frequency_penalty": 2.0, "logit_bias": {first: -100.0}}
        ref = grpc_client.generate(kw["prompt"], max_tokens=8, temperature=0.0,
                                   ignore_eos=True, **controls)
    assert first not in ref.token_ids and ref.text != plain.text
    assert client.completions.create(**kw, extra_body=extra).choices[0].text == plain.text
    done = client.completions.create(**kw, frequency_penalty=2.0,
                                     logit_bias={str(first): -100}, extra_body=extra)
    assert done.choices[0].text == ref.text
    code, payload = post(cluster, "/v1/completions", {**kw, "frequency_penalty": 3})
    assert code == 400 and payload["error"]["param"] == "frequency_penalty"
    assert "[-2.0, 2.0]" in payload["error"]["message"]
    assert_cluster_idle(cluster)


@pytest.mark.parametrize(
    ("body", "status", "text"),
    [
        (b"{not json", 400, "JSON"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "gpt-4"),
        ({"prompt": ""}, 400, "at least 1 token"),
        ({"prompt": "word " * 600}, 400, "max_model_len"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "top_p": 2}, 400, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "n": 17}, 400, "n must be in [1, 16]"),
        (b'{"prompt": "' + b"a" * (50 * 2**20) + b'"}', 413, ""),
    ],
)
def test_bad_http_requests_get_clear_errors(cluster, body, status, text) -> None:
    code, payload = post(cluster, "/v1/completions", body)
    assert code == status and "error" in payload and text in payload["error"]["message"]
    ok, _ = post(cluster, "/v1/completions", {"prompt": "still serving", "max_tokens": 2})
    assert ok == 200
    assert_cluster_idle(cluster)


def test_http_client_disconnect_frees_blocks(cluster) -> None:
    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=cluster.http_url + "/v1", api_key="unused")
        stream = await client.completions.create(
            model="llama", prompt="go on", max_tokens=400, stream=True,
            extra_body={"ignore_eos": True})
        async for _ in stream:
            break
        await stream.close()
        await client.close()

    asyncio.run(run())
    assert_cluster_idle(cluster)


def test_structured_output_over_http_and_grpc(cluster) -> None:
    """response_format json_schema (OpenAI SDK), guided_choice (vLLM), and the same
    grammar set directly on gRPC: every output conforms; the fronts agree (greedy)."""
    from common.sampling import StructuredOutput

    client = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused")
    [model] = [m.id for m in client.models.list().data]
    # The tiny random model would pad with whitespace forever where JSON allows it:
    # llguidance's own schema option makes the JSON compact.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "tag": {"enum": ["red", "green"]}},
              "required": ["ok", "tag"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "a JSON object please"}],
        max_tokens=60, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "t", "schema": schema,
                                                   "strict": True}})
    text = chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop", text
    assert set(json.loads(text)) == {"ok", "tag"} and json.loads(text)["tag"] in ("red", "green")
    choices = ["alpha", "beta", "gamma"]
    for seed in range(3):
        done = client.completions.create(model=model, prompt="Pick one:", max_tokens=8,
                                         seed=seed, extra_body={"guided_choice": choices})
        assert done.choices[0].text in choices
    with Client(cluster.target) as grpc_client:
        ref = grpc_client.generate(
            "Pick one:", max_tokens=60, temperature=0.0,
            structured=StructuredOutput("json_schema", json.dumps(schema)))
    done = client.completions.create(model=model, prompt="Pick one:", max_tokens=60,
                                     temperature=0, extra_body={"guided_json": schema})
    assert done.choices[0].text == ref.text and json.loads(ref.text)["ok"] in (True, False)
    with pytest.raises(openai.BadRequestError, match="structured"):
        client.completions.create(model=model, prompt="x", max_tokens=4,
                                  extra_body={"guided_json": {"type": "nonsense"}})
    assert_cluster_idle(cluster)


def test_choices_best_of_echo_and_prompt_logprobs_over_http(cluster) -> None:
    """n=3 greedy gives three identical texts equal to n=1; seeded n=3 at temperature 1
    is reproducible and differs across choices (streamed: the same texts by index);
    best_of=3 answers n=2; echo leads the text with the prompt and its logprobs with
    null; prompt_logprobs take vLLM's shape; one prompt's tokens are counted once."""
    client = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0)
    [model] = [m.id for m in client.models.list().data]
    base = {"model": model, "prompt": "Once upon a time", "max_tokens": 10}
    one = client.completions.create(**base, temperature=0)
    three = client.completions.create(**base, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.text for c in three.choices} == {one.choices[0].text}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    seeded = {**base, "temperature": 1.0, "seed": 7, "n": 3}
    a = [c.text for c in client.completions.create(**seeded).choices]
    b = [c.text for c in client.completions.create(**seeded).choices]
    assert a == b and len(set(a)) > 1
    streamed = ["", "", ""]
    for chunk in client.completions.create(**seeded, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == a
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=2,
        temperature=1.0, seed=3)
    assert [c.index for c in chat.choices] == [0, 1]
    best = client.completions.create(**base, temperature=1.0, seed=5, n=2, best_of=3,
                                     logprobs=0)
    assert len(best.choices) == 2 and best.usage.completion_tokens == 3 * 10
    scores = [sum(c.logprobs.token_logprobs) for c in best.choices]
    assert scores == sorted(scores, reverse=True)
    echoed = client.completions.create(**base, temperature=0, echo=True, logprobs=1)
    (e,) = echoed.choices
    assert e.text == "Once upon a time" + one.choices[0].text
    assert e.logprobs.token_logprobs[0] is None and e.logprobs.top_logprobs[0] is None
    assert all(lp is not None for lp in e.logprobs.token_logprobs[1:])
    assert len(e.logprobs.tokens) == one.usage.prompt_tokens + 10
    status, body = post(cluster, "/v1/completions", {**base, "temperature": 0,
                                                     "prompt_logprobs": 1})
    assert status == 200, body
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == one.usage.prompt_tokens
    assert all(1 <= len(d) <= 2 and all(v["logprob"] <= 0 for v in d.values())
               for d in plp[1:])
    assert_cluster_idle(cluster)


def test_bad_words_keep_a_greedy_word_out(cluster, tiny_checkpoints) -> None:
    """vLLM's bad_words: the word greedy decoding would write first is never written."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoints["llama"])
    client = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0)
    [model] = [m.id for m in client.models.list().data]
    kw = {"model": model, "prompt": "The story of the", "max_tokens": 8, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    with Client(cluster.target) as grpc_client:
        ref = grpc_client.generate("The story of the", max_tokens=8, temperature=0.0,
                                   ignore_eos=True)
    word = next(w for w in (tok.decode([t]).strip() for t in ref.token_ids)
                if w and len(tok.encode(w, add_special_tokens=False)) == 1)
    banned = {seq[0] for seq in (tok.encode(word, add_special_tokens=False),
                                 tok.encode(" " + word, add_special_tokens=False))
              if len(seq) == 1}
    assert banned & set(ref.token_ids)
    done = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True,
                                                             "bad_words": [word]}})
    with Client(cluster.target) as grpc_client:
        kept = grpc_client.generate("The story of the", max_tokens=8, temperature=0.0,
                                    ignore_eos=True, bad_words=[word])
    assert done.choices[0].text == kept.text != ref.text
    assert not banned & set(kept.token_ids)
    assert_cluster_idle(cluster)
