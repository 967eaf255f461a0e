"""Greedy output of the engine equals transformers ``generate`` token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_no_leaks, hf_greedy
from tiny_models import ARCHS

from workers.engine.llm import LLM
from workers.engine.params import SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def prompts_for(llm: LLM) -> list[list[int]]:
    tok = llm.tokenizer
    texts = ["Hello", "The quick brown fox jumps over the lazy dog because",
             "def main():\n    return 42\n", "A " * 37 + "story"]
    return [tok(t).input_ids for t in texts]


@pytest.mark.parametrize(("arch", "kernel"), [(a, True) for a in ARCHS] + [("qwen2", False)])
def test_batched_greedy_matches_hf(arch: str, kernel: bool, tiny_checkpoints) -> None:
    """``kernel=False`` checks the torch fallback of the native kernels (no C++ compiler)."""
    path = tiny_checkpoints[arch]
    # Small blocks and budget: prompts span several blocks and prefill is chunked.
    llm = LLM(path, dtype="float32", num_blocks=128, block_size=4, max_num_batched_tokens=23,
              use_native_kernels=kernel)
    prompts = prompts_for(llm)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 20)
    assert_no_leaks(llm.engine)


def test_the_stall_free_cap_chunks_prompts_beside_decodes_and_keeps_hf_tokens(
        tiny_checkpoints) -> None:
    """Requests arriving while others decode compute their prompts a few tokens a step
    (``prefill_tokens_while_decoding``): more steps, the same greedy tokens."""
    path = tiny_checkpoints["llama"]

    def run(cap: int) -> tuple[list[list[int]], int, list[list[int]]]:
        llm = LLM(path, dtype="float32", num_blocks=128, block_size=4,
                  max_num_batched_tokens=64, prefill_tokens_while_decoding=cap)
        engine, prompts = llm.engine, prompts_for(llm)
        engine.add_request("first", prompts[0], GREEDY)
        engine.step()  # "first" decodes from now on
        for i, p in enumerate(prompts[1:]):
            engine.add_request(str(i), p, GREEDY)
        done, steps = {}, 1
        while engine.has_unfinished_requests():
            steps += 1
            done |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
        assert_no_leaks(engine)
        order = ["first", *map(str, range(len(prompts) - 1))]
        return [done[k] for k in order], steps, prompts

    (capped, capped_steps, prompts), (plain, plain_steps, _) = run(3), run(0)
    assert capped == plain == hf_greedy(path, prompts, 20)
    assert capped_steps > plain_steps


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefix_cache_hit_gives_the_same_tokens(arch: str, tiny_checkpoints) -> None:
    path = tiny_checkpoints[arch]
    llm = LLM(path, dtype="float32", num_blocks=128, block_size=4)
    shared = llm.tokenizer("A long shared system prompt that many requests start with.").input_ids
    first, second = shared + [11, 12, 13], shared + [21, 22]
    [a] = llm.generate([first], GREEDY)
    assert a.num_cached_tokens == 0
    [b] = llm.generate([second], GREEDY)
    assert b.num_cached_tokens == (len(shared) // 4) * 4 > 0
    assert [a.token_ids, b.token_ids] == hf_greedy(path, [first, second], 20)
    assert_no_leaks(llm.engine)


def test_preemption_under_memory_pressure_keeps_output_exact(tiny_checkpoints) -> None:
    path = tiny_checkpoints["mistral"]
    # 16 blocks of 4 tokens cannot hold 6 sequences of ~30 tokens: some are preempted.
    llm = LLM(path, dtype="float32", num_blocks=16, block_size=4, max_num_batched_tokens=64)
    prompts = [llm.tokenizer(f"Request number {i} asks for a story").input_ids for i in range(6)]
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 20)
    assert_no_leaks(llm.engine)


def test_bf16_runs_and_tracks_hf_bf16(tiny_checkpoints) -> None:
    path = tiny_checkpoints["qwen2"]
    llm = LLM(path, dtype="bfloat16", num_blocks=64, block_size=8)
    prompts = prompts_for(llm)[:2]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    ref = hf_greedy(path, prompts, 4, dtype="bfloat16")
    # bf16 rounding differs between fused and unfused GEMMs; the first token must agree.
    assert [o.token_ids[0] for o in outs] == [r[0] for r in ref]
    assert_no_leaks(llm.engine)


@pytest.mark.slow
def test_smollm2_chat_greedy_matches_hf(smollm2_path: Path) -> None:
    llm = LLM(smollm2_path, dtype="float32", kv_cache_memory_gb=0.25)
    tok = llm.tokenizer
    questions = ["What is the capital of France?", "Name three colors.",
                 "Write one sentence about the sea."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}],
                                       add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in questions]
    prompts = [list(p) for p in prompts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    assert [o.token_ids for o in outs] == hf_greedy(smollm2_path, prompts, 32, stop_at_eos=True)
    assert "Paris" in outs[0].text and outs[0].finish_reason == "stop"
    assert_no_leaks(llm.engine)
