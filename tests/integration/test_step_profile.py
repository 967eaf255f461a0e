"""The decode step profile of ``pdserve bench-engine``: its parts add up, and it leaves
the engine as it found it."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leaks

import workers.models.decoder as decoder_module
from benchmarks.engine import step_profile
from benchmarks.step_profile import PARTS, print_backend, print_profile, profile_decode
from workers.engine import kernels
from workers.engine.llm import LLM
from workers.engine.params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_step_parts_sum_to_at_most_the_step_and_probes_are_removed(
        arch: str, tiny_checkpoints, capsys: pytest.CaptureFixture[str]) -> None:
    llm = LLM(tiny_checkpoints[arch], dtype="float32", num_blocks=256, block_size=4)
    engine, runner = llm.engine, llm.engine.runner
    prompts = [llm.tokenizer(t).input_ids for t in ("Hello there", "def f(x):\n    return")]
    before = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    originals = (runner.model.linear, runner.model.ops, decoder_module.paged_attention,
                 runner.model.layer_op)

    result = step_profile(llm, batches=(1, 3), steps=3)

    for row in result["rows"]:
        parts = row["parts_ms"]
        assert set(parts) == set(PARTS)
        assert all(ms >= 0 for ms in parts.values()), parts
        assert all(parts[p] > 0 for p in ("gemm", "attention", "elementwise", "lm_head",
                                          "sampling")), parts
        assert sum(parts.values()) <= row["probed_step_ms"] * 1.02 + 0.05, row
        assert row["forward_ms"] <= row["probed_step_ms"] * 1.02 + 0.05, row
        assert row["rest_ms"] >= -0.05 and row["forward_glue_ms"] >= -0.05, row
        assert row["gemm_floor_ms"] > 0 and row["bandwidth_floor_ms"] > row["kv_floor_ms"] > 0
        floor, kv = row["gemm_floor_ms"], row["kv_floor_ms"]
        assert row["floor_share_bound"] == pytest.approx(floor / (floor + kv))
        assert row["python_calls"] > 0 and (row["torch_ops"] is None or row["torch_ops"] > 0)
    assert [r["batch"] for r in result["rows"]] == [1, 3]
    assert result["backend"]["linear"] and result["backend"]["cpu"]

    # Every probe is gone and the engine decodes exactly as before (the same prompts,
    # served partly from the prefix cache: the profile's random KV never entered it).
    assert (runner.model.linear, runner.model.ops, decoder_module.paged_attention,
            runner.model.layer_op) == originals
    # Bare steps ran each layer as one native call (where the kernels build).
    assert (originals[-1] is not None) == kernels.available()
    assert "sample" not in vars(runner.sampler)
    assert_no_leaks(engine)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == before
    assert_no_leaks(engine)

    print_backend(result["backend"])
    print_profile("float32", result["rows"])
    table = capsys.readouterr().out
    assert "GEMMs via" in table and "sampling" in table and "bound" in table


def test_profile_refuses_a_busy_engine_and_a_full_pool(tiny_checkpoints) -> None:
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", num_blocks=8, block_size=4)
    vocab = llm.engine.runner.vocab_size
    prompts = torch.randint(100, vocab, (4, 16)).tolist()  # 4 x 5 blocks > 8 blocks
    with pytest.raises(RuntimeError, match="cannot hold 4 sequences"):
        profile_decode(llm.engine, prompts, steps=1)
    assert_no_leaks(llm.engine)
    llm.engine.add_request("busy", prompts[0], GREEDY)
    with pytest.raises(RuntimeError, match="idle engine"):
        profile_decode(llm.engine, prompts[:1], steps=1)


def test_each_workload_run_starts_cold(tiny_checkpoints, monkeypatch) -> None:
    """A repeat of a workload (or workload b, whose first prompts are a's) must not find
    its prompts in the prefix cache: every run prefills the same tokens."""
    import benchmarks.engine as bench

    shapes: list[list[tuple[int, int]]] = []
    monkeypatch.setattr(bench, "gemm_floor_seconds",
                        lambda model, steps: shapes.append(list(steps)) or 1.0)
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", num_blocks=256, block_size=4)
    prompts = bench.random_prompts(3, 16, llm.engine.runner.vocab_size, seed=0)
    runs = [bench.run_engine(llm, prompts, 4) for _ in range(2)]
    assert runs[0]["token_ids"] == runs[1]["token_ids"]
    assert shapes[0] == shapes[1] and sum(t for t, _ in shapes[0]) == 3 * 16 + 3 * 3
    assert_no_leaks(llm.engine)
