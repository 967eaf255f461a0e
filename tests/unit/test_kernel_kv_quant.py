"""The native paged decode kernel on quantized KV caches (``kv_format`` 1-3).

The cache is built by ``KVFormat.quantize`` (the pure-torch reference in
``workers/models/kv_format.py``) from random K/V and laid out as the engine holds it
(views of one ``[2, slots, kv_heads, row_elems]`` uint8 tensor, shuffled block ids, ragged
context lengths). References: the same kernel with ``kv_format=0`` on
``KVFormat.dequantize(rows, float32)`` (the kernel decodes each block to float32 and runs
the float32 code on it, so these agree to float32 rounding, in practice exactly), and
gather + SDPA in float32. Skipped when the extension cannot be built here.
"""

from __future__ import annotations

import pytest
import torch
from test_paged_decode_kernel import reference as sdpa_reference  # gather + SDPA, fp32

from workers.models.kv_format import FORMAT_CODES, KVFormat

BLOCK = 16
QUANTIZED = ("fp8_e4m3", "fp8_e5m2", "nvfp4")


@pytest.fixture(scope="module")
def op(paged_attention_op):  # noqa: ANN001, ANN201 - every compiled code path in turn
    return paged_attention_op


def block_table(lens: list[int], g: torch.Generator, spare: int = 5):
    """Shuffled block ids per sequence, zero padded, one unused column; (table, blocks)."""
    per_seq = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(per_seq) + spare
    ids = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(lens), max(max(per_seq), 1) + 1, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(per_seq):
        table[s, :nb] = ids[used:used + nb].to(torch.int32)
        used += nb
    return table, num_blocks


def engine_views(k_rows: torch.Tensor, v_rows: torch.Tensor):
    """[blocks, BLOCK, kv, row] K and V -> views of one [2, slots, kv, row] cache."""
    _, _, kv, row = k_rows.shape
    cache = torch.stack([k_rows.reshape(-1, kv, row), v_rows.reshape(-1, kv, row)])
    return cache[0].view(-1, BLOCK, kv, row), cache[1].view(-1, BLOCK, kv, row)


def make_case(fmt_name: str, lens: list[int], kv_heads: int, group: int, dim: int,
              q_dtype: torch.dtype, seed: int = 0):
    """q, quantized K/V cache views, their float32 dequantization, table, lens, format."""
    g = torch.Generator().manual_seed(seed)
    table, num_blocks = block_table(lens, g)
    shape = (num_blocks, BLOCK, kv_heads, dim)
    # Row magnitudes spread over ~2**-6 .. 2**3: exercises the per-row / per-16 scales.
    k = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 4, (*shape[:3], 1),
                                                                   generator=g).float())
    v = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-3, 4, (*shape[:3], 1),
                                                                   generator=g).float())
    q = (torch.randn(len(lens), kv_heads * group, dim, generator=g) * 0.3).to(q_dtype)
    fmt = KVFormat(fmt_name, dim, torch.float32)
    k_rows, v_rows = engine_views(fmt.quantize(k), fmt.quantize(v))
    assert k_rows.dtype == torch.uint8 and k_rows.shape[-1] == fmt.row_elems
    k_deq = fmt.dequantize(k_rows, torch.float32)
    v_deq = fmt.dequantize(v_rows, torch.float32)
    return q, k_rows, v_rows, k_deq, v_deq, table, torch.tensor(lens, dtype=torch.int32), fmt


def check(op, q, k_rows, v_rows, k_deq, v_deq, table, lens, fmt, scale) -> None:
    out = op(q, k_rows, v_rows, table, lens, scale, kv_format=fmt.code)
    assert out.dtype == q.dtype and out.shape == q.shape
    # The float32 kernel on the dequantized cache (q in float32), rounded to q's dtype.
    ref = op(q.float(), k_deq, v_deq, table, lens, scale).to(q.dtype)
    sdpa = sdpa_reference(q, k_deq, v_deq, table, lens, scale)
    if q.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)
    else:  # the output's rounding: at most one unit in the 8th / 11th bit
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-6)
        torch.testing.assert_close(out.float(), sdpa, rtol=2e-2, atol=2e-2)


LENS = [1, 16, 17, 5, 64, 100, 31, 48, 2, 130, 0]  # 1, block multiples, ragged, empty


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,group,dim", [(3, 3, 64), (2, 2, 32)])
@pytest.mark.parametrize("fmt_name", QUANTIZED)
def test_matches_dequantized_reference(op, fmt_name, kv_heads, group, dim, q_dtype) -> None:
    case = make_case(fmt_name, LENS, kv_heads, group, dim, q_dtype, seed=dim + group)
    check(op, *case, dim ** -0.5)
    out = op(case[0], case[1], case[2], case[5], case[6], kv_format=case[7].code)
    assert (out[-1] == 0).all()  # zero-length context


@pytest.mark.parametrize("fmt_name,kv_heads,group,dim", [
    ("fp8_e4m3", 1, 7, 20),    # head_dim not a multiple of 16, padded group of 7
    ("fp8_e5m2", 2, 11, 128),  # 8 + 3 heads per kv head, V pass in several chunk groups
    ("nvfp4", 2, 11, 128),
    ("nvfp4", 1, 8, 48),       # odd number of 16-value groups
    ("fp8_e4m3", 2, 5, 80),
])
def test_other_shapes(op, fmt_name, kv_heads, group, dim) -> None:
    case = make_case(fmt_name, [3, 33, 80, 16], kv_heads, group, dim, torch.float32, seed=dim)
    check(op, *case, dim ** -0.5)


@pytest.mark.parametrize("fmt_name", QUANTIZED)
def test_float16_query_int64_table_and_thread_count(op, fmt_name) -> None:
    q, k, v, kd, vd, table, lens, fmt = make_case(fmt_name, [300] * 5 + [9], 3, 3, 64,
                                                  torch.float16, seed=7)
    check(op, q, k, v, kd, vd, table.long(), lens.long(), fmt, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(q, k, v, table, lens, 0.125, kv_format=fmt.code)
        torch.set_num_threads(max(2, threads))
        many = op(q, k, v, table, lens, 0.125, kv_format=fmt.code)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@pytest.mark.parametrize("fmt_name", QUANTIZED)
def test_decodes_every_byte_pattern(op, fmt_name) -> None:
    """Arbitrary row bytes (every FP8 / E2M1 code, NaN and inf patterns, extreme scale
    bytes): with one-token contexts the output is the V row itself, decoded exactly."""
    dim, kv, group = 64, 2, 2
    fmt = KVFormat(fmt_name, dim, torch.float32)
    seqs = 16
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 256, (seqs, BLOCK, kv, fmt.row_elems), generator=g,
                         dtype=torch.uint8)
    if fmt_name == "nvfp4":
        rows[:4, 0, :, : dim // 2] = torch.arange(256, dtype=torch.uint8).view(4, 1, 64)[..., :32]
        rows[4:8, 0, :, : dim // 2] = torch.arange(256, dtype=torch.uint8).view(4, 1, 64)[..., 32:]
        rows[:8, 0, 0, dim // 2:] = torch.tensor([0x00, 0x01, 0x08, 0x7E], dtype=torch.uint8)
    else:
        rows[:8, 0, :, :dim] = torch.arange(256, dtype=torch.uint8).view(4, 64).repeat(2, 1)[
            :, None].expand(8, kv, dim)
        rows[:, 0, :, dim] = torch.randint(0, 256, (seqs, kv), generator=g, dtype=torch.uint8)
        rows[:4, 0, 0, dim] = torch.tensor([0, 1, 127, 255], dtype=torch.uint8)
        rows[4:8, 0, :, dim] = 127
        # No NaN code, scale bytes near the top (e4m3's fast path stops at 246).
        rows[8:12, 0, 0, :dim] &= 0x7E
        rows[8:12, 0, 0, dim] = torch.tensor([245, 246, 247, 254], dtype=torch.uint8)
    table = torch.arange(seqs, dtype=torch.int32).view(seqs, 1)
    lens = torch.ones(seqs, dtype=torch.int32)
    q = torch.randn(seqs, kv * group, dim, generator=g)
    keys = torch.zeros_like(rows)  # all-zero K: finite scores whatever V holds
    out = op(q, keys, rows, table, lens, kv_format=fmt.code)
    want = fmt.dequantize(rows[:, 0], torch.float32).repeat_interleave(group, dim=1)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


def test_k_decoding_with_arbitrary_finite_bytes(op) -> None:
    """K rows of arbitrary (finite) codes and scales attend as their dequantization."""
    dim, kv, group = 32, 2, 3
    g = torch.Generator().manual_seed(5)
    lens = [40, 7, 16]
    table, num_blocks = block_table(lens, g)
    for fmt_name in QUANTIZED:
        fmt = KVFormat(fmt_name, dim, torch.float32)
        k = torch.randint(0, 256, (num_blocks, BLOCK, kv, fmt.row_elems), generator=g,
                          dtype=torch.uint8)
        v = fmt.quantize(torch.randn(num_blocks, BLOCK, kv, dim, generator=g))
        if fmt_name == "nvfp4":
            k[..., dim // 2:] = torch.randint(0, 0x50, k[..., dim // 2:].shape, generator=g,
                                              dtype=torch.uint8)
        else:
            special = 0x7C if fmt_name == "fp8_e5m2" else 0x7F  # first inf/NaN magnitude
            mag = k[..., :dim] & 0x7F
            k[..., :dim] = torch.where(mag >= special, k[..., :dim] & 0xBF, k[..., :dim])
            low = 115 if fmt_name == "fp8_e4m3" else 105  # |k| up to ~56 / ~2
            k[..., dim] = torch.randint(low, low + 10, k[..., dim].shape, generator=g,
                                        dtype=torch.uint8)
        kd, vd = fmt.dequantize(k, torch.float32), fmt.dequantize(v, torch.float32)
        assert torch.isfinite(kd).all()
        q = torch.randn(len(lens), kv * group, dim, generator=g) * 0.05
        check(op, q, k, v, kd, vd, table, torch.tensor(lens, dtype=torch.int32), fmt, 0.2)


def test_rejects_bad_inputs(op) -> None:
    q, k, v, kd, vd, table, lens, fmt = make_case("fp8_e4m3", [20, 3], 2, 2, 32, torch.float32)
    code = FORMAT_CODES["fp8_e4m3"]
    with pytest.raises(RuntimeError, match="unknown kv_format code 7"):
        op(q, k, v, table, lens, kv_format=7)
    with pytest.raises(RuntimeError, match="unknown kv_format code -1"):
        op(q, k, v, table, lens, kv_format=-1)
    # A row one byte short / the nvfp4 size for fp8: message names both sizes.
    with pytest.raises(RuntimeError, match=r"row size 32 .*fp8_e4m3.*head_dim 32.*33"):
        op(q, k[..., :32], v[..., :32], table, lens, kv_format=code)
    with pytest.raises(RuntimeError, match=r"row size 33 .*nvfp4.*head_dim 32.*18"):
        op(q, k, v, table, lens, kv_format=FORMAT_CODES["nvfp4"])
    with pytest.raises(RuntimeError, match="divisible by 16"):
        op(q[..., :24], k[..., :15], v[..., :15], table, lens, kv_format=3)
    with pytest.raises(RuntimeError, match="needs uint8"):
        op(q, k.float(), v.float(), table, lens, kv_format=code)
    with pytest.raises(RuntimeError, match="needs uint8"):
        op(q, k, v.to(torch.int8), table, lens, kv_format=code)
    # A uint8 cache without its kv_format is a dtype mismatch, not garbage.
    with pytest.raises(RuntimeError, match="dtype"):
        op(q, k, v, table, lens)
    # q must still be a float type; the table is still bounds-checked.
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        op(q.to(torch.float64), k, v, table, lens, kv_format=code)
    bad = table.clone()
    bad[0, 1] = k.shape[0]
    with pytest.raises(RuntimeError, match="outside"):
        op(q, k, v, bad, lens, kv_format=code)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt_name", QUANTIZED)
def test_key_add_is_added_to_every_key_by_position(op, fmt_name, q_dtype) -> None:
    """key_add row p joins the decoded key of each sequence's token at position p: the
    same as the kernel on a float32 cache holding dequantized keys plus those rows."""
    lens = [1, 16, 17, 64, 100, 0]
    q, k, v, kd, vd, table, lens_t, fmt = make_case(fmt_name, lens, 3, 3, 64, q_dtype, seed=5)
    g = torch.Generator().manual_seed(11)
    key_add = (torch.randn(max(lens) + 3, 3, 64, generator=g) * 4).bfloat16()
    added = kd.clone()
    for s, n in enumerate(lens):
        for p in range(n):
            added[table[s, p // BLOCK], p % BLOCK] += key_add[p].float()
    out = op(q, k, v, table, lens_t, 0.125, kv_format=fmt.code, key_add=key_add)
    ref = op(q.float(), added, vd, table, lens_t, 0.125).to(q.dtype)
    if q_dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-6)
    plain = op(q, k, v, table, lens_t, 0.125, kv_format=fmt.code)
    assert not torch.allclose(out[1:-1].float(), plain[1:-1].float(), atol=1e-3)


def test_key_add_is_checked(op) -> None:
    q, k, v, kd, vd, table, lens, fmt = make_case("nvfp4", [20, 3], 2, 2, 32, torch.float32)
    good = torch.zeros(20, 2, 32, dtype=torch.bfloat16)
    op(q, k, v, table, lens, kv_format=fmt.code, key_add=good)
    with pytest.raises(RuntimeError, match="quantized caches"):
        op(q, kd, vd, table, lens, key_add=good)
    with pytest.raises(RuntimeError, match="longest context is 20"):
        op(q, k, v, table, lens, kv_format=fmt.code, key_add=good[:19])
    for bad in (good.float(), good[:, :1], good.transpose(0, 1), good[..., :16]):
        with pytest.raises(RuntimeError, match="key_add must be"):
            op(q, k, v, table, lens, kv_format=fmt.code, key_add=bad)
