"""Attention over the paged KV cache, and the per-step metadata it reads.

The cache of one layer is ``[2, slots, kv_heads, head_dim]`` where slot
``block_id * block_size + offset`` holds one token's key and value. Each step the model
runner flattens all scheduled tokens into one row per token, decode tokens first, and
builds one :class:`AttentionBatch`, shared by every layer:

* every new token's K/V is written to its slot (``slot_mapping``);
* decode tokens (one per sequence) attend together: their contexts are gathered from
  the cache into a padded ``[seqs, max_len]`` batch with a padding mask, and the query
  heads of each KV head are folded into the query-length axis, so grouped-query
  attention runs without repeating K/V;
* each prefill chunk attends causally to its own tokens (no cache read when the chunk is
  the sequence's start) or to its cached prefix plus itself (gathered from the cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSpan:
    start: int  # first row of the chunk in the step's flattened tokens
    num_tokens: int
    context_len: int  # tokens attended to, prefix included
    slots: torch.Tensor | None  # [context_len] cache slots; None = no cached prefix
    mask: torch.Tensor | None  # [num_tokens, context_len] causal mask with offset


@dataclass(frozen=True)
class AttentionBatch:
    slot_mapping: torch.Tensor  # [tokens]
    num_decode: int
    decode_slots: torch.Tensor | None  # [num_decode, max_len]
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_len]; None = no padding
    prefills: tuple[PrefillSpan, ...]


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
    """
    slots: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    num_decode = len(decode_tables)
    decode_slots = decode_mask = None
    if num_decode:
        max_len = max(decode_lens)
        max_blocks = -(-max_len // block_size)
        table = torch.tensor([t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks]))
                              for t in decode_tables], dtype=torch.long)
        offsets = torch.arange(block_size)
        decode_slots = (table.unsqueeze(-1) * block_size + offsets).view(num_decode, -1)
        decode_slots = decode_slots[:, :max_len].contiguous()
        lens = torch.tensor(decode_lens, dtype=torch.long)
        if min(decode_lens) != max_len:
            decode_mask = (torch.arange(max_len) < lens.unsqueeze(1)).view(
                num_decode, 1, 1, max_len
            )
        slots.append(decode_slots.gather(1, (lens - 1).unsqueeze(1)).squeeze(1))
        positions.append(lens - 1)
    spans = []
    row = num_decode
    for table, start, n in prefill_spans:
        ctx = start + n
        pos = torch.arange(start, ctx)
        t = torch.tensor(table, dtype=torch.long)
        all_slots = t[torch.arange(ctx) // block_size] * block_size + torch.arange(ctx) % block_size
        slots.append(all_slots[start:])
        positions.append(pos)
        if start == 0:
            spans.append(PrefillSpan(row, n, ctx, None, None))
        else:
            mask = torch.arange(ctx).unsqueeze(0) <= pos.unsqueeze(1)
            spans.append(PrefillSpan(row, n, ctx, all_slots, mask))
        row += n
    batch = AttentionBatch(
        slot_mapping=torch.cat(slots),
        num_decode=num_decode,
        decode_slots=decode_slots,
        decode_mask=decode_mask,
        prefills=tuple(spans),
    )
    return batch, torch.cat(positions)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, batch: AttentionBatch
) -> torch.Tensor:
    """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim]; returns [tokens, heads*dim].

    Writes k and v into ``cache`` ([2, slots, kv_heads, dim]) before reading it.
    """
    num_tokens, num_heads, dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    k_cache, v_cache = cache[0], cache[1]
    k_cache.index_copy_(0, batch.slot_mapping, k)
    v_cache.index_copy_(0, batch.slot_mapping, v)
    out = torch.empty_like(q)
    d = batch.num_decode
    if d:
        # [d, len, kv, dim] -> [d, kv, len, dim]; queries [d, kv, group, dim].
        kd = k_cache[batch.decode_slots].transpose(1, 2)
        vd = v_cache[batch.decode_slots].transpose(1, 2)
        qd = q[:d].view(d, num_kv, group, dim)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=batch.decode_mask)
        out[:d] = od.reshape(d, num_heads, dim)
    for span in batch.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)
        if span.slots is None:
            kp, vp = k[rows], v[rows]
        else:
            kp, vp = k_cache[span.slots], v_cache[span.slots]
        op = F.scaled_dot_product_attention(
            qp,
            kp.transpose(0, 1).unsqueeze(0),
            vp.transpose(0, 1).unsqueeze(0),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            enable_gqa=group > 1,
        )
        out[rows] = op[0].transpose(0, 1)
    return out.view(num_tokens, num_heads * dim)
