"""The native paged decode-attention kernel against plain torch attention.

Random caches, shuffled (non-contiguous) block tables and ragged context lengths; the
reference gathers each context and runs SDPA the way ``attention.py`` does. Skipped
when the extension cannot be built here (no C++ compiler).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.models.attention import build_attention_batch, paged_attention

BLOCK = 16


@pytest.fixture(scope="module")
def op(paged_attention_op):  # noqa: ANN001, ANN201 - every compiled code path in turn
    return paged_attention_op


def make_case(lens: list[int], kv_heads: int, group: int, dim: int, dtype: torch.dtype,
              seed: int = 0, spare_blocks: int = 5, table_dtype: torch.dtype = torch.int32):
    """q, k/v caches [blocks, BLOCK, kv, dim], block tables (shuffled ids, zero padded)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(per_seq) + spare_blocks
    ids = torch.randperm(num_blocks, generator=g)
    width = max(max(per_seq), 1) + 1  # one unused column: tables may be wider than needed
    table = torch.zeros(len(lens), width, dtype=table_dtype)
    used = 0
    for s, nb in enumerate(per_seq):
        table[s, :nb] = ids[used:used + nb].to(table_dtype)
        used += nb
    shape = (num_blocks, BLOCK, kv_heads, dim)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(len(lens), kv_heads * group, dim, generator=g).to(dtype)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32)


def reference(q, k, v, table, lens, scale):
    """Gather each context's blocks, then SDPA in float32 with query heads folded per kv head."""
    num_seqs, heads, dim = q.shape
    kv = k.shape[2]
    out = torch.zeros(num_seqs, heads, dim)
    for s in range(num_seqs):
        n = int(lens[s])
        if n == 0:
            continue
        blocks = table[s, : -(-n // BLOCK)].long()
        ks = k.index_select(0, blocks).reshape(-1, kv, dim)[:n].float().transpose(0, 1)
        vs = v.index_select(0, blocks).reshape(-1, kv, dim)[:n].float().transpose(0, 1)
        qs = q[s].float().view(kv, heads // kv, dim)
        out[s] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).reshape(heads, dim)
    return out


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # output rounding (bf16: 8 bits of mantissa) on values of magnitude ~1
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


LENS = [1, 16, 17, 5, 64, 100, 31, 48, 2, 130]  # 1, exact block multiples, ragged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [12, 64])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (3, 3)])
def test_matches_torch_reference(op, dtype, dim, kv_heads, group) -> None:
    q, k, v, table, lens = make_case(LENS, kv_heads, group, dim, dtype, seed=dim + group)
    scale = dim ** -0.5
    out = op(q, k, v, table, lens, scale)
    check(out, reference(q, k, v, table, lens, scale), dtype)


@pytest.mark.parametrize("dim,kv_heads,group", [(20, 1, 7), (128, 2, 11), (64, 1, 8), (32, 2, 5)])
def test_other_head_dims_and_group_sizes(op, dim, kv_heads, group) -> None:
    q, k, v, table, lens = make_case([3, 33, 80, 16], kv_heads, group, dim, torch.float32)
    out = op(q, k, v, table, lens, 0.3)
    check(out, reference(q, k, v, table, lens, 0.3), torch.float32)


def test_float16_int64_tables_and_default_scale(op) -> None:
    q, k, v, table, lens = make_case(LENS, 3, 3, 64, torch.float16, table_dtype=torch.int64)
    out = op(q, k, v, table, lens.long())
    check(out, reference(q, k, v, table, lens, 64 ** -0.5), torch.float16)


def test_reads_the_engine_cache_layout_in_place(op) -> None:
    """Views of one [2, slots, kv, dim] cache and a q sliced from a wider activation."""
    kv, group, dim = 3, 3, 64
    q, k, v, table, lens = make_case([7, 40, 200], kv, group, dim, torch.float32)
    cache = torch.stack([k.view(-1, kv, dim), v.view(-1, kv, dim)])
    k_view = cache[0].view(-1, BLOCK, kv, dim)
    v_view = cache[1].view(-1, BLOCK, kv, dim)
    wide = torch.cat([q.view(3, -1), torch.randn(3, 2 * kv * dim)], dim=1)  # q | k | v
    q_view = wide[:, : kv * group * dim].view(3, kv * group, dim)
    assert not q_view.is_contiguous()
    out = op(q_view, k_view, v_view, table, lens, 0.125)
    check(out, reference(q, k, v, table, lens, 0.125), torch.float32)


def test_large_scores_and_empty_context(op) -> None:
    """Max subtraction keeps huge logits finite; a zero-length context gives zeros."""
    q, k, v, table, lens = make_case([0, 50, 1], 1, 2, 16, torch.float32)
    q = q * 400
    out = op(q, k, v, table, lens, 1.0)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all()
    check(out, reference(q, k, v, table, lens, 1.0), torch.float32)


def test_nan_query_stays_in_its_head(op) -> None:
    """A NaN in one query head makes that head's output NaN, as torch's attention does
    (the softmax's exp clamp must not turn it into a weight), and leaves the other heads
    and sequences alone. 37 tokens x 3 heads is no multiple of 8 lanes: the exp's tail."""
    q, k, v, table, lens = make_case([37, 37], 1, 3, 64, torch.float32)
    q[0, 1, 5] = float("nan")
    out = op(q, k, v, table, lens, 0.125)
    assert torch.isnan(out[0, 1]).all()
    clean = q.clone()
    clean[0, 1] = 0
    expected = reference(clean, k, v, table, lens, 0.125)
    check(out[:, [0, 2]], expected[:, [0, 2]], torch.float32)
    check(out[1], expected[1], torch.float32)

def test_thread_count_does_not_change_results(op) -> None:
    q, k, v, table, lens = make_case([300] * 6 + [9], 3, 3, 64, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(q, k, v, table, lens, 0.125)
        torch.set_num_threads(max(2, threads))
        many = op(q, k, v, table, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@pytest.mark.parametrize("dim,kv_heads,group,dtype", [
    (64, 3, 3, torch.float32),    # SmolLM2's shape: the AVX-512 kernel compiled for it
    (16, 2, 3, torch.bfloat16),   # the tiny test models' shapes, likewise
    (32, 2, 3, torch.float16),
    (32, 4, 1, torch.float32),    # the rest: the any-shape kernels
    (64, 2, 7, torch.bfloat16),   # 7 heads padded to 8
    (64, 8, 4, torch.float32),
    (20, 3, 2, torch.float32),    # a masked tail chunk (AVX2: the per-head walk only)
    (64, 2, 5, torch.float32),    # AVX2 keeps 5 on the per-head walk
    (128, 2, 8, torch.float16),
])
def test_row_walk_gives_the_per_head_walks_bits(op, dim, kv_heads, group, dtype) -> None:
    """The row-order walk (a sequence's rows read whole, every kv head at once) against
    the per-head walk on the same inputs: equal bit for bit, empty and 1-token contexts
    included, whichever walk a batch takes."""
    from workers.engine import kernels

    # A batch, then a lone short context and a pair: too little work to wake a second
    # thread, so the row walk takes them on one thread.
    for n, lengths in enumerate(([0, *LENS], [37], [5, 90])):
        q, k, v, table, lens = make_case(lengths, kv_heads, group, dim, dtype, seed=dim + n)
        with kernels.row_walk(True):
            rows = op(q, k, v, table, lens, 0.2)
        with kernels.row_walk(False):
            heads = op(q, k, v, table, lens, 0.2)
        assert torch.equal(rows, heads), lengths
        check(rows, reference(q, k, v, table, lens, 0.2), dtype)


def test_rejects_bad_inputs(op) -> None:
    q, k, v, table, lens = make_case([20, 3], 2, 2, 16, torch.float32)
    bad = table.clone()
    bad[0, 1] = k.shape[0]
    with pytest.raises(RuntimeError, match="outside"):
        op(q, k, v, bad, lens, 1.0)
    with pytest.raises(RuntimeError, match="outside"):
        op(q, k, v, table, torch.tensor([20, table.shape[1] * BLOCK + 1], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="dtype"):
        op(q.bfloat16(), k, v, table, lens, 1.0)
    with pytest.raises(RuntimeError, match="multiple"):
        op(q[:, :3], k, v, table, lens, 1.0)


def _write_op(op):  # noqa: ANN001, ANN202 - the fused twin on the same code path
    import functools

    from workers.engine import kernels

    return functools.partial(kernels.paged_write_decode_attention, isa=op.keywords["isa"])


def test_fused_write_matches_index_copy_then_attend(op) -> None:
    """``paged_attention`` with the fused write op against its three calls: a step of two
    decodes (one starting a new block), a fresh prefill and a prefill over a cached
    prefix (which reads the rows this step writes); same cache and output, bit for bit."""
    kv, group, dim, slots = 3, 3, 64, 20 * BLOCK
    g = torch.Generator().manual_seed(7)
    base = torch.randn(2, slots, kv, dim, generator=g)
    batch, _ = build_attention_batch(
        [[4, 9, 2], [11]], [40, 1], [([5, 6], 0, 20), ([12, 13, 14], 30, 9)], BLOCK)
    tokens = batch.slot_mapping.numel()
    qkv = torch.randn(tokens, (kv * group + 2 * kv) * dim, generator=g)
    q = qkv[:, : kv * group * dim].view(tokens, kv * group, dim)  # views, as in the model
    k = qkv[:, kv * group * dim: (kv * group + kv) * dim].view(tokens, kv, dim)
    v = qkv[:, (kv * group + kv) * dim:].view(tokens, kv, dim)
    plain, fused = base.clone(), base.clone()
    expected = paged_attention(q, k, v, plain, batch, BLOCK, decode_op=op)
    got = paged_attention(q, k, v, fused, batch, BLOCK, decode_op=op, write_decode_op=_write_op(op))
    assert torch.equal(fused, plain)
    assert torch.equal(got, expected)


def test_fused_write_rejects_a_bad_slot_before_writing(op) -> None:
    q, k, v, table, lens = make_case([20, 3], 2, 2, 16, torch.float32)
    write = _write_op(op)
    new_k, new_v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    before = k.clone()
    slots = torch.tensor([5, k.shape[0] * BLOCK])  # the second is one past the cache
    with pytest.raises(RuntimeError, match="outside"):
        write(q, new_k, new_v, k, v, slots, table, lens)
    assert torch.equal(k, before)  # the valid first row was not written either
    with pytest.raises(RuntimeError, match="dtype"):
        write(q, new_k.bfloat16(), new_v, k, v, torch.tensor([5, 6]), table, lens)
    with pytest.raises(RuntimeError, match="k and v must be"):
        write(q, new_k[:1], new_v[:1], k, v, torch.tensor([5]), table, lens)
    bad_table = table.clone()
    bad_table[0, 0] = k.shape[0]  # a block id past the cache: refused before any write
    with pytest.raises(RuntimeError, match="outside"):
        write(q, new_k, new_v, k, v, torch.tensor([5, 6]), bad_table, lens)
    assert torch.equal(k, before)

def test_attention_batch_moves_every_tensor_to_the_device() -> None:
    """What a CUDA engine does each step (checked here with the CPU as the target)."""
    batch, _ = build_attention_batch([[3, 4], [5]], [6, 2], [([7, 8, 9], 4, 5)], 4)
    moved = batch.to(torch.device("cpu"))
    assert moved.num_decode == batch.num_decode and len(moved.prefills) == 1
    for a, b in [(moved.slot_mapping, batch.slot_mapping), (moved.decode_table,
                 batch.decode_table), (moved.decode_lens, batch.decode_lens),
                 (moved.decode_mask, batch.decode_mask), (moved.prefills[0].blocks,
                 batch.prefills[0].blocks), (moved.prefills[0].mask, batch.prefills[0].mask)]:
        assert torch.equal(a, b)
