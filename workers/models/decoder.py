"""The Llama-family decoder forward over a paged KV cache.

One implementation serves Llama, Mistral, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k
RMSNorm): they differ only in which weights exist. Weights come from a model that
transformers loaded with ``from_pretrained``; q/k/v and gate/up are concatenated once so
each layer runs four GEMMs over all tokens of the step (prefill chunks and decode tokens
flattened together). RoPE tables come from the transformers model's own rotary module,
so every RoPE scaling variant it supports is reproduced exactly. Numerics follow the
transformers reference (RMSNorm in fp32, residual adds in the model dtype) so greedy
output matches it token for token.

Attention reads and writes the paged cache through the :class:`AttentionBatch` the
model runner prepares once per step; see ``workers/engine/attention.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from workers.models.attention import (
    AttentionBatch,
    StepKeys,
    build_attention_batch,
    paged_attention,
)
from workers.models.kv_format import KeyTransform, KVFormat
from workers.models.linear import (
    TORCH_LINEAR,
    Int8Weight,
    LinearOps,
    Weight,
    by_weight,
    cat_weights,
    weight_nbytes,
)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass
class LayerWeights:
    """A layer's weights; the four projections in their ``LinearOps.prepare`` form (a
    tensor, or an :class:`Int8Weight` when quantized)."""

    input_norm: torch.Tensor
    qkv: Any
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Any
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Any
    down: Any


def supported_architecture(cfg: Any, model_class: str = "") -> bool:  # noqa: ANN401
    """Whether a transformers config (``model_class``: the model's class name, where the
    config names no architecture) is one :class:`DecoderModel` runs."""
    return (cfg.architectures or [model_class])[0] in SUPPORTED_ARCHITECTURES


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_eps: float

    @classmethod
    def of(cls, cfg: Any) -> ModelShape:  # noqa: ANN401 - a transformers config
        """The shape a supported checkpoint's config describes."""
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            rms_eps=cfg.rms_norm_eps,
        )

    def layer_gemms(self) -> list[tuple[int, int]]:
        """``(in, out)`` of one layer's GEMMs as the model runs them: fused q/k/v, the
        attention output, fused gate/up, down."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [(self.hidden_size, q + 2 * kv), (q, self.hidden_size),
                (self.hidden_size, 2 * self.intermediate_size),
                (self.intermediate_size, self.hidden_size)]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op (fp32 statistics, weight in model dtype)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, 1, head_dim] (halves duplicated)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    x.add_(residual)
    return rms_norm(x, weight, eps)


def _rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return qk.copy_(apply_rope(qk, cos, sin))


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class NativeLayer:
    """One layer's projections (qkv, o, gate_up, down) as a native decode layer takes
    them (:data:`~workers.models.linear.NativeForm`): weights, kinds, and each int8
    projection's scales (None for float ones)."""

    weights: list[torch.Tensor]
    kinds: list[int]
    scales: list[torch.Tensor | None]


@dataclass(frozen=True)
class ElementwiseOps:
    """The memory-bound ops between GEMMs. ``TORCH_OPS`` are the reference; the native
    kernels (``workers.engine.kernels``) are fused versions equal to them bit for bit."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    rope_: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]


TORCH_OPS = ElementwiseOps(rms_norm, _add_rms_norm, _rope_, _silu_mul)


class DecoderModel:
    """Holds the weights and runs one step's forward; owns no cache and no state."""

    def __init__(
        self,
        hf_model: torch.nn.Module,
        max_positions: int,
        decode_op: Callable | None = None,
        ops: ElementwiseOps = TORCH_OPS,
        linear: LinearOps = TORCH_LINEAR,
        kv_cache_dtype: str = "auto",
        head_linear: LinearOps | None = None,
        prequantized: Mapping[str, Int8Weight] | None = None,
        write_decode_op: Callable | None = None,
        layer_op: Callable | None = None,
    ) -> None:
        """``decode_op``: the native paged decode attention (None: the torch path);
        ``write_decode_op``: its twin that also writes the step's K/V (unquantized caches;
        see :func:`~workers.models.attention.paged_attention`). ``linear``: the decoder
        layers' projections; ``head_linear``: the LM head's
        (None: ``linear``). A quantized ``linear`` (int8) keeps the embeddings and, given
        a plain ``head_linear``, the LM head in the model dtype. ``prequantized``: int8
        weights by module name (``model.layers.0.self_attn.q_proj``) from a pre-quantized
        checkpoint, used instead of the module's weight (``linear`` must be quantized).
        ``layer_op`` (the native ``decode_layer``): runs each layer of a step whose every
        token decodes in one call, the Python layer's ops bit for bit, where ``linear``
        has a native form at that batch (:attr:`LinearOps.native`) and the cache is
        unquantized; None: always the Python layer."""
        self.decode_op = decode_op  # fused paged decode attention; None: the torch path
        self.write_decode_op = write_decode_op
        self.layer_op = layer_op
        self._layer_native = linear.native if layer_op is not None else None
        # rows -> per layer (weights, kinds, int8 scales) for layer_op, or None: not native
        # at that size
        self._native_by_rows: dict[int, list[NativeLayer] | None] = {}
        self.ops = ops
        head = head_linear or linear
        if prequantized and not linear.quantized:
            raise ValueError(f"pre-quantized int8 weights need int8 linear ops, got "
                             f"{linear.name!r}")
        if head is not linear and not linear.quantized:
            raise ValueError("head_linear is for quantized layer ops only")
        # On weights already in their prepare's form; one callable for the whole model.
        self.linear = (linear.apply if head is linear
                       else by_weight(linear.apply, head.apply))
        self.linear_name = linear.name if head is linear else f"{linear.name}, head {head.name}"
        """Which :class:`LinearOps` the GEMMs run (reports and benchmarks)."""
        cfg = hf_model.config
        arch = (cfg.architectures or [type(hf_model).__name__])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch} is not supported; supported: {SUPPORTED_ARCHITECTURES}"
            )
        self.shape = ModelShape.of(cfg)
        self.kv_format = KVFormat(kv_cache_dtype, self.shape.head_dim,
                                  hf_model.model.embed_tokens.weight.dtype)
        """How a cache row stores one token's K or V of one head (see :mod:`.kv_format`)."""
        self.key_transform: KeyTransform | None = None
        """How a quantized cache stores keys (:meth:`calibrate_keys`); None: as they are."""
        self._key_stats: list[list[torch.Tensor]] | None = None  # while calibrating
        self._key_tables: dict[int, torch.Tensor] = {}  # layer -> add-back by position
        self._key_tables_for: tuple[object, object] = (None, None)  # (format, transform)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        inner = hf_model.model
        self.dtype = inner.embed_tokens.weight.dtype
        self.embed = inner.embed_tokens.weight.detach()
        self.final_norm = inner.norm.weight.detach()
        # Often tied to embed; prepared, it is its own copy in the GEMM's layout.
        self.lm_head = head.prepare(hf_model.lm_head.weight.detach())
        names = {m: n for n, m in hf_model.named_modules()} if prequantized else {}

        def source(module: torch.nn.Module) -> Weight:
            pre = prequantized.get(names[module]) if prequantized else None
            return pre if pre is not None else module.weight.detach()

        self.layers = [self._layer_weights(layer, linear.prepare, source)
                       for layer in inner.layers]
        # RoPE tables for every position, computed by the model's own rotary module.
        with torch.no_grad():
            device = self.embed.device
            pos = torch.arange(max_positions, device=device).unsqueeze(0)
            probe = torch.empty(1, dtype=self.dtype, device=device)
            cos, sin = inner.rotary_emb(probe, pos)
        self.cos = cos[0].unsqueeze(1).contiguous()  # [positions, 1, head_dim]
        self.sin = sin[0].unsqueeze(1).contiguous()
        self._cos32, self._sin32 = self.cos.float(), self.sin.float()  # key transform

    @staticmethod
    def _layer_weights(layer: torch.nn.Module, prepare: Callable[[Weight], Any],
                       source: Callable[[torch.nn.Module], Weight]) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        biases = [p.bias for p in projections]
        if mlp.gate_proj.bias is not None:
            raise ValueError("MLP biases are not supported")

        def w(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach()

        return LayerWeights(
            input_norm=layer.input_layernorm.weight.detach(),
            qkv=prepare(cat_weights([source(p) for p in projections])),
            qkv_bias=None if biases[0] is None else torch.cat([b.detach() for b in biases]),
            q_norm=w(getattr(attn, "q_norm", None) and attn.q_norm.weight),
            k_norm=w(getattr(attn, "k_norm", None) and attn.k_norm.weight),
            o=prepare(source(attn.o_proj)),
            o_bias=w(attn.o_proj.bias),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=prepare(cat_weights([source(mlp.gate_proj), source(mlp.up_proj)])),
            down=prepare(source(mlp.down_proj)),
        )

    @torch.inference_mode()
    def calibrate_keys(self, ids: list[int], block_size: int = 16) -> int:
        """Set :attr:`key_transform` from one prefill of ``ids`` at model precision into a
        scratch cache, when the cache format is quantized (see
        :class:`~workers.models.kv_format.KeyTransform`). Returns its digest (0: none)."""
        if not self.kv_format.quantized or not ids:
            return 0
        s, fmt = self.shape, self.kv_format
        n = len(ids)
        blocks = -(-n // block_size)
        cache = torch.zeros(s.num_layers, 2, blocks * block_size, s.num_kv_heads, s.head_dim,
                            dtype=self.dtype, device=self.embed.device)
        batch, positions = build_attention_batch([], [], [(list(range(blocks)), 0, n)],
                                                 block_size)
        self.kv_format, self.key_transform, self._key_stats = (
            KVFormat("auto", s.head_dim, self.dtype), None, [])
        try:
            dev = self.embed.device
            self.forward(torch.tensor(ids, device=dev), positions.to(dev), batch.to(dev),
                         cache, torch.tensor([n - 1], device=dev), block_size)
            key_pre, key_sq, query_sq = zip(*self._key_stats, strict=True)
            self.key_transform = KeyTransform.calibrated(list(key_pre), list(key_sq),
                                                         list(query_sq), n)
        finally:
            self.kv_format, self._key_stats = fmt, None
        return self.key_transform.digest()

    def _step_keys(self, layer: int, positions: torch.Tensor, upto: int) -> StepKeys:
        """The key transform's part for ``layer`` in a step whose new tokens sit at
        ``positions`` and that reads positions below ``upto`` (see
        :class:`~workers.models.attention.StepKeys`)."""
        kt = self.key_transform  # set, and the format quantized: forward checks
        scale = kt.scales[layer] if kt.scales is not None else None
        if kt.offsets is None:
            return StepKeys(scale, None, None)
        return StepKeys(scale, self._key_table(layer, upto), positions)

    def _key_table(self, layer: int, upto: int) -> torch.Tensor:
        """``[>= upto, kv_heads, head_dim]`` bfloat16: row ``p`` the key offset rotated to
        position ``p`` (RoPE), scaled, in the cache's stored basis. Grown by doubling as
        contexts grow; rebuilt when the format or the transform change."""
        fmt, kt = self._key_tables_for
        if fmt is not self.kv_format or kt is not self.key_transform:
            self._key_tables = {}
            self._key_tables_for = (self.kv_format, self.key_transform)
        table = self._key_tables.get(layer)
        if table is None or table.shape[0] < upto:
            size = min(self._cos32.shape[0], max(256, 1 << (upto - 1).bit_length()))
            kt = self.key_transform
            m = kt.offsets[layer] * (kt.scales[layer] if kt.scales is not None else 1.0)
            rows = apply_rope(m.expand(size, *m.shape), self._cos32[:size], self._sin32[:size])
            table = self.kv_format.rotate(rows).to(torch.bfloat16).contiguous()
            self._key_tables[layer] = table
        return table

    def weight_bytes(self) -> int:
        """Bytes a decode step must read: every layer weight plus the LM head."""
        total = weight_nbytes(self.lm_head)
        for lw in self.layers:
            for t in vars(lw).values():
                if t is not None:
                    total += weight_nbytes(t)
        return total

    def _native_layers(self, batch: AttentionBatch, rows: int) -> list[NativeLayer] | None:
        """Per layer, the projections' weights, kinds and scales (int8; else None) that
        ``layer_op`` runs for this step, or None when the step takes the Python layer: not
        every token decodes, the cache is quantized, keys are being calibrated, or a
        projection has no native form at ``rows`` rows."""
        if (self.layer_op is None or self._layer_native is None or batch.prefills
                or batch.num_decode != rows
                or self.kv_format.quantized or self._key_stats is not None):
            return None
        if rows not in self._native_by_rows:
            per_layer: list[NativeLayer] | None = []
            for lw in self.layers:
                forms = [self._layer_native(w, rows) for w in (lw.qkv, lw.o, lw.gate_up, lw.down)]
                if any(f is None for f in forms):
                    per_layer = None
                    break
                per_layer.append(NativeLayer([f[0] for f in forms], [f[1] for f in forms],  # type: ignore[index]
                                             [f[2] if len(f) == 3 else None for f in forms]))  # type: ignore[arg-type, index]
            self._native_by_rows[rows] = per_layer
        return self._native_by_rows[rows]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
        sample_rows: torch.Tensor,
        block_size: int,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run all tokens of a step; return fp32 logits for ``sample_rows`` only.

        ``kv_cache``: [layers, 2, slots, kv_heads, row], written in place (``row``:
        ``self.kv_format.row_elems``). ``after_layer(k)``: layers ``[0, k)`` of this
        step's KV are in the cache (called after each layer's attention wrote it; a
        step whose layers run natively calls it not at all).
        """
        s, ops, eps, linear = self.shape, self.ops, self.shape.rms_eps, self.linear
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        heads = s.num_heads + s.num_kv_heads
        cos, sin = self.cos[positions], self.sin[positions]
        keyed = self.key_transform is not None and self.kv_format.quantized
        upto = int(positions.max()) + 1 if keyed and positions.numel() else 0
        x = F.embedding(input_ids, self.embed)  # the residual stream, updated in place
        n = x.shape[0]
        mlp_out: torch.Tensor | None = None
        native = self._native_layers(batch, n) if n else None
        if native is not None:  # one native call per layer, the same ops as below
            for i, (lw, nl) in enumerate(zip(self.layers, native, strict=True)):
                mlp_out = self.layer_op(  # type: ignore[misc]
                    x, mlp_out, lw.input_norm, lw.post_norm, lw.q_norm, lw.k_norm, eps,
                    nl.weights, nl.kinds, lw.qkv_bias, lw.o_bias, cos, sin, s.num_heads,
                    s.num_kv_heads, kv_cache[i], block_size, batch.slot_mapping,
                    batch.decode_table, batch.decode_lens, nl.scales)
        else:
            for i, lw in enumerate(self.layers):
                # The previous layer's MLP residual add is fused into this layer's input norm.
                if mlp_out is None:
                    h = ops.rms_norm(x, lw.input_norm, eps)
                else:
                    h = ops.add_rms_norm(x, mlp_out, lw.input_norm, eps)
                qkv = linear(h, lw.qkv, lw.qkv_bias)
                # Queries and keys are adjacent in the fused projection: rotate them together.
                qk = qkv[:, : q_size + kv_size].view(n, heads, s.head_dim)
                v = qkv[:, q_size + kv_size :].view(n, s.num_kv_heads, s.head_dim)
                if lw.q_norm is not None:
                    q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]
                    q.copy_(ops.rms_norm(q, lw.q_norm, eps))
                    k.copy_(ops.rms_norm(k, lw.k_norm, eps))
                if self._key_stats is not None:  # calibrating: pre-RoPE keys
                    key_pre = qk[:, s.num_heads:].float().sum(0)
                q, k = ops.rope_(qk, cos, sin).split([s.num_heads, s.num_kv_heads], dim=1)
                if self._key_stats is not None:
                    q2 = q.float().pow(2).view(n, s.num_kv_heads, -1, s.head_dim).mean(2)
                    self._key_stats.append([key_pre, k.float().pow(2).sum(0), q2.sum(0)])
                attn = paged_attention(q, k, v, kv_cache[i], batch, block_size, self.decode_op,
                                       self.kv_format,
                                       self._step_keys(i, positions, upto) if keyed else None,
                                       self.write_decode_op)
                if after_layer is not None:
                    after_layer(i + 1)
                h = ops.add_rms_norm(x, linear(attn, lw.o, lw.o_bias), lw.post_norm, eps)
                mlp_out = linear(ops.silu_mul(linear(h, lw.gate_up, None)), lw.down, None)
        x.add_(mlp_out)
        h = ops.rms_norm(x[sample_rows], self.final_norm, eps)
        return linear(h, self.lm_head, None).float()
