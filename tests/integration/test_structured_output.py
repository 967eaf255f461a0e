"""Structured output on the real default model (SmolLM2-135M), offline engine, batched:
JSON schema, choice and regex outputs always conform; a schema compiles once; a
migrated request re-derives the grammar from its tokens and continues identically."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import assert_no_leaks

from common.request import Request
from common.sampling import InvalidRequestError, SamplingParams, StructuredOutput
from workers.engine.llm import LLM

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
JSON_SCHEMA = StructuredOutput("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:  # noqa: ANN001
    return LLM(smollm2_path, dtype="float32", num_blocks=512, block_size=16)


def chat(llm: LLM, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             tokenize=False, add_generation_prompt=True)


def test_json_schema_output_validates_on_50_prompts(llm: LLM) -> None:
    prompts = [chat(llm, f"Invent person number {i} and describe them as JSON.")
               for i in range(25)]
    prompts += [f"Record {i}:" for i in range(25)]  # no chat template, no hint of JSON
    compiles = llm.engine.grammars.compiles
    outs = llm.generate(prompts, [
        SamplingParams(max_tokens=48, temperature=0.0 if i % 2 else 0.8, seed=i,
                       structured=JSON_SCHEMA) for i in range(len(prompts))])
    for out in outs:
        assert out.error is None and out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert llm.engine.grammars.compiles <= compiles + 1  # once per schema, then cached
    assert_no_leaks(llm.engine)


def test_choice_and_regex_always_conform(llm: LLM) -> None:
    choices = ["red", "green", "blue", "not sure"]
    prompts = [chat(llm, f"Pick a colour for thing {i}.") for i in range(8)]
    outs = llm.generate(prompts, [SamplingParams(
        max_tokens=16, temperature=1.0, seed=i,
        structured=StructuredOutput("choice", json.dumps(choices))) for i in range(8)])
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs)
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    outs = llm.generate(prompts, SamplingParams(
        max_tokens=16, temperature=0.0, structured=StructuredOutput("regex", pattern)))
    assert all(re.fullmatch(pattern, o.text) for o in outs), [o.text for o in outs]
    assert_no_leaks(llm.engine)


def test_migrated_request_rederives_the_grammar_and_continues_identically(llm: LLM) -> None:
    prompt = llm.tokenizer(chat(llm, "Describe a cat as JSON.")).input_ids
    params = SamplingParams(max_tokens=40, temperature=0.0, structured=JSON_SCHEMA)
    [whole] = llm.generate([prompt], params)
    done = whole.token_ids[:7]
    moved = Request("r", tuple(prompt), params).continued(done, "r#2")
    assert moved.sampling.structured.prior_tokens == 7
    [rest] = llm.generate([list(moved.prompt_token_ids)], moved.sampling)
    assert done + rest.token_ids == whole.token_ids
    jsonschema.validate(json.loads(llm.tokenizer.decode(done + rest.token_ids)), SCHEMA)


def test_bad_specs_fail_only_their_own_request(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["x"], SamplingParams(structured=StructuredOutput(
            "json_schema", '{"type": "nonsense"}')))
    assert e.value.field == "structured"
    with pytest.raises(InvalidRequestError, match="structured"):
        llm.generate(["x"], SamplingParams(structured=StructuredOutput("regex", "(")))
    # Tokens said to be generated under the grammar that break it: refused at the door.
    ids = llm.tokenizer("Hello there friend").input_ids
    with pytest.raises(InvalidRequestError, match="grammar"):
        llm.generate([ids], SamplingParams(structured=StructuredOutput(
            "json_schema", json.dumps(SCHEMA), prior_tokens=2)))
    assert_no_leaks(llm.engine)
