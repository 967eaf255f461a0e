"""Attention over the paged KV cache, and the per-step metadata it reads.

The cache of one layer is ``[2, slots, kv_heads, head_dim]`` where slot
``block_id * block_size + offset`` holds one token's key and value. Each step the model
runner flattens all scheduled tokens into one row per token, decode tokens first, and
builds one :class:`AttentionBatch`, shared by every layer:

* every new token's K/V is written to its slot (``slot_mapping``);
* decode tokens (one per sequence) attend together. With the native kernel
  (``workers/engine/kernels``, compiled on first use) attention reads K/V straight from
  the blocks of each block table; without a C++ compiler, the contexts are gathered into
  a padded ``[seqs, max_len]`` batch with a padding mask and the query heads of each KV
  head are folded into the query-length axis, so grouped-query attention runs without
  repeating K/V. Both paths are tested against each other;
* each prefill chunk attends causally to its own tokens (no cache read when the chunk is
  the sequence's start) or to its cached prefix plus itself (gathered from the cache).

With a quantized cache (:mod:`workers.models.kv_format`) a slot holds a row of bytes
(values and scales) instead of ``head_dim`` elements; every token's K/V is quantized as
it is written, and attention reads it back dequantized: the native decode kernel reads
the bytes of each block directly, the torch paths dequantize what they gather, and a
chunk's own K/V go through the same round trip so every token sees K/V as stored.
Keys are stored under the model's calibrated key transform (:class:`StepKeys`), undone
exactly as they are read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from workers.models.kv_format import KVFormat


@dataclass(frozen=True)
class PrefillSpan:
    start: int  # first row of the chunk in the step's flattened tokens
    num_tokens: int
    context_len: int  # tokens attended to, prefix included
    blocks: torch.Tensor | None  # block ids covering the context; None = no cached prefix
    mask: torch.Tensor | None  # [num_tokens, blocks * block_size] causal mask with offset


@dataclass(frozen=True)
class StepKeys:
    """One layer's :class:`~workers.models.kv_format.KeyTransform` for one step, as
    :func:`paged_attention` applies it to a quantized cache: queries divided and keys
    multiplied by ``scale`` (``[kv_heads, head_dim]`` float32, powers of two); ``table``
    (``[positions, kv_heads, head_dim]`` bfloat16, in the stored basis: the key offset
    rotated to each position and scaled) is subtracted from each new key at its
    ``positions`` before it is stored, and added back to every key read from the cache,
    by position (the native kernel's ``key_add``). Subtracting the same rounded rows that
    reads add makes the round trip exact but for the format's own rounding. Parts None
    are off."""

    scale: torch.Tensor | None
    table: torch.Tensor | None
    positions: torch.Tensor | None

    def into_stored(self, q: torch.Tensor, k: torch.Tensor, fmt: KVFormat
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries, keys to store) before the format's rotation; keys in float32."""
        k = k.float()
        if self.scale is not None:
            kv, dim = self.scale.shape
            inv = (1.0 / self.scale).to(q.dtype).unsqueeze(1)  # exact: powers of two
            q = (q.view(q.shape[0], kv, -1, dim) * inv).view(q.shape)
            k = k * self.scale
        if self.table is not None:  # the rows in the keys' basis: H is its own inverse
            k = k - fmt.rotate(self.table[self.positions].float())
        return q, k

    def fresh(self, k: torch.Tensor) -> torch.Tensor:
        """The step's own keys as read back (stored basis, float32) plus their rows."""
        return k.float() + self.table[self.positions].float() if self.table is not None \
            else k

    def add_back(self, k: torch.Tensor) -> torch.Tensor:
        """Keys read from the cache ``[..., length, kv_heads, head_dim]`` (float32, in
        block-table order: index = position) plus the table; rows past the table (padding
        a mask hides) get nothing."""
        if self.table is None:
            return k
        length = k.shape[-3]
        add = self.table[:length].float()
        if add.shape[0] < length:
            add = F.pad(add, (0, 0, 0, 0, 0, length - add.shape[0]))
        return k + add


@dataclass(frozen=True)
class AttentionBatch:
    slot_mapping: torch.Tensor  # [tokens]
    num_decode: int
    decode_table: torch.Tensor | None  # [num_decode, max_blocks] block ids, zero-padded
    decode_lens: torch.Tensor | None  # [num_decode] context lengths, new token included
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size]
    prefills: tuple[PrefillSpan, ...]

    def to(self, device: torch.device) -> AttentionBatch:
        """The same metadata on ``device`` (built on the CPU, used where the cache is)."""

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        spans = tuple(replace(p, blocks=mv(p.blocks), mask=mv(p.mask)) for p in self.prefills)
        return replace(self, slot_mapping=mv(self.slot_mapping), decode_table=mv(self.decode_table),
                       decode_lens=mv(self.decode_lens), decode_mask=mv(self.decode_mask),
                       prefills=spans)


def build_attention_batch(
    decode_tables: list[list[int]],
    decode_lens: list[int],
    prefill_spans: list[tuple[list[int], int, int]],
    block_size: int,
) -> tuple[AttentionBatch, torch.Tensor]:
    """Metadata for one step; also returns the positions of every token row.

    ``decode_tables``/``decode_lens``: block table and context length (new token
    included) per decoding sequence. ``prefill_spans``: (block table, start position,
    number of tokens) per prefill chunk, in row order after the decode rows.

    Contexts are gathered whole blocks at a time (``index_select`` of 16-token rows is
    ~3x faster here than gathering token slots), so the gathered length is rounded up
    to a block and the mask hides the tail.
    """
    slots: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    num_decode = len(decode_tables)
    table = lens = decode_mask = None
    if num_decode:
        max_blocks = -(-max(decode_lens) // block_size)
        padded = [t[:max_blocks] + [0] * (max_blocks - min(len(t), max_blocks))
                  for t in decode_tables]
        table = torch.tensor(padded, dtype=torch.long)
        lens = torch.tensor(decode_lens, dtype=torch.long)
        width = max_blocks * block_size
        if min(decode_lens) != width:
            decode_mask = (torch.arange(width) < lens.unsqueeze(1)).view(num_decode, 1, 1, width)
        last = lens - 1
        slots.append(table.gather(1, (last // block_size).unsqueeze(1)).squeeze(1) * block_size
                     + last % block_size)
        positions.append(last)
    spans = []
    row = num_decode
    for block_table, start, n in prefill_spans:
        ctx = start + n
        pos = torch.arange(start, ctx)
        nblocks = -(-ctx // block_size)
        blocks = torch.tensor(block_table[:nblocks], dtype=torch.long)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        positions.append(pos)
        if start == 0:
            spans.append(PrefillSpan(row, n, ctx, None, None))
        else:
            mask = torch.arange(nblocks * block_size).unsqueeze(0) <= pos.unsqueeze(1)
            spans.append(PrefillSpan(row, n, ctx, blocks, mask))
        row += n
    batch = AttentionBatch(
        slot_mapping=torch.cat(slots),
        num_decode=num_decode,
        decode_table=table,
        decode_lens=lens,
        decode_mask=decode_mask,
        prefills=tuple(spans),
    )
    return batch, torch.cat(positions)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    batch: AttentionBatch,
    block_size: int,
    decode_op: Callable | None = None,
    kv_format: KVFormat | None = None,
    keys: StepKeys | None = None,
    write_decode_op: Callable | None = None,
) -> torch.Tensor:
    """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim]; returns [tokens, heads*dim].

    Writes k and v into ``cache`` ([2, slots, kv_heads, row]; ``row`` is ``dim`` unless
    ``kv_format`` is quantized) before reading it. ``keys``: the key transform a
    quantized cache stores keys under (:class:`StepKeys`); None: none.
    ``write_decode_op`` (the native ``paged_write_decode_attention``): with an
    unquantized cache and decode tokens in the step, it does the writes and the decode
    attention in one call and allocates the output (``decode_op`` is then unused).
    """
    num_tokens, num_heads, dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    k_cache, v_cache = cache[0], cache[1]
    quantized = kv_format is not None and kv_format.quantized
    keys = keys if quantized else None
    if quantized:  # everything below runs in the rotated basis the rows are stored in
        if keys is not None:
            q, k = keys.into_stored(q, k, kv_format)  # one rounding, at quantization
        q = kv_format.rotate(q)
        # only a chunk attending to itself uncached reads the step's K/V directly
        fresh = any(span.blocks is None for span in batch.prefills)
        k_rows, k, v_rows, v = kv_format.round_trip_kv(k, v, read=fresh)
        if k is not None and keys is not None:
            k = keys.fresh(k)
        k = k.to(q.dtype) if k is not None else None
    else:
        k_rows, v_rows = k, v
    row = k_cache.shape[-1]
    k_blocks = k_cache.view(-1, block_size, num_kv, row)
    v_blocks = v_cache.view(-1, block_size, num_kv, row)
    d = batch.num_decode
    fused = d > 0 and write_decode_op is not None and not quantized
    if fused:  # writes, decode attention and the output in one call
        out = write_decode_op(q, k, v, k_blocks, v_blocks, batch.slot_mapping,
                              batch.decode_table, batch.decode_lens, dim**-0.5)
    else:
        k_cache.index_copy_(0, batch.slot_mapping, k_rows)
        v_cache.index_copy_(0, batch.slot_mapping, v_rows)
        out = torch.empty_like(q)

    def gathered(blocks: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = blocks.index_select(0, ids)
        return kv_format.dequantize(rows, q.dtype) if quantized else rows

    def gathered_keys(ids: torch.Tensor, seqs: int) -> torch.Tensor:
        """``[seqs, length, kv, dim]`` keys of ``seqs`` block tables (``ids`` flat)."""
        if keys is None or keys.table is None:
            return gathered(k_blocks, ids).view(seqs, -1, num_kv, dim)
        rows = kv_format.dequantize(k_blocks.index_select(0, ids), torch.float32)
        return keys.add_back(rows.view(seqs, -1, num_kv, dim)).to(q.dtype)

    if d and not fused and decode_op is not None:
        args = (q[:d], k_blocks, v_blocks, batch.decode_table, batch.decode_lens, dim**-0.5)
        if quantized:
            out[:d] = decode_op(*args, kv_format.code, keys.table if keys else None)
        else:
            out[:d] = decode_op(*args)
    elif d and not fused:
        # [d, len, kv, dim] -> [d, kv, len, dim]; queries [d, kv, group, dim].
        blocks = batch.decode_table.view(-1)
        kd = gathered_keys(blocks, d).transpose(1, 2)
        vd = gathered(v_blocks, blocks).view(d, -1, num_kv, dim).transpose(1, 2)
        qd = q[:d].view(d, num_kv, group, dim)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=batch.decode_mask)
        out[:d] = od.reshape(d, num_heads, dim)
    for span in batch.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)
        if span.blocks is None:
            kp, vp = k[rows], v[rows]
        else:
            kp = gathered_keys(span.blocks, 1)[0]
            vp = gathered(v_blocks, span.blocks).view(-1, num_kv, dim)
        op = F.scaled_dot_product_attention(
            qp,
            kp.transpose(0, 1).unsqueeze(0),
            vp.transpose(0, 1).unsqueeze(0),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            enable_gqa=group > 1,
        )
        out[rows] = op[0].transpose(0, 1)
    if quantized:
        out = kv_format.rotate(out)  # back from the stored basis: H @ H = I
    return out.view(num_tokens, num_heads * dim)
