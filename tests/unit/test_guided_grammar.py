"""``guided_grammar`` (vLLM) and ``structured_outputs.grammar``: the HTTP fields, the
``grammar`` kind's checks and wire form, and the worker compiling it (Lark or GBNF)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
import tiny_models
from transformers import AutoTokenizer

from common.sampling import InvalidRequestError, SamplingParams, StructuredOutput
from common.wire import sampling_from_proto, sampling_to_proto
from protos.pdserve.v1 import common_pb2
from router.errors import RouterError
from router.openai.structured import structured_output
from workers.engine.structured import Grammars

YES_NO = 'start: "yes" | "no"'
GBNF_DATE = 'root ::= [0-9] [0-9] [0-9] [0-9] "-" [0-9] [0-9] "-" [0-9] [0-9]'


@pytest.mark.parametrize(
    "body",
    [{"guided_grammar": YES_NO}, {"structured_outputs": {"grammar": YES_NO}}],
)
def test_grammar_fields_become_the_grammar_kind(body: dict[str, Any]) -> None:
    s = structured_output(body)
    assert s is not None and s.kind == common_pb2.StructuredOutput.KIND_GRAMMAR
    assert s.spec == YES_NO


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"guided_grammar": ""}, "guided_grammar"),
        ({"guided_grammar": 5}, "guided_grammar"),
        ({"structured_outputs": {"grammar": "  "}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": YES_NO, "regex": "a"}}, "structured_outputs"),
        ({"guided_grammar": YES_NO, "guided_regex": "a"}, "guided_grammar"),
    ],
)
def test_bad_grammar_fields_are_refused_naming_the_field(body: dict[str, Any],
                                                         param: str) -> None:
    with pytest.raises(RouterError) as info:
        structured_output(body)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.field == param


def test_the_grammar_kind_is_checked_and_round_trips_the_wire() -> None:
    with pytest.raises(InvalidRequestError, match="non-empty grammar") as info:
        StructuredOutput("grammar", " \n")
    assert info.value.field == "structured"
    with pytest.raises(InvalidRequestError, match="65536"):
        StructuredOutput("grammar", "x" * (64 * 2**10 + 1))
    p = SamplingParams(structured=StructuredOutput("grammar", YES_NO))
    assert sampling_from_proto(sampling_to_proto(p)) == p


@pytest.fixture(scope="module")
def grammars(tmp_path_factory: pytest.TempPathFactory) -> tuple[Grammars, Any]:
    tok = AutoTokenizer.from_pretrained(
        tiny_models.train_tokenizer(Path(tmp_path_factory.mktemp("tok"))))
    return Grammars(tok, len(tok), frozenset({tok.eos_token_id})), tok


def run(grammars: Any, spec: str, text: str) -> bool:
    """Whether the worker's matcher for ``spec`` takes every token of ``text`` and is
    then complete."""
    g, tok = grammars
    matcher = g.start(SamplingParams(structured=StructuredOutput("grammar", spec)), [0])
    g.bind("r", matcher)
    try:
        done = False
        for t in tok(text, add_special_tokens=False).input_ids:
            done = g.advance("r", t)
        return done or matcher.is_accepting()
    except InvalidRequestError:
        return False
    finally:
        g.release("r")


def test_the_worker_compiles_lark_and_gbnf_grammars(grammars: Any) -> None:
    assert run(grammars, YES_NO, "yes") and run(grammars, YES_NO, "no")
    assert not run(grammars, YES_NO, "maybe")
    assert run(grammars, GBNF_DATE, "2024-05-17")
    assert not run(grammars, GBNF_DATE, "2024-5-17")


@pytest.mark.parametrize("spec", ["start: undefined_rule", "root ::= (", "start: /[/"])
def test_a_grammar_that_does_not_compile_fails_naming_structured(grammars: Any,
                                                                 spec: str) -> None:
    g, _ = grammars
    with pytest.raises(InvalidRequestError, match="grammar spec does not compile") as info:
        g.start(SamplingParams(structured=StructuredOutput("grammar", spec)), [0])
    assert info.value.field == "structured"
