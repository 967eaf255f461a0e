"""``POST /v1/responses`` against a real cluster with the official ``openai`` client:
plain, streamed (raw events and the SDK's accumulating helper), ``text.format``
json_schema, and a refusal; the output agrees with ``/v1/chat/completions`` (greedy), and
the cluster is idle afterwards. Function tools need a context the shared tiny-model
cluster lacks: they are tested in test_openai_tools.py."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from cluster_helpers import assert_cluster_idle

INSTRUCTIONS = "Answer briefly."
QUESTION = "Hello there"


def sdk(cluster) -> tuple[openai.OpenAI, str]:  # noqa: ANN001
    client = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0)
    [model] = [m.id for m in client.models.list().data]
    return client, model


def test_plain_and_streamed_responses_match_chat(cluster) -> None:  # noqa: ANN001
    client, model = sdk(cluster)
    kw = {"model": model, "instructions": INSTRUCTIONS, "input": QUESTION,
          "max_output_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    chat = client.chat.completions.create(
        model=model, max_tokens=12, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": INSTRUCTIONS},
                  {"role": "user", "content": QUESTION}])
    done = client.responses.create(**kw)
    assert done.id.startswith("resp_") and done.object == "response"
    assert done.output_text == chat.choices[0].message.content
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.usage.output_tokens == 12
    assert done.usage.input_tokens == chat.usage.prompt_tokens
    assert done.usage.total_tokens == done.usage.input_tokens + 12
    [item] = done.output
    assert item.type == "message" and item.role == "assistant"

    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == done.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 12
    assert_cluster_idle(cluster)


def test_text_format_json_schema_output_validates(cluster) -> None:  # noqa: ANN001
    client, model = sdk(cluster)
    # The tiny random model would pad with whitespace where JSON allows it (see
    # test_openai_e2e.py): llguidance's own option keeps the JSON compact.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "tag": {"enum": ["red", "green"]}},
              "required": ["ok", "tag"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}
    fmt = {"type": "json_schema", "name": "t", "schema": schema, "strict": True}
    done = client.responses.create(model=model, input="a JSON object please",
                                   max_output_tokens=60, temperature=0, text={"format": fmt})
    assert done.status == "completed", done
    jsonschema.validate(json.loads(done.output_text), schema)
    assert done.text.format.type == "json_schema"
    # The SDK's helper accumulates the events (its final response needs a
    # response.completed: a response cut short ends with response.incomplete, as OpenAI's).
    with client.responses.stream(model=model, input="a JSON object please",
                                 max_output_tokens=60, temperature=0,
                                 text={"format": fmt}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    assert final.output_text == done.output_text and final.id != done.id
    assert_cluster_idle(cluster)


def test_stored_state_is_refused_naming_the_field(cluster) -> None:  # noqa: ANN001
    client, model = sdk(cluster)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=model, input="x", previous_response_id="resp_1")
    assert info.value.body["param"] == "previous_response_id", info.value.body
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="x")
    assert_cluster_idle(cluster)
