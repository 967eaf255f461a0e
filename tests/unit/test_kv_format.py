"""Quantized KV rows (workers/models/kv_format.py): byte layout, error bounds, attention
over a quantized cache, and the transfer header that carries the format. Pure torch."""

from __future__ import annotations

import pytest
import torch

from common.kv_cache_dtype import CODE_FORMATS, FORMAT_CODES, KV_CACHE_DTYPES
from workers.models.attention import StepKeys, build_attention_batch, paged_attention
from workers.models.kv_format import NVFP4_TENSOR_SCALE, KeyTransform, KVFormat
from workers.transfer.header import (
    KVLayout,
    TransferHeader,
    check_offer,
    decode_offer,
    encode_offer,
)

QUANTIZED = ("fp8_e4m3", "fp8_e5m2", "nvfp4")


def rows(n: int = 6, heads: int = 3, dim: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mags = torch.logspace(-2, 1.5, n).view(n, 1, 1)  # rows from 0.01 to 30 in size
    return torch.randn(n, heads, dim, generator=g) * mags


def test_codes_are_the_wire_contract() -> None:
    assert KV_CACHE_DTYPES == ("auto", "fp8_e4m3", "fp8_e5m2", "nvfp4")
    assert FORMAT_CODES == {"auto": 0, "fp8_e4m3": 1, "fp8_e5m2": 2, "nvfp4": 3}
    assert CODE_FORMATS[3] == "nvfp4"


@pytest.mark.parametrize(("name", "row_bytes", "vs_bf16"), [
    ("auto", 128, 1.0), ("fp8_e4m3", 65, 128 / 65), ("fp8_e5m2", 65, 128 / 65),
    ("nvfp4", 36, 128 / 36)])
def test_row_sizes(name: str, row_bytes: int, vs_bf16: float) -> None:
    f = KVFormat(name, 64, torch.bfloat16)
    assert f.row_bytes == row_bytes
    assert f.quantize(rows()).shape == (6, 3, f.row_elems)
    assert f.quantize(rows()).dtype == f.storage_dtype
    assert KVFormat("auto", 64, torch.bfloat16).row_bytes / f.row_bytes == pytest.approx(vs_bf16)


def test_nvfp4_needs_groups_of_16() -> None:
    with pytest.raises(ValueError, match="head_dim divisible by 16.*40"):
        KVFormat("nvfp4", 40, torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3"):
        KVFormat("int4", 64, torch.float32)


@pytest.mark.parametrize(("name", "rel"), [("fp8_e4m3", 2**-4), ("fp8_e5m2", 2**-3)])
def test_fp8_rows_scale_by_a_power_of_two_within_half_an_ulp(name: str, rel: float) -> None:
    f = KVFormat(name, 64, torch.float32)
    x = rows()
    q = f.quantize(x)
    exponent = q[..., 64].float() - 127
    amax = x.abs().amax(-1)
    fmax = 448.0 if name == "fp8_e4m3" else 57344.0
    # the smallest power of two that brings the row's maximum inside the format
    assert bool((amax / torch.exp2(exponent) <= fmax).all())
    assert bool((amax / torch.exp2(exponent - 1) > fmax).all())
    err = (f.dequantize(q) - x).abs()
    # normal FP8 values round to within half an ulp of |x|; tiny ones within a subnormal step
    bound = torch.maximum(x.abs() * rel, torch.exp2(exponent).unsqueeze(-1) * 2**-9)
    assert bool((err <= bound).all())


def test_nvfp4_layout_low_nibble_first_then_e4m3_scales() -> None:
    f = KVFormat("nvfp4", 32, torch.float32)
    levels = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    x = torch.tensor(levels * 2 + [-v for v in levels] * 2)  # group amax 6: scale 1.0
    q = f.quantize(x)
    assert q.shape == (32 // 2 + 2,)
    assert int(q[0]) == 0 | 1 << 4  # elements 0 (0.0 -> code 0) and 1 (0.5 -> code 1)
    assert int(q[3]) == 6 | 7 << 4  # 4.0 and 6.0
    assert int(q[8]) == 0 | (8 | 1) << 4  # -0.0 stays code 0 (canonical), -0.5 -> 9
    scale = q[16:].view(torch.float8_e4m3fn).float()
    assert scale.tolist() == [1.0 / NVFP4_TENSOR_SCALE] * 2
    assert torch.equal(f.dequantize(q), x)  # exactly representable: exact


def test_nvfp4_error_is_bounded_by_the_group_scale() -> None:
    f = KVFormat("nvfp4", 64, torch.float32)
    x = rows()
    q = f.quantize(x)
    scale = q[..., 32:].view(torch.float8_e4m3fn).float().repeat_interleave(16, -1)
    err = (f.dequantize(q) - x).abs()
    # E2M1 steps are at most 2 (between 4 and 6) times the scale: rounding is off by at
    # most one scale; values beyond 6 scales (the scale rounded down to E4M3) clip
    amax = x.abs().view(6, 3, 4, 16).amax(-1).repeat_interleave(16, -1)
    assert bool((err <= scale + (amax - 6 * scale).clamp(min=0) + 1e-6).all())
    assert bool((err[3:] <= amax[3:] * 0.2).all())  # groups of normal E4M3 scales


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_rows_bytes_depend_on_that_row_only(name: str) -> None:
    """Per-token scales: a token written alone (decode) or inside a prompt (prefill), on
    any worker, becomes the same bytes."""
    f = KVFormat(name, 64, torch.bfloat16)
    x = rows().to(torch.bfloat16)
    together = f.quantize(x)
    for i in range(x.shape[0]):
        assert torch.equal(f.quantize(x[i : i + 1]), together[i : i + 1])


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_values_are_exact_in_the_model_dtype(name: str, dtype: torch.dtype) -> None:
    f = KVFormat(name, 64, dtype)
    q = f.quantize(rows())
    assert torch.equal(f.dequantize(q, dtype).float(), f.dequantize(q, torch.float32))


@pytest.mark.parametrize("name", QUANTIZED)
def test_attention_over_a_quantized_cache_equals_attention_over_its_values(name: str) -> None:
    """The torch paths (decode, a prefill chunk with a cached prefix, a fresh prefill)
    read exactly the values the bytes hold: same outputs as a float cache holding them."""
    torch.manual_seed(1)
    layers_heads, kv, dim, bs = 6, 2, 32, 4
    f = KVFormat(name, dim, torch.float32)
    slots = 12 * bs
    qcache = torch.zeros(2, slots, kv, f.row_elems, dtype=torch.uint8)
    fcache = torch.zeros(2, slots, kv, dim)
    # step 1: prefill of 7 tokens (seq A, blocks 3, 1) and 5 (seq B, blocks 5, 6)
    # step 2: A decodes one token; B prefills 4 more tokens over its cached 5
    steps = [([], [], [([3, 1], 0, 7), ([5, 6, 7], 0, 5)]),
             ([[3, 1]], [8], [([5, 6, 7], 5, 4)])]
    for tables, lens, spans in steps:
        batch, _ = build_attention_batch(tables, lens, spans, bs)
        n = batch.slot_mapping.numel()
        q = torch.randn(n, layers_heads, dim)
        k, v = torch.randn(n, kv, dim) * 3, torch.randn(n, kv, dim)
        out_q = paged_attention(q, k, v, qcache, batch, bs, kv_format=f)
        # the values the rows hold, rotated back out of the stored basis
        kq, vq = (f.rotate(f.dequantize(f.quantize(f.rotate(t)))) for t in (k, v))
        out_f = paged_attention(q, kq, vq, fcache, batch, bs)
        torch.testing.assert_close(out_q, out_f, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(f.rotate(f.dequantize(qcache)), fcache, rtol=1e-5, atol=1e-6)


def test_the_rotation_is_orthogonal_and_its_own_inverse() -> None:
    for dim in (64, 96, 32):
        f = KVFormat("fp8_e4m3", dim, torch.float32)
        x = torch.randn(5, 2, dim)
        torch.testing.assert_close(f.rotate(f.rotate(x)), x, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(f.rotate(x).norm(dim=-1), x.norm(dim=-1))
    outlier = torch.zeros(64)
    outlier[3] = 10.0  # one channel's energy spreads over all 64
    assert torch.allclose(KVFormat("nvfp4", 64, torch.float32).rotate(outlier).abs(),
                          torch.full((64,), 10.0 / 8))


def layout(kv_format: str = "auto", dtype: torch.dtype = torch.bfloat16,
           row: int = 64) -> KVLayout:
    return KVLayout(30, 16, 3, row, dtype, kv_format)


def test_the_header_carries_the_format() -> None:
    lay = KVLayout(30, 16, 3, 65, torch.uint8, "fp8_e5m2", 0xBEEF)
    h = TransferHeader(123, 5, 2, 3, lay, lay.payload_bytes(3), 4, 99)
    assert decode_offer(encode_offer(h, [7, 8, 9])) == (h, [7, 8, 9])
    assert decode_offer(encode_offer(h, [7, 8, 9]))[0].layout.kv_format == "fp8_e5m2"
    assert decode_offer(encode_offer(h, [7, 8, 9]))[0].layout.kv_digest == 0xBEEF


def test_keys_written_under_another_transform_are_refused() -> None:
    sent = KVLayout(30, 16, 3, 65, torch.uint8, "fp8_e4m3", 0x1234)
    stored = KVLayout(30, 16, 3, 65, torch.uint8, "fp8_e4m3", 0x1235)
    h = TransferHeader(1, 1, 1, 2, sent, sent.payload_bytes(2), 1, 0)
    reason = check_offer(h, [4, 5], stored, [4, 5], 1 << 30)
    assert reason is not None and "key transforms differ" in reason
    assert "#1234" in reason and "#1235" in reason


def _transform(seed: int = 0, layers: int = 4) -> KeyTransform:
    g = torch.Generator().manual_seed(seed)
    return KeyTransform(
        tuple(torch.exp2(torch.randint(-2, 3, (3, 64), generator=g).float())
              for _ in range(layers)),
        tuple(torch.randn(3, 64, generator=g) for _ in range(layers)))


def test_the_digest_names_the_transform() -> None:
    kt = _transform()
    same = KeyTransform(tuple(t.clone() for t in kt.scales), tuple(t.clone() for t in kt.offsets))
    assert kt.digest() == same.digest() != 0
    nudged = [t.clone() for t in kt.offsets]
    nudged[2][1, 5] += 2**-8
    assert KeyTransform(kt.scales, tuple(nudged)).digest() != kt.digest()
    halved = [t.clone() for t in kt.scales]
    halved[0][0, 0] /= 2
    assert KeyTransform(tuple(halved), kt.offsets).digest() != kt.digest()
    digests = {kt.digest(), kt.without(scales=True).digest(), kt.without(offsets=True).digest()}
    assert len(digests) == 3
    assert kt.without(scales=True, offsets=True) is None


def test_calibration_gives_power_of_two_scales_and_mean_offsets() -> None:
    """scale = sqrt(rms(q) / rms(k)) rounded to a power of two; offset = mean pre-RoPE key
    in bfloat16; a channel that one side never uses keeps scale 1."""
    tokens = 8
    k_pre = torch.full((2, 4), 3.0) * tokens
    k2 = torch.tensor([[1.0, 16.0, 4.0, 0.0]] * 2) * tokens  # rms 1, 4, 2, 0
    q2 = torch.tensor([[16.0, 1.0, 4.0, 9.0]] * 2) * tokens  # rms 4, 1, 2, 3
    kt = KeyTransform.calibrated([k_pre], [k2], [q2], tokens)
    assert kt.scales[0][0].tolist() == [2.0, 0.5, 1.0, 1.0]
    assert torch.equal(kt.offsets[0], torch.full((2, 4), 3.0))
    with pytest.raises(ValueError, match="at least one token"):
        KeyTransform.calibrated([k_pre], [k2], [q2], 0)


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [n, kv, dim] rotated by positions [n] (transformers' rotate_half convention)."""
    half = x.shape[-1] // 2
    freq = 1.0 / 100.0 ** (torch.arange(half) / half)
    ang = positions.float()[:, None] * freq[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Lossless:
    """A 'quantized' format that stores rows exactly (rotated): what the key transform
    does is then all that changes attention, which it must not."""

    quantized, code = True, 1

    def __init__(self, dim: int) -> None:
        self.f = KVFormat("fp8_e4m3", dim, torch.float32)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        return self.f.rotate(x)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return rows.to(dtype or torch.float32)

    def round_trip_kv(self, k, v, read=True):  # noqa: ANN001, ANN202
        k, v = self.f.rotate(k.float()), self.f.rotate(v.float())
        return k, k if read else None, v, v if read else None


def _keys(fmt: _Lossless, m: torch.Tensor, scale: torch.Tensor, positions: torch.Tensor,
          table_len: int) -> StepKeys:
    rows = _rope((m * scale).expand(table_len, *m.shape), torch.arange(table_len))
    return StepKeys(scale, fmt.rotate(rows).bfloat16(), positions)


def test_the_key_transform_changes_no_attention_output() -> None:
    """(q / s).(k * s - R_p m s + R_p m s) = q.k on every path that reads keys: a chunk
    attending to itself, a chunk reading its cached prefix, and decode (torch path)."""
    torch.manual_seed(3)
    fmt, bs, n = _Lossless(32), 4, 10
    q, k, v = torch.randn(n, 4, 32), torch.randn(n, 2, 32) * 3, torch.randn(n, 2, 32)
    m = torch.randn(2, 32) * 5
    scale = torch.exp2(torch.randint(-2, 3, (2, 32)).float())
    pos = torch.arange(n)

    def run(spans, rows, keys: bool, decode=None):  # noqa: ANN001, ANN202
        """Steps over the same cache: ``spans`` (start, count) prefills, then ``decode``."""
        cache = torch.zeros(2, 16, 2, 32)
        outs = []
        for start, count in spans:
            batch, _ = build_attention_batch([], [], [([0, 1, 2, 3], start, count)], bs)
            r = slice(start, start + count)
            sk = _keys(fmt, m, scale, pos[r], 16) if keys else None
            outs.append(paged_attention(q[r], k[r], v[r], cache, batch, bs, kv_format=fmt,
                                        keys=sk))
        if decode is not None:
            batch, _ = build_attention_batch([[0, 1, 2, 3]], [decode + 1], [], bs)
            r = slice(decode, decode + 1)
            sk = _keys(fmt, m, scale, pos[r], 13) if keys else None  # padding past 13
            outs.append(paged_attention(q[r], k[r], v[r], cache, batch, bs, kv_format=fmt,
                                        keys=sk))
        return torch.cat(outs)[rows]

    plain = run([(0, n)], slice(0, n), keys=False)
    torch.testing.assert_close(run([(0, n)], slice(0, n), True), plain, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(run([(0, 6), (6, 4)], slice(0, n), True), plain,
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(run([(0, 9)], slice(9, 10), True, decode=9), plain[9:],
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("sent", "stored"), [
    (layout("fp8_e4m3", torch.uint8, 65), layout("fp8_e5m2", torch.uint8, 65)),
    (layout("nvfp4", torch.uint8, 36), layout()),
    (layout(), layout("fp8_e4m3", torch.uint8, 65))])
def test_a_decode_worker_refuses_another_format_and_names_both(sent: KVLayout,
                                                                stored: KVLayout) -> None:
    h = TransferHeader(1, 1, 1, 2, sent, sent.payload_bytes(2), 1, 0)
    reason = check_offer(h, [4, 5], stored, [4, 5], 1 << 30)
    assert reason is not None
    assert sent.describe() in reason and stored.describe() in reason
    assert "--kv-cache-dtype" in reason
    assert check_offer(h, [4, 5], sent, [4, 5], 1 << 30) is None


def test_a_cache_of_one_kv_dtype_never_serves_another(tmp_path) -> None:
    """The block-hash chain is seeded with the KV format: the same tokens hash apart, so
    neither a worker's prefix cache nor the shared index matches across formats."""
    from common.hashing import block_hashes
    from workers.engine.llm_engine import model_identity

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    ids = [model_identity(tmp_path, "bfloat16", name) for name in KV_CACHE_DTYPES]
    assert len(set(ids)) == len(ids)
    assert ids[0] == model_identity(tmp_path, "bfloat16")  # auto keeps the old identity
    chains = {tuple(block_hashes(list(range(64)), 16, i, None)) for i in ids}
    assert len(chains) == len(ids)
