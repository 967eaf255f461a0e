"""Penalties, logit_bias and min_tokens through a real (tiny) engine."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leaks
from transformers import AutoModelForCausalLM

from workers.engine.llm import LLM
from workers.engine.params import InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoints) -> LLM:  # noqa: ANN001
    return LLM(tiny_checkpoints["llama"], dtype="float32", num_blocks=64, block_size=4)


def test_min_tokens_holds_back_an_eos_that_logit_bias_made_the_argmax(llm: LLM) -> None:
    eos = min(llm.engine.eos_token_ids)
    prompt = llm.tokenizer("Once upon a time").input_ids
    biased = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0})
    [early] = llm.generate([prompt], biased)
    assert early.token_ids == [eos] and early.finish_reason == "stop"
    [held] = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0,
                                                   logit_bias={eos: 100.0}, min_tokens=4))
    assert held.token_ids[-1] == eos and eos not in held.token_ids[:-1]
    assert len(held.token_ids) == 5 and held.finish_reason == "stop"
    assert_no_leaks(llm.engine)


def test_repetition_penalty_matches_transformers(llm: LLM, tiny_checkpoints) -> None:
    prompt = llm.tokenizer("The quick brown fox jumps over the lazy dog because").input_ids
    p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.8)
    [ours] = llm.generate([prompt], p)
    [plain] = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0,
                                                    ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"],
                                                 dtype=torch.float32).eval()
    x = torch.tensor([prompt])
    with torch.inference_mode():
        ref = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=16, min_new_tokens=16, repetition_penalty=1.8,
                             pad_token_id=0)
    assert ours.token_ids == ref[0, len(prompt):].tolist()
    assert ours.token_ids != plain.token_ids  # the penalty changed something
    assert_no_leaks(llm.engine)


def test_frequency_penalty_and_logit_bias_change_greedy_output(llm: LLM) -> None:
    prompt = llm.tokenizer("A A A A A A").input_ids
    base = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    [plain] = llm.generate([prompt], base)
    [penalized] = llm.generate([prompt], SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, frequency_penalty=2.0,
        presence_penalty=2.0))
    assert len(set(penalized.token_ids)) > len(set(plain.token_ids))
    first = plain.token_ids[0]
    [banned] = llm.generate([prompt], SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={first: -100.0}))
    assert first not in banned.token_ids


def test_token_ids_outside_the_vocabulary_are_refused_at_the_door(llm: LLM) -> None:
    vocab = llm.engine.runner.vocab_size
    for kwargs, field in (({"logit_bias": {vocab: 1.0}}, "logit_bias"),
                          ({"allowed_token_ids": [vocab]}, "allowed_token_ids")):
        with pytest.raises(InvalidRequestError) as err:
            llm.generate([[1, 2]], SamplingParams(**kwargs))
        assert err.value.field == field
    assert_no_leaks(llm.engine)
