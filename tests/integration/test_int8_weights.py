"""int8 weights end to end on the tiny llama: prefill engine int8 -> real gloo transfer ->
decode engine int8 equals the same int8 engine offline, token for token, with no leaked
block; a `pdserve quantize` directory gives the same tokens as quantizing at load, and
refuses to load without ``quantization="int8"``."""

from __future__ import annotations

import pytest
from conftest import assert_no_leaks
from test_disagg_engines import GREEDY, disaggregated, run_until_done

from workers.engine.llm_engine import LLMEngine
from workers.engine.params import EngineConfig
from workers.models.int8_checkpoint import save_quantized
from workers.transfer import TransferState


def engine(path, **kw) -> LLMEngine:  # noqa: ANN001
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", num_blocks=96,
                                  block_size=4, max_num_batched_tokens=23,
                                  quantization="int8", **kw))




def offline(eng: LLMEngine, rid: str, ids: list[int]) -> list[int]:
    eng.add_request(rid, ids, GREEDY)
    return run_until_done(eng, rid).token_ids


def test_int8_disaggregated_equals_int8_offline(tiny_checkpoints, channel) -> None:
    path = tiny_checkpoints["llama"]
    p, d, local = engine(path), engine(path), engine(path)
    assert p.model_id.endswith(":w=int8") and p.model_id != LLMEngine(EngineConfig(
        model=str(path), dtype="float32", num_blocks=8)).model_id
    tok = p.tokenizer
    prompts = [tok(t).input_ids for t in
               ("The quick brown fox jumps over the lazy dog because", "A " * 20 + "story")]
    for i, ids in enumerate(prompts):
        _, out, state = disaggregated(p, d, channel, f"int8-{i}", ids)
        assert state is TransferState.DONE
        assert out.token_ids == offline(local, f"local-{i}", ids)
    for eng in (p, d, local):
        assert_no_leaks(eng)


def test_prequantized_checkpoint_equals_quantize_at_load(tiny_checkpoints, tmp_path) -> None:
    path = tiny_checkpoints["llama"]
    out = tmp_path / "llama-int8"
    counts = save_quantized(path, out)
    assert counts["quantized"] > 0 and (out / "tokenizer.json").exists()
    at_load, pre = engine(path), engine(out)
    ids = at_load.tokenizer("Once upon a time there was").input_ids
    assert offline(pre, "pre", ids) == offline(at_load, "load", ids)
    with pytest.raises(ValueError, match="--quantization int8"):
        LLMEngine(EngineConfig(model=str(out), dtype="float32", num_blocks=8))
    assert_no_leaks(pre)
