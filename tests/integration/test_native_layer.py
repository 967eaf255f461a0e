"""A decode-only step runs each decoder layer as one native call (``kernels.decode_layer``)
and computes exactly what the Python layer computes: the same logits bit for bit, step
by step, on every tiny architecture (biases, q/k norms, GQA), in float32 and bfloat16,
through every kind of projection the call takes (the GEMV on tiles and row-major,
oneDNN's reordered weights, ``F.linear``, int8 weights with their scales). Steps with a
prefill and quantized caches keep the Python layer.

Greedy agreement with Hugging Face through the native layer is
``test_engine_matches_hf``'s (every engine there decodes through it).
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leaks
from test_engine_matches_hf import prompts_for
from test_gemv_layout import fixed, fixed_gemv_rows
from tiny_models import ARCHS

from workers.engine import kernels
from workers.engine.llm import LLM
from workers.engine.params import SamplingParams

STEPS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def native() -> None:
    if kernels.load() is None:
        pytest.skip(f"native kernels unavailable: {kernels.unavailable_reason()}")


def run(llm: LLM, prompts: list[list[int]], layer_op) -> tuple[list, int, int]:  # noqa: ANN001
    """Generate with ``layer_op`` set (None: the Python layer); returns every step's
    logits, how many steps were decode-only, and how many native layer calls ran."""
    model = llm.engine.runner.model
    logits, decode_only, calls = [], 0, 0
    forward, own = model.forward, model.layer_op

    def recorded(input_ids, positions, batch, *rest):  # noqa: ANN001, ANN202
        nonlocal decode_only
        decode_only += not batch.prefills
        out = forward(input_ids, positions, batch, *rest)
        logits.append(out.clone())
        return out

    def counted(*args):  # noqa: ANN002, ANN202
        nonlocal calls
        calls += 1
        return layer_op(*args)

    model.forward, model.layer_op = recorded, counted if layer_op else None
    try:
        outs = llm.generate(prompts, STEPS)
    finally:
        model.forward, model.layer_op = forward, own
    assert all(len(o.token_ids) == STEPS.max_tokens for o in outs)
    return logits, decode_only, calls


@pytest.fixture(autouse=True)
def pinned_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMV up to the default 4 rows, whatever this CPU times for the tiny models:
    the tests below ask for the GEMV at 1 sequence and the batched op at 6."""
    fixed_gemv_rows(monkeypatch)


def assert_same_steps(llm: LLM, prompts: list[list[int]]) -> set[int]:
    """Native and Python layers give the same logits at every step; returns the kinds
    of projection the native steps ran."""
    model = llm.engine.runner.model
    op = model.layer_op
    assert op is not None
    native_logits, decode_only, calls = run(llm, prompts, op)
    python_logits, _, none = run(llm, prompts, None)
    assert decode_only >= STEPS.max_tokens - 1 and none == 0
    assert calls == decode_only * len(model.layers)  # every decode-only step, no other
    assert len(native_logits) == len(python_logits)
    for a, b in zip(native_logits, python_logits, strict=True):
        assert torch.equal(a, b)
    assert_no_leaks(llm.engine)
    rows = len(prompts)
    return {f[1] for lw in model.layers
            for f in (model._layer_native(w, rows) for w in (lw.qkv, lw.o, lw.gate_up, lw.down))}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_native_layers_equal_the_python_layers(tiny_checkpoints, monkeypatch, arch,
                                               dtype) -> None:
    monkeypatch.setattr(kernels, "time_gemv_tiles", fixed(True))
    llm = LLM(tiny_checkpoints[arch], dtype=dtype, num_blocks=96, block_size=4,
              enable_prefix_caching=False)
    prompts = prompts_for(llm)
    # One sequence: the GEMV, on tiles (kind: their rows) where K is whole chunks, else
    # row-major (0); the tiny llama has both.
    kinds = assert_same_steps(llm, prompts[:1])
    assert kinds and all(k >= 0 for k in kinds)
    if arch == "llama":
        assert 0 in kinds and any(k > 0 for k in kinds)
    # Six: past the GEMV's rows, the batched op's weights (oneDNN's where it has them).
    kinds = assert_same_steps(llm, (prompts * 2)[:6])
    assert kinds and all(k < 0 for k in kinds)


def test_plain_weights_run_f_linear(tiny_checkpoints) -> None:
    llm = LLM(tiny_checkpoints["qwen2"], dtype="float32", num_blocks=96, block_size=4,
              enable_prefix_caching=False, prepacked_weights=False, decode_gemv=False)
    assert assert_same_steps(llm, (prompts_for(llm) * 2)[:6]) == {-2}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("tiles", "gemv_rows"), [(True, 16), (False, 16), (True, 32)])
def test_int8_weights_run_natively(tiny_checkpoints, monkeypatch, dtype, tiles,
                                   gemv_rows) -> None:
    """``--quantization int8``: every projection int8 (kind -3, its scales passed along),
    values in tiles or row-major, for one sequence (the int8 GEMV) and for 20: past 16
    GEMV rows the kernel's blockwise GEMM, within 32 the GEMV again. Either way the
    native layer is given the rows the model runner timed, as its Python layer is, so
    the logits are the Python layer's bit for bit (the two paths sum in other orders)."""
    monkeypatch.setattr(kernels, "time_gemv_tiles", fixed(tiles))
    timing = kernels.Int8RowsTiming(gemv_rows, (gemv_rows,), (1.0,), (2.0,))
    monkeypatch.setattr(kernels, "time_int8_gemv_rows", lambda *_, **__: timing)
    llm = LLM(tiny_checkpoints["llama"], dtype=dtype, num_blocks=192, block_size=4,
              enable_prefix_caching=False, quantization="int8")
    assert llm.engine.runner.int8_rows is timing
    prompts = prompts_for(llm)
    assert assert_same_steps(llm, prompts[:1]) == {-3}
    assert assert_same_steps(llm, (prompts * 10)[:20]) == {-3}


def test_int8_gemv_rows_change_the_path_not_the_tokens(tiny_checkpoints, monkeypatch) -> None:
    """The rows the runner times decide which int8 path a 20-sequence step takes (the
    logits differ in the last bits between them), never the greedy tokens."""
    outs = []
    for rows in (16, 32):
        timing = kernels.Int8RowsTiming(rows, (rows,), (1.0,), (2.0,))
        monkeypatch.setattr(kernels, "time_int8_gemv_rows", lambda *_, t=timing, **__: t)
        llm = LLM(tiny_checkpoints["llama"], dtype="float32", num_blocks=192, block_size=4,
                  enable_prefix_caching=False, quantization="int8")
        prompts = (prompts_for(llm) * 10)[:20]
        logits, _, _ = run(llm, prompts, llm.engine.runner.model.layer_op)
        outs.append((logits, [o.token_ids for o in llm.generate(prompts, STEPS)]))
        assert_no_leaks(llm.engine)
    (a, tokens_a), (b, tokens_b) = outs
    assert tokens_a == tokens_b
    assert any(not torch.equal(x, y) for x, y in zip(a[1:], b[1:], strict=True))


@pytest.mark.parametrize("options", [{"kv_cache_dtype": "fp8_e4m3"}, {"native_layers": False}])
def test_python_layers_where_the_native_call_does_not_apply(tiny_checkpoints, options) -> None:
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", num_blocks=96, block_size=4,
              **options)
    model = llm.engine.runner.model
    op = model.layer_op or kernels.decode_layer
    _, decode_only, calls = run(llm, prompts_for(llm)[:2], op)
    assert decode_only > 0 and calls == 0
    assert_no_leaks(llm.engine)


def test_decode_layer_refuses_bad_arguments(tiny_checkpoints) -> None:
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", num_blocks=16, block_size=4)
    runner = llm.engine.runner
    model, s = runner.model, runner.model.shape
    lw = model.layers[0]
    w, kind = model._layer_native(lw.qkv, 1)
    assert kind != -3
    x = torch.zeros(1, s.hidden_size)
    args = dict(mlp_out=None, input_norm=lw.input_norm, post_norm=lw.post_norm, q_norm=None,
                k_norm=None, eps=1e-5, qkv_bias=None, o_bias=None, cos=model.cos[:1],
                sin=model.sin[:1], num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                cache=runner.kv_cache[0], block_size=4,
                slot_mapping=torch.zeros(1, dtype=torch.long),
                block_tables=torch.zeros(1, 1, dtype=torch.int32),
                context_lens=torch.ones(1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="qkv, o, gate_up, down"):
        kernels.decode_layer(x, weights=[w], kinds=[kind], **args)
    with pytest.raises(RuntimeError, match="unknown projection kind"):
        kernels.decode_layer(x, weights=[w] * 4, kinds=[-7] * 4, **args)
    with pytest.raises(RuntimeError, match="needs its scales"):
        kernels.decode_layer(x, weights=[w] * 4, kinds=[-3] * 4, **args)


@pytest.mark.parametrize("compare,a", [("native-layer", "native"), ("row-walk", "rows")])
def test_the_benchmark_runs_both_paths(tiny_checkpoints, capsys, compare, a) -> None:
    from benchmarks import native_layer

    threads = torch.get_num_threads()
    try:
        assert native_layer.main(["--model", str(tiny_checkpoints["llama"]), "--batches",
                                  "1,6", "--steps", "2", "--threads", "1",
                                  "--compare", compare]) == 0
    finally:
        torch.set_num_threads(threads)
    assert kernels.set_row_walk(True)  # the benchmark leaves the row walk allowed
    out = capsys.readouterr().out
    assert "greedy tokens (128 -> 32): equal" in out
    assert f"{a} ms" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "6"] and all(len(r[-4:]) == 4 for r in rows)
