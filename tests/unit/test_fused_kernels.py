"""The native fused elementwise ops against the torch expressions the decoder uses.

Every comparison is bit-exact (``torch.equal``): the kernels reproduce torch's roundings,
its RMSNorm reduction order and its silu exp, so swapping them into the decoder cannot
change a greedy token. Shapes cover SmolLM2's decode and prefill rows, q/k-norm and
RoPE on views of a fused QKV output, widths that leave vector tails, and rows enough
to take the multi-threaded path. Skipped when the extension cannot be built here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from workers.engine import kernels
from workers.models.decoder import apply_rope, rms_norm

DTYPES = [torch.float32, torch.bfloat16]
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 576, 9, 3, 64


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    cache = os.environ.get("PDSERVE_TEST_CACHE_DIR")
    if kernels.load(Path(cache) / "kernels" if cache else None) is None:
        pytest.skip(f"native kernels unavailable: {kernels.unavailable_reason()}")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def activations(rows: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows of different scales (as residual streams have), some with large outliers."""
    g = gen(seed)
    x = torch.randn(rows, width, generator=g) * (torch.rand(rows, 1, generator=g) * 8 + 0.01)
    x[:, :: max(width // 7, 1)] *= 30
    return x.to(dtype)


def norm_weight(width: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return (torch.randn(width, generator=gen(seed)) * 0.3 + 1).to(dtype)


def qkv_view(tokens: int, dtype: torch.dtype, seed: int = 2):
    """The decoder's [tokens, heads + kv_heads, head_dim] view of a fused QKV output."""
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen(seed)) * 3
    qkv = qkv.to(dtype)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, HEADS + KV_HEADS, HEAD_DIM)
    assert tokens == 1 or not qk.is_contiguous()
    return qkv, qk


def rope_tables(tokens: int, dtype: torch.dtype, seed: int = 3):
    """cos/sin [tokens, 1, head_dim] gathered from a position table, halves duplicated."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = torch.outer(torch.arange(8192).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)
    positions = torch.randint(0, 8192, (tokens,), generator=gen(seed))
    return cos[positions], sin[positions]


# ---------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 32, 256, 2048])
def test_rms_norm_hidden_rows_bit_exact(dtype, rows) -> None:
    x, w = activations(rows, HIDDEN, dtype, seed=rows), norm_weight(HIDDEN, dtype)
    out = kernels.rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 7, 17, 64, 100, 896, 1000, 4096, 8192])
def test_rms_norm_other_widths_bit_exact(dtype, width) -> None:
    """Widths below one vector, with scalar tails, and deep enough for the cascade levels."""
    x, w = activations(5, width, dtype, seed=width), norm_weight(width, dtype)
    for eps in (1e-5, 1e-6):
        assert torch.equal(kernels.rms_norm(x, w, eps), rms_norm(x, w, eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 32, 300])
def test_qk_norm_on_qkv_views_bit_exact(dtype, tokens) -> None:
    """Qwen3's per-head q/k RMSNorm, straight from the strided views of the QKV output."""
    _, qk = qkv_view(tokens, dtype)
    q, k = qk.split([HEADS, KV_HEADS], dim=1)
    wq, wk = norm_weight(HEAD_DIM, dtype, seed=4), norm_weight(HEAD_DIM, dtype, seed=5)
    assert torch.equal(kernels.rms_norm(q, wq, 1e-6), rms_norm(q, wq, 1e-6))
    assert torch.equal(kernels.rms_norm(k, wk, 1e-6), rms_norm(k, wk, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 32, 2048])
def test_add_rms_norm_updates_x_and_matches(dtype, rows) -> None:
    x, w = activations(rows, HIDDEN, dtype, seed=rows), norm_weight(HIDDEN, dtype)
    delta = activations(rows, HIDDEN, dtype, seed=rows + 1)
    expected_x = x + delta
    expected_h = rms_norm(expected_x, w, 1e-5)
    h = kernels.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(x, expected_x)
    assert torch.equal(h, expected_h)


def test_add_rms_norm_strided_residual() -> None:
    x, w = activations(9, HIDDEN, torch.float32), norm_weight(HIDDEN, torch.float32)
    wide = activations(9, 2 * HIDDEN, torch.float32, seed=8)
    delta = wide[:, HIDDEN:]
    expected_x = x + delta
    h = kernels.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(x, expected_x)
    assert torch.equal(h, rms_norm(expected_x, w, 1e-5))


# ---------------------------------------------------------------- rope


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 32, 256, 2048])
def test_rope_in_place_on_qkv_view_bit_exact(dtype, tokens) -> None:
    qkv, qk = qkv_view(tokens, dtype)
    cos, sin = rope_tables(tokens, dtype)
    expected = apply_rope(qk, cos, sin)
    v_before = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].clone()
    assert kernels.rope_(qk, cos, sin) is qk
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :], v_before)  # v untouched


@pytest.mark.parametrize("dim", [2, 20, 40, 128])
def test_rope_other_head_dims_and_2d_tables(dim) -> None:
    g = gen(dim)
    x = torch.randn(5, 3, dim, generator=g)
    ang = torch.rand(5, dim // 2, generator=g) * 50
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    expected = apply_rope(x, cos.unsqueeze(1), sin.unsqueeze(1))
    kernels.rope_(x, cos, sin)
    assert torch.equal(x, expected)


# ---------------------------------------------------------------- silu_mul


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows,inter",
    [(1, 1536), (32, 1536), (33, 1536), (256, 1536), (2048, 1536), (3, 100), (4, 48), (2, 1000)],
)
def test_silu_mul_bit_exact(dtype, rows, inter) -> None:
    gate_up = activations(rows, 2 * inter, dtype, seed=inter) / 4
    out = kernels.silu_mul(gate_up)
    assert out.shape == (rows, inter) and out.dtype == dtype
    assert torch.equal(out, silu_mul_ref(gate_up))


def test_silu_mul_every_bfloat16_gate() -> None:
    gates = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    gates = gates.view(torch.bfloat16).view(1024, 64)
    up = torch.randn(1024, 64, generator=gen(6)).to(torch.bfloat16)
    gate_up = torch.cat([gates, up], dim=1)
    torch.testing.assert_close(
        kernels.silu_mul(gate_up), silu_mul_ref(gate_up), rtol=0, atol=0, equal_nan=True
    )


def test_silu_mul_float32_range_and_specials() -> None:
    """Sleef's range cut-offs (-104, 100), huge magnitudes, infinities and NaN."""
    specials = [0.0, -0.0, 1e-30, -1e-30, 88.7, -88.7, 103.97, -103.97, 3e38, -3e38]
    specials += [float("inf"), float("-inf"), float("nan")]
    g = torch.cat(
        [
            torch.linspace(-120, 120, 1 << 18),
            torch.randn(1 << 18, generator=gen(7)) * 30,
            torch.tensor(specials).repeat(32),
        ]
    )
    g = g[: g.numel() // 512 * 512].view(-1, 512)
    gate_up = torch.cat([g, torch.ones_like(g)], dim=1)
    torch.testing.assert_close(
        kernels.silu_mul(gate_up), silu_mul_ref(gate_up), rtol=0, atol=0, equal_nan=True
    )


# ---------------------------------------------------------------- argmax_rows


@pytest.mark.parametrize("rows, width", [(1, 49152), (32, 49152), (256, 49152), (3, 1),
                                         (5, 7), (4, 15), (4, 16), (4, 17), (2, 31), (2, 32),
                                         (2, 33), (6, 1000), (3, 151936)])
def test_argmax_rows_matches_torch(rows, width) -> None:
    x = torch.randn(rows, width, generator=gen(rows * 7 + width))
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_ties_infinities_and_nans_as_torch() -> None:
    width = 4099  # lanes and a tail
    x = torch.randn(12, width, generator=gen(5))
    x[0, [17, 2000, 4097]] = 9.0  # a tie: the first wins, wherever its lane
    x[1, [4098, 3]] = 9.0  # the tail's and a lane's
    x[2] = float("-inf")  # all -inf: index 0
    x[3] = 1.0  # all equal
    x[4, 100] = float("inf")
    x[5, [5, 4000]] = float("nan")  # the first NaN wins
    x[6, 4098] = float("nan")  # a NaN only in the tail
    x[7, 0] = float("nan")  # at index 0
    x[8, [1, 2]] = float("inf")
    x[8, 3] = float("nan")  # NaN beats inf
    x[9] = -0.0
    x[9, [50, 60]] = 0.0  # -0.0 and 0.0 are equal: the first of them, index 0
    x[10, [width - 1]] = 1e30
    x[11, [31, 32, 47, 48]] = 1e30  # a tie across lanes of one vector and the next
    for cols in (width, 40, 16, 9, 1):  # the vector paths and the scalar one
        y = x[:, :cols].contiguous()
        assert torch.equal(kernels.argmax_rows(y), y.argmax(dim=-1)), cols


def test_argmax_rows_strided_rows_and_threads() -> None:
    big = torch.randn(64, 3000, generator=gen(8))
    view = big[::2, 100:2900]  # rows apart, last dim contiguous
    assert torch.equal(kernels.argmax_rows(view), view.argmax(dim=-1))
    x = torch.randn(300, 49152, generator=gen(9))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.argmax_rows(x)
        torch.set_num_threads(max(2, threads))
        many = kernels.argmax_rows(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many) and torch.equal(one, x.argmax(dim=-1))
    assert kernels.argmax_rows(torch.empty(0, 10)).shape == (0,)


def test_argmax_rows_rejects_bad_inputs() -> None:
    with pytest.raises(RuntimeError, match="float32"):
        kernels.argmax_rows(torch.randn(2, 8).bfloat16())
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.argmax_rows(torch.randn(8, 4).t())
    with pytest.raises(RuntimeError, match="rows, n"):
        kernels.argmax_rows(torch.randn(8))
    with pytest.raises(RuntimeError, match="empty"):
        kernels.argmax_rows(torch.empty(3, 0))


# ---------------------------------------------------------------- general


def test_thread_count_does_not_change_results() -> None:
    x, w = activations(2048, HIDDEN, torch.float32), norm_weight(HIDDEN, torch.float32)
    gate_up = activations(2048, 2 * 1536, torch.float32, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.rms_norm(x, w, 1e-5), kernels.silu_mul(gate_up)
        torch.set_num_threads(max(2, threads))
        many = kernels.rms_norm(x, w, 1e-5), kernels.silu_mul(gate_up)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))


def test_empty_inputs() -> None:
    w = norm_weight(HIDDEN, torch.float32)
    assert kernels.rms_norm(torch.empty(0, HIDDEN), w, 1e-5).shape == (0, HIDDEN)
    assert kernels.silu_mul(torch.empty(0, 64)).shape == (0, 32)
    cos = torch.empty(0, 1, HEAD_DIM)
    assert kernels.rope_(torch.empty(0, 4, HEAD_DIM), cos, cos).shape == (0, 4, HEAD_DIM)


def test_rejects_bad_inputs() -> None:
    x, w = activations(4, HIDDEN, torch.float32), norm_weight(HIDDEN, torch.float32)
    with pytest.raises(RuntimeError, match="dtype"):
        kernels.rms_norm(x, w.bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        kernels.rms_norm(x, w[:-1], 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.rms_norm(x.t(), norm_weight(4, torch.float32), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.rms_norm(x.half(), w.half(), 1e-5)
    with pytest.raises(RuntimeError, match="shape"):
        kernels.add_rms_norm(x, x[:2], w, 1e-5)
    with pytest.raises(RuntimeError, match="even"):
        kernels.silu_mul(torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="even"):
        kernels.rope_(torch.randn(2, 3, 5), torch.randn(2, 1, 5), torch.randn(2, 1, 5))
    with pytest.raises(RuntimeError, match="cos/sin"):
        kernels.rope_(torch.randn(2, 3, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8))
