"""Weight-only int8: quantize/dequantize, and the native kernel against a float reference.

The reference is float64 ``x @ (q * scale).T + bias`` on the same int8 weight, so only
the kernel's own arithmetic is judged. Tolerance: the kernel sums K products in float32,
in another order than any reference, so each output may differ by a few float32 ulps
of the sum of the products' magnitudes: ``1e-5 * (|x| @ |W|.T + |bias|)`` (K <= 600:
the worst-case bound ``K * 2^-24`` is ~4e-5, random-sign errors are ~sqrt(K) times
smaller). bfloat16 outputs are rounded once to bfloat16, half an ulp: ``2^-8 * |ref|``
more; the GEMM path (more rows than the GEMV takes) also rounds each dequantized weight
to bfloat16 (``2^-9`` relative each, as a bf16 model's weights are) and accumulates in
oneDNN's order: ``2^-8 * (|x| @ |W|.T)`` there. Every GEMV code path this build has is
checked (AVX-512 and AVX2 on an AVX-512 machine, AVX2 alone on an AVX2 one, scalar
always). Skipped when the extension cannot be built here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from workers.engine import kernels
from workers.models.linear import (
    Int8Weight,
    cat_weights,
    dequantize_int8,
    int8_linear,
    quantize_int8,
)

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(37, 53), (5, 17), (64, 576), (130, 31)]  # (N, K): odd sizes, vector tails
PACKED_SHAPES = [(37, 56), (5, 16), (64, 576), (130, 8), (4, 24)]  # K a multiple of 8


@pytest.fixture(scope="module")
def native():
    cache = os.environ.get("PDSERVE_TEST_CACHE_DIR")
    if kernels.load(Path(cache) / "kernels" if cache else None) is None:
        pytest.skip(f"native kernels unavailable: {kernels.unavailable_reason()}")
    return kernels


def paths() -> list[str]:
    if kernels.load() is None:
        return ["scalar"]
    best = kernels.int8_isa()
    return {"avx512": ["avx512", "avx2", "scalar"], "avx2": ["avx2", "scalar"]}.get(
        best, ["scalar"])


def weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (torch.rand(n, 1, generator=g) * 0.1 + 0.001)
    w[0] = 0.0  # an all-zero row
    return w


def test_quantize_round_trip_error_is_at_most_half_a_step() -> None:
    w = weight(37, 53, 0)
    qw = quantize_int8(w)
    assert qw.q.dtype == torch.int8 and qw.scale.dtype == torch.float32
    assert int(qw.q.abs().max()) == 127 and int(qw.q.min()) >= -127
    assert torch.equal(qw.scale[0], torch.tensor(1.0)) and not qw.q[0].any()
    err = (dequantize_int8(qw, torch.float32) - w).abs()
    assert bool((err <= qw.scale[:, None] / 2 * (1 + 1e-6)).all())
    # Per-channel scales commute with stacking rows (the fused q/k/v and gate/up).
    a, b = weight(8, 53, 1), weight(5, 53, 2)
    fused = cat_weights([quantize_int8(a), quantize_int8(b)])
    whole = quantize_int8(torch.cat([a, b]))
    assert torch.equal(fused.q, whole.q) and torch.equal(fused.scale, whole.scale)
    with pytest.raises(ValueError, match="int8 and float"):
        cat_weights([quantize_int8(a), b])


def reference(x: torch.Tensor, qw: Int8Weight, bias: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    w = qw.q.double() * qw.scale.double()[:, None]
    ref = x.double() @ w.T
    mag = x.double().abs() @ w.abs().T
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    return ref, mag


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_kernel_matches_reference(native, dtype: torch.dtype, rows: int) -> None:
    for i, (n, k) in enumerate(SHAPES):
        qw = quantize_int8(weight(n, k, 10 + i))
        x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(i)) * 3).to(dtype)
        for bias in (None, torch.randn(n).to(dtype)):
            ref, mag = reference(x, qw, bias)
            gemv = rows <= kernels.INT8_GEMV_ROWS
            tol = 1e-5 * mag + 1e-6
            if dtype == torch.bfloat16:
                tol = tol + 2.0**-8 * ref.abs() + (0 if gemv else 2.0**-8 * mag)
            for isa in paths() if gemv else [None]:
                y = native.int8_linear(x, qw.q, qw.scale, bias, isa=isa)
                assert y.dtype == dtype and y.shape == (rows, n)
                assert bool(((y.double() - ref).abs() <= tol).all()), (isa, n, k, bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_and_gemm_paths_agree_and_shapes_pass_through(native, dtype) -> None:
    qw = quantize_int8(weight(96, 80, 3))
    x = torch.randn(2, 5, 80).to(dtype)  # leading dims kept
    y_gemv = native.int8_linear(x, qw.q, qw.scale, None, max_gemv_rows=64)
    y_gemm = native.int8_linear(x, qw.q, qw.scale, None, max_gemv_rows=0)
    assert y_gemv.shape == (2, 5, 96)
    ref, mag = reference(x.reshape(10, 80), qw, None)
    tol = 1e-5 * mag + (2.0**-7 * (mag + ref.abs()) if dtype == torch.bfloat16 else 0)
    for y in (y_gemv, y_gemm):
        assert bool(((y.reshape(10, 96).double() - ref).abs() <= tol + 1e-6).all())
    assert torch.equal(native.int8_dequantize(qw.q, qw.scale, dtype),
                       dequantize_int8(qw, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", PACKED_SHAPES)
def test_int8_in_tiles_gives_the_row_major_results(native, dtype, n, k) -> None:
    qw = quantize_int8(weight(n, k, n + k))
    tiles = native._fused_op("gemv_pack")(qw.q)
    assert tiles.shape == ((n + 3) // 4, k // 8, 4, 8) and tiles.dtype == torch.int8
    assert Int8Weight(tiles, qw.scale, tiled=True).shape == (n, k)
    assert torch.equal(native.int8_dequantize(tiles, qw.scale, dtype),
                       native.int8_dequantize(qw.q, qw.scale, dtype))
    g = torch.Generator().manual_seed(n)
    for rows in (1, 3, 4, 5, 40):  # the GEMV up to INT8_GEMV_ROWS, the GEMM above
        x = torch.randn(rows, k, generator=g).to(dtype)
        bias = torch.randn(n, generator=g).to(dtype)
        for isa in paths() if rows <= kernels.INT8_GEMV_ROWS else [None]:
            y = native.int8_linear(x, tiles, qw.scale, bias, isa=isa)
            row_major = native.int8_linear(
                x, qw.q, qw.scale, bias,
                isa=isa if isa in (None, "scalar") else ("avx2" if "avx2" in paths() else isa))
            if isa == "avx512":  # the tiles run the AVX2 tile: another summation order
                ref, mag = reference(x, qw, bias)
                assert bool(((y.double() - ref).abs() <= 1e-5 * mag + 1e-6
                             + (2.0**-7 * (mag + ref.abs()) if dtype == torch.bfloat16
                                else 0)).all())
            else:
                assert torch.equal(y, row_major), (isa, rows)


def test_int8_linear_ops_put_weights_in_the_kernels_layout(native) -> None:
    ops = int8_linear(native.int8_linear, native.int8_tiles)
    w = weight(24, 40, 5)
    prepared = ops.prepare(w)
    assert prepared.tiled and prepared.shape == (24, 40)
    assert ops.prepare(prepared) is prepared  # already in it
    x = torch.randn(2, 40)
    ref, mag = reference(x, quantize_int8(w), None)
    assert bool(((ops.apply(x, prepared, None).double() - ref).abs() <= 1e-5 * mag + 1e-6).all())
    odd = ops.prepare(weight(8, 36, 1))  # K not whole chunks: row-major
    assert not odd.tiled and odd.shape == (8, 36)
    # Tiles are the kernel's own: no fusing or dequantizing them in torch.
    with pytest.raises(ValueError, match="tiles"):
        cat_weights([prepared, prepared])
    with pytest.raises(ValueError, match="row-major"):
        dequantize_int8(prepared, torch.float32)
    assert not int8_linear(native.int8_linear).prepare(w).tiled  # no layout: row-major
    with pytest.raises(RuntimeError, match="scale's length"):
        native.int8_linear(x, prepared.q, prepared.scale[:20])


def test_kernel_rejects_bad_inputs(native) -> None:
    qw = quantize_int8(weight(8, 16, 4))
    with pytest.raises(RuntimeError, match="last dim"):
        native.int8_linear(torch.randn(2, 15), qw.q, qw.scale)
    with pytest.raises(RuntimeError, match="int8"):
        native.int8_linear(torch.randn(2, 16), qw.q.float(), qw.scale)
    with pytest.raises(RuntimeError, match="scale"):
        native.int8_linear(torch.randn(2, 16), qw.q, qw.scale[:4])


@pytest.mark.parametrize("with_kernel", [True, False])
def test_linear_ops_quantize_at_prepare_and_take_int8_as_is(native, with_kernel) -> None:
    ops = int8_linear(native.int8_linear if with_kernel else None)
    w = weight(24, 40, 5)
    prepared = ops.prepare(w)
    assert isinstance(prepared, Int8Weight) and ops.prepare(prepared) is prepared
    x, bias = torch.randn(3, 40), torch.randn(24)
    ref, mag = reference(x, prepared, bias)
    y = ops.apply(x, prepared, bias)
    assert bool(((y.double() - ref).abs() <= 1e-5 * mag + 1e-6).all())


# --- the float32 GEMV (the same kernel on float weights) and its dispatch ------------------

def gemv_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
               ref: torch.Tensor) -> torch.Tensor:
    """What the GEMV may differ from the float64 ``ref`` by: float32 sums in another
    order (1e-5 of the products' magnitudes), and in bfloat16 the one rounding of each
    output (half an ulp: 2^-8 relative)."""
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T
                    + (0 if b is None else b.double().abs())) + 1e-30
    return bound + (2.0**-8 * ref.abs() if x.dtype == torch.bfloat16 else 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", paths())
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5])
def test_f32_gemv_matches_float64(native, dtype, isa, n, k, rows) -> None:
    w = weight(n, k, seed=n + k).to(dtype)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, k, generator=g)[:, :, :].transpose(0, 1).to(dtype)  # strided
    bias = torch.randn(n, generator=g)
    for b in (None, bias, bias.to(dtype)):
        y = native.f32_gemv(x, w, b, isa=isa)
        assert y.dtype == dtype and y.shape == (rows, 2, n)
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        assert bool(((y.double() - ref).abs() <= gemv_bound(x, w, b, ref)).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", paths())
@pytest.mark.parametrize("n,k", PACKED_SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5])
def test_f32_gemv_on_packed_tiles_is_the_row_major_sum(native, dtype, isa, n, k, rows) -> None:
    w = weight(n, k, seed=n * k).to(dtype)
    packed = native.gemv_tiles(w)
    assert packed.shape == (n, k) and packed.data.shape == ((n + 3) // 4, k // 8, 4, 8)
    assert packed.data.dtype == dtype and packed.nbytes() == packed.data.numel() * w.element_size()
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    for b in (None, bias):
        y = native.f32_gemv(x, packed, b, isa=isa)
        assert y.shape == (rows, n) and y.dtype == dtype
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        assert bool(((y.double() - ref).abs() <= gemv_bound(x, w, b, ref)).all())
        # The same sums in the same order as the row-major tile of 8-float chunks (the
        # AVX2 path; an AVX-512 build's packed weights run that tile too).
        same = "scalar" if isa == "scalar" else ("avx2" if "avx2" in paths() else None)
        if same is not None:
            assert torch.equal(y, native.f32_gemv(x, w, b, isa=same))


def test_gemv_tiles_where_k_is_whole_chunks(native) -> None:
    w = weight(12, 64, 1)
    got = native.gemv_tiles_where_whole(w.T.contiguous().T)
    assert isinstance(got, native.GemvTiles) and got.shape == w.shape
    odd = native.gemv_tiles_where_whole(weight(12, 60, 1).T.contiguous().T)  # K % 8: as is
    assert isinstance(odd, torch.Tensor) and odd.is_contiguous()
    assert native.int8_tiles(quantize_int8(weight(12, 60, 1)).q).dim() == 2
    x = torch.randn(2, 64)
    torch.testing.assert_close(native.f32_gemv(x, got), x @ w.T, rtol=1e-5, atol=1e-5)


def test_gemv_tiles_reject_what_they_cannot_take(native) -> None:
    with pytest.raises(RuntimeError, match="multiple of 8"):
        native.gemv_tiles(torch.randn(8, 12))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or int8"):
        native.gemv_tiles(torch.randn(8, 16).half())
    packed = native.gemv_tiles(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="last dim"):
        native.f32_gemv(torch.randn(1, 8), packed)
    with pytest.raises(RuntimeError, match="gemv_pack"):  # n that the tiles cannot hold
        native.f32_gemv(torch.randn(1, 16), native.GemvTiles(packed.data, 9))
    with pytest.raises(RuntimeError, match="both be float32 or both bfloat16"):
        native.f32_gemv(torch.randn(1, 16), native.gemv_tiles(torch.randn(8, 16).bfloat16()))


@pytest.mark.parametrize("dtype", [*DTYPES, torch.int8])
def test_time_gemv_tiles_times_both_layouts_and_picks_by_the_margin(native, dtype) -> None:
    shapes = [(64, 96), (96, 64), (60, 32)]  # (in, out); K = 60 is not whole chunks
    t = native.time_gemv_tiles(shapes, dtype, layers=3, reps=2)
    assert t.row_major_s > 0 and t.tiles_s > 0
    assert t.weight_bytes == 3 * (64 * 96 + 96 * 64) * torch.empty((), dtype=dtype).element_size()
    assert t.tiles == (t.tiles_s < 0.95 * t.row_major_s)
    capped = native.time_gemv_tiles(shapes, dtype, layers=3, reps=1, budget=1)
    assert capped.weight_bytes == t.weight_bytes // 3  # at least one layer, however small
    # Tiles must win by the margin: under 0 times row-major's time they never do.
    assert not native.time_gemv_tiles(shapes, dtype, layers=1, reps=1, margin=0.0).tiles
    assert native.time_gemv_tiles([(60, 8)], dtype, layers=1) == native.TilesTiming(
        False, 0.0, 0.0, 0)  # nothing to tile


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", [True, False])
def test_time_int8_gemv_rows_probes_in_order_and_stops_at_the_first_loss(native, dtype,
                                                                       tiles) -> None:
    shapes = [(64, 96), (96, 64), (60, 32)]  # (in, out); K = 60 stays row-major in tiles
    probe = (4, 8, 32)
    # A GEMV held to under 1e9 times the GEMM's time keeps every probed count ...
    t = native.time_int8_gemv_rows(shapes, dtype, tiles, layers=2, probe=probe, reps=1,
                                   margin=1e9)
    assert (t.rows, t.probed) == (32, probe)
    assert len(t.gemv_s) == len(t.gemm_s) == 3 and min(t.gemv_s + t.gemm_s) > 0
    # ... and one held to under 0 times loses the first: half of it is kept.
    t = native.time_int8_gemv_rows(shapes, dtype, tiles, layers=2, probe=probe, reps=1,
                                   margin=0.0)
    assert (t.rows, t.probed) == (2, (4,))
    # At the real margin the choice is the last count before the first loss.
    t = native.time_int8_gemv_rows(shapes, dtype, tiles, layers=2, probe=probe, reps=1)
    kept = [g < q for g, q in zip(t.gemv_s, t.gemm_s, strict=True)]
    assert kept[:-1] == [True] * (len(kept) - 1)
    assert t.rows == (t.probed[-1] if all(kept) else t.probed[-2] if len(kept) > 1 else 2)
    assert native.time_int8_gemv_rows([], dtype, tiles, layers=1) == native.Int8RowsTiming(
        native.INT8_GEMV_ROWS, (), (), ())  # nothing to time: the default


def test_f32_gemv_rejects_what_it_cannot_take(native) -> None:
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="both be float32 or both bfloat16"):
        native.f32_gemv(torch.randn(1, 16).bfloat16(), w)
    with pytest.raises(RuntimeError, match="both be float32 or both bfloat16"):
        native.f32_gemv(torch.randn(1, 16).half(), w.half())
    with pytest.raises(RuntimeError, match="contiguous"):
        native.f32_gemv(torch.randn(1, 8), w.T)
    with pytest.raises(RuntimeError, match="last dim"):
        native.f32_gemv(torch.randn(1, 15), w)


def test_gemv_linear_takes_the_gemv_up_to_its_rows_and_keeps_both_layouts(native) -> None:
    from workers.models.linear import TORCH_LINEAR, DualWeight, gemv_linear, weight_nbytes

    calls: list[int] = []

    def gemv(x, w, bias):  # noqa: ANN001, ANN202 - the real kernel, counted
        calls.append(x.numel() // x.shape[-1])
        return native.f32_gemv(x, w, bias)

    ops = gemv_linear(gemv, TORCH_LINEAR, max_rows=4)
    w = weight(37, 53, 3)
    dual = ops.prepare(w.T.contiguous().T)  # a non-contiguous weight is made contiguous
    assert isinstance(dual, DualWeight) and dual.gemv.is_contiguous()
    assert weight_nbytes(dual) == w.numel() * 4  # one pass reads one layout
    for rows in (1, 4, 5, 64):
        x = torch.randn(rows, 53)
        torch.testing.assert_close(ops.apply(x, dual, None), x @ w.T, rtol=1e-5, atol=1e-5)
    assert calls == [1, 4]
    with pytest.raises(ValueError, match="float weights"):
        ops.prepare(quantize_int8(w))
