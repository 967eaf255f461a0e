"""Bad input gets a clear error naming the field and the limit; the engine keeps serving."""

from __future__ import annotations

import pytest
from conftest import assert_no_leaks

from workers.engine.llm import LLM
from workers.engine.llm_engine import LLMEngine
from workers.engine.params import EngineConfig, InvalidRequestError, SamplingParams


@pytest.fixture()
def engine(tiny_checkpoints) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32",
                                  num_blocks=64, block_size=4))


def test_bad_requests_are_refused_and_others_keep_running(engine: LLMEngine) -> None:
    ok = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("good", "a healthy prompt", ok)
    engine.step()  # the good request is mid-flight when the bad ones arrive
    limit = engine.max_model_len
    cases = [
        (lambda: engine.add_request("e1", "", ok), "prompt", "at least 1 token"),
        (lambda: engine.add_request("e2", [5] * limit, ok), "prompt", f"{limit - 1} prompt"),
        (lambda: engine.add_request("e3", [10**6], ok), "prompt_token_ids", "[0, "),
        (lambda: engine.add_request("good", "again", ok), "request_id", "already"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens", ">= 1"),
        (lambda: SamplingParams(temperature=-1), "temperature", ">= 0"),
        (lambda: SamplingParams(top_p=0), "top_p", "(0, 1]"),
        (lambda: SamplingParams(top_p=1.01), "top_p", "(0, 1]"),
    ]
    for call, field, limit_text in cases:
        with pytest.raises(InvalidRequestError) as err:
            call()
        assert err.value.field == field and limit_text in str(err.value), str(err.value)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    assert final.request_id == "good" and len(final.token_ids) == 6
    assert_no_leaks(engine)


def test_abort_frees_blocks_mid_generation(engine: LLMEngine) -> None:
    engine.add_request("a", "to be cancelled soon", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", "keeps going", SamplingParams(max_tokens=5, temperature=0,
                                                         ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort_request("a") and not engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)


def test_stop_strings_and_sampling_through_the_engine(tiny_checkpoints) -> None:
    llm = LLM(tiny_checkpoints["qwen3"], dtype="float32", num_blocks=64, block_size=4)
    [free] = llm.generate(["Once upon"], SamplingParams(max_tokens=30, temperature=0,
                                                        ignore_eos=True))
    stop = free.text[5:8]
    assert stop.strip(), free.text
    [cut] = llm.generate(["Once upon"], SamplingParams(max_tokens=30, temperature=0,
                                                       ignore_eos=True, stop=[stop]))
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert free.text.startswith(cut.text)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=7,
                            ignore_eos=True, logprobs=2)
    a, b = llm.generate(["Once upon", "Once upon"], seeded)
    assert a.token_ids == b.token_ids and len(a.logprobs) == 12
    assert all(lp.token_id == t for lp, t in zip(a.logprobs, a.token_ids, strict=True))
    assert_no_leaks(llm.engine)
