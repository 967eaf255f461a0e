"""How one token's key or value of one KV head is stored in the paged cache.

``--kv-cache-dtype`` picks a :class:`KVFormat`:

``auto``
    the model's dtype (float32 / bfloat16), ``head_dim`` elements per row.
``fp8_e4m3`` / ``fp8_e5m2``
    ``head_dim`` FP8 values (``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` bit
    patterns) then **one scale byte**: the row's scale is ``2 ** (byte - 127)`` (an E8M0
    exponent, as in the OCP MX formats), the smallest power of two that maps the row's
    absolute maximum inside the format's range (448 / 57344).
``nvfp4``
    NVIDIA's NVFP4: ``head_dim / 2`` bytes of packed E2M1 values (element ``2i`` in the
    low nibble, ``2i+1`` in the high one; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 and a
    sign bit), then ``head_dim / 16`` bytes of FP8 E4M3 scales, one per 16 values
    (near ``amax / 6``: the E4M3 value that reconstructs the group best), times a
    per-tensor FP32 scale,
    :data:`NVFP4_TENSOR_SCALE`.

Every quantized row is ``row_bytes`` contiguous ``uint8``: values then scales, so a
cache block (``block_size`` rows of every KV head, in each layer's K and V plane) is one
contiguous run of bytes holding its values *and* scales. That run is what a transfer
moves, so a quantized block crosses the wire as it is stored, scales included.

Why these scales: the cache is written one token at a time (decode appends a row per
step), and a row's bytes must never change once written (they are hashed into the prefix
cache, shared and shipped). A per-block scale would have to be known before the block's
later tokens exist, or earlier rows requantized when a larger one arrives (error piled on
error, bytes that change under a transfer). A per-token, per-head scale (FP8) and NVFP4's
per-16-value scales depend only on the row being written, so the prefill worker, the
decode worker and an offline engine write the same bytes for the same K/V. A power of
two costs one byte (1.6% of a 64-dim FP8 row) and scales exactly.

The per-tensor NVFP4 scale is 1.0 for every layer: it exists to move E4M3's scale range
(2**-9 .. 448, x6 for the values) over a tensor's actual magnitudes, and the KV of the
models here already sits inside it (SmolLM2-135M, measured: per-16 absolute maxima from
0.02 to 21). A calibrated per-layer scale would change nothing for them; a model whose
KV outgrows 2688 would clip (stated, not handled).

**Rotation.** A quantized row stores ``x @ H`` rather than ``x``, where ``H`` is the
normalized Walsh-Hadamard matrix of the head (block-diagonal over the largest power-of-two
blocks dividing ``head_dim``; orthogonal and symmetric). Attention is unchanged by it:
queries are rotated the same way (``(qH).(kH) = q.k``) and the output of the values is
rotated back (``sum p (vH) = (sum p v) H``). What it buys: K and V carry a few outlier
channels (RoPE's slow dimensions, attention sinks), and a shared scale spends the
format's range on them; the rotation spreads each row's energy over all channels, so
NVFP4's 16-value groups and FP8's per-row scale quantize evenly sized values (the idea
of QuaRot and SpinQuant, applied to the cache only). ``pdserve eval-kv`` measures it.

**Key transform.** Keys are what a quantized cache lost most on: before this transform,
``pdserve eval-kv --ablate`` measured keys-only quantization at +0.80% (FP8 E4M3) and
+3.12% (NVFP4) perplexity on SmolLM2, values-only at +0.13% and +0.12% (a key's error
moves every score it takes part in; this small model's attention is sharp). Two
calibrated changes, both exact for attention, put the format's precision where the
scores need it (:class:`KeyTransform`; per layer, KV head and channel; from one prefill
of a fixed calibration text, :data:`CALIBRATION_TEXT`, when the engine starts):

- **Offset, before RoPE, added back.** Keys carry a large component shared by every
  token, and it lives *before* RoPE: ``k_p = R_p (m + d_p)`` with ``m`` the layer's mean
  pre-RoPE key and ``R_p`` position ``p``'s rotation. A row stores the quantized
  ``k_p - R_p m`` (what tells keys apart), and attention adds ``R_p m`` back to every key
  it reads, by position (the torch path and the native kernel's ``key_add``), so the
  offset itself is exact. A fixed post-RoPE ``m`` would cancel in softmax without an
  add-back, but RoPE spins most of the shared component around with the position, so
  it removes little of it (SmolLM2, bfloat16, KL: post-RoPE offset 0.0063, pre-RoPE
  with add-back 0.0054, none 0.0073 for FP8 E4M3).
- **Per-channel scales** ``s`` (powers of two): keys are stored as ``k * s`` and queries
  divided by ``s``, so ``(q / s).(k * s) = q.k``. Quantization error is spread evenly
  over a row's channels (the rotation above), but a score weighs channel ``i`` by
  ``q_i``: ``s_i = sqrt(rms(q_i) / rms(k_i))`` (a power of two, so exact) minimises the
  score error for a fixed error budget per row (Cauchy-Schwarz; SmoothQuant's
  ``alpha = 0.5``, applied between queries and keys).

Every token of a sequence must be stored under one transform, so workers that exchange
KV must hold the same: its 16-bit digest (:meth:`KeyTransform.digest`) travels in the
transfer header and seeds the block hashes, and a decode worker refuses KV written under
another. Values keep no transform: a value offset (exact too, added to the output, since
softmax weights sum to 1) and per-channel value scales weighted by the output
projection's columns both measured no better (SmolLM2: KL up for FP8 and NVFP4).

Attention always reads K/V *as stored*: a quantized format writes the row, then the
step's own attention uses the dequantized row too (:meth:`KVFormat.round_trip`), so a
prompt's logits already carry the quantization error and prefill with or without a
cached prefix computes the same thing. Pure torch (runs on any device, CUDA included,
where torch's float8 casts are native); the CPU's native decode kernel reads the same
bytes (``workers/engine/kernels``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import torch

from common.kv_cache_dtype import FORMAT_CODES, KV_CACHE_DTYPES, check_kv_cache_dtype

__all__ = ["FORMAT_CODES", "KV_CACHE_DTYPES", "NVFP4_TENSOR_SCALE", "KVFormat", "KeyTransform"]

NVFP4_TENSOR_SCALE = 1.0
CALIBRATION_TOKENS = 512
CALIBRATION_TEXT = (
    "The river that runs through the old town was once the only road to the sea. Boats "
    "carried salt, timber and wool downstream, and came back with oil, spices and news. "
    "When the railway arrived, the quays emptied within a generation; the warehouses "
    "became schools, a library and, later, a museum of the river itself. Visitors today "
    "walk along the towpath, read the plaques, and argue about which bridge is oldest.\n\n"
    "Q: How do I reverse a list in Python without changing the original?\n"
    "A: Use slicing, which returns a new list: `items[::-1]`. For a lazy iterator, "
    "`reversed(items)` avoids the copy. Sorting in descending order is different: "
    "`sorted(items, reverse=True)`.\n\n"
    "def moving_average(values, window):\n"
    "    total = sum(values[:window])\n"
    "    out = [total / window]\n"
    "    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n"
    "        out.append(total / window)\n"
    "    return out\n\n"
    "Dear team, the meeting on Thursday moves to 3 pm because the projector in room 4 is "
    "broken. Please bring the quarterly figures, the draft budget and any questions about "
    "the new travel policy. Lunch will be served afterwards; tell Maria about allergies.\n\n"
    "1. Preheat the oven to 200 degrees. 2. Mix flour, butter and a pinch of salt until "
    "the dough looks like sand. 3. Add cold water, one spoon at a time. 4. Rest it for "
    "thirty minutes before rolling it out.\n\n"
    "In 1905, a patent clerk published four papers that changed physics: on the "
    "photoelectric effect, Brownian motion, special relativity and the equivalence of "
    "mass and energy. Each answered a question that experiments had left open, and each "
    "was met at first with doubt. Science moves this way: a careful measurement, a bold "
    "idea, and years of checking.")
"""Calibration input for the key transform (see the module doc): prose, a question, code,
a letter, a recipe, history. Changing it changes the transform, which its digest then
tells apart."""
NVFP4_GROUP = 16
_FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}
_E8M0_BIAS = 127
_E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@cache
def _e2m1_table(device: torch.device) -> torch.Tensor:
    """The 16 code values: codes 0-7 positive, 8-15 the same magnitudes negated."""
    pos = torch.tensor(_E2M1_LEVELS, dtype=torch.float32)
    return torch.cat([pos, -pos]).to(device)


@cache
def _e2m1_bounds(device: torch.device) -> torch.Tensor:
    """Midpoints between consecutive magnitudes: nearest level by bucketize."""
    lv = _E2M1_LEVELS
    return torch.tensor([(a + b) / 2 for a, b in zip(lv, lv[1:], strict=False)],
                        dtype=torch.float32).to(device)


@dataclass(frozen=True)
class KeyTransform:
    """A model's calibrated key transform (module doc): per layer, ``scales`` (powers of
    two ``[kv_heads, head_dim]``: keys multiplied, queries divided) and ``offsets`` (the
    mean pre-RoPE key ``[kv_heads, head_dim]``, rounded to bfloat16, stored keys minus it
    rotated to their position, added back on read), float32. Either may be None: that
    part off (``pdserve eval-kv --ablate``)."""

    scales: tuple[torch.Tensor, ...] | None
    offsets: tuple[torch.Tensor, ...] | None

    @classmethod
    def calibrated(cls, key_pre_sum: list[torch.Tensor], key_sq_sum: list[torch.Tensor],
                   query_sq_sum: list[torch.Tensor], tokens: int) -> KeyTransform:
        """From one prefill's per-layer sums over ``tokens`` tokens, each ``[kv_heads,
        head_dim]``: pre-RoPE keys, squared post-RoPE keys, and squared post-RoPE queries
        (averaged over each KV head's group of query heads) -> the transform (module
        doc)."""
        if tokens < 1:
            raise ValueError("key calibration needs at least one token")
        offsets = tuple((k / tokens).to(torch.bfloat16).float() for k in key_pre_sum)
        scales = []
        for k2, q2 in zip(key_sq_sum, query_sq_sum, strict=True):
            # rms(q) / rms(k) per channel; a channel either side never used keeps 1
            ratio = torch.where((k2 > 0) & (q2 > 0), q2 / k2.clamp(min=1e-30), 1.0).sqrt()
            scales.append(torch.exp2(torch.round(0.5 * torch.log2(ratio))).float())
        return cls(tuple(scales), offsets)

    def without(self, scales: bool = False, offsets: bool = False) -> KeyTransform | None:
        """This transform with the named parts off (None when nothing is left)."""
        kept = KeyTransform(None if scales else self.scales, None if offsets else self.offsets)
        return kept if kept.scales is not None or kept.offsets is not None else None

    def digest(self) -> int:
        """16 bits naming the transform (never 0); what two workers compare."""
        import hashlib

        h = hashlib.blake2b(digest_size=2, person=b"pdserve.keys.v2")
        for part in (self.scales, self.offsets):
            h.update(b"-" if part is None else b"+")
            for t in part or ():
                h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return int.from_bytes(h.digest(), "little") or 1


@cache
def _hadamard(dim: int, device: torch.device) -> torch.Tensor:
    """The orthonormal, symmetric Walsh-Hadamard rotation of a ``dim``-vector: one
    Sylvester block when ``dim`` is a power of two, else blocks of its largest
    power-of-two divisor along the diagonal."""
    block = dim & -dim
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h / block**0.5] * (dim // block)).to(device)


@dataclass(frozen=True)
class KVFormat:
    """One cache row's encoding: ``name`` (see module doc), the head's ``head_dim`` and
    the model's ``model_dtype`` (the dtype attention computes in; ``auto`` stores it)."""

    name: str
    head_dim: int
    model_dtype: torch.dtype
    native_encode: Callable[[torch.Tensor, int], torch.Tensor] | None = field(
        default=None, compare=False, repr=False)
    """``(x, code) -> rows``, byte for byte :meth:`quantize` on CPU tensors, ~7x (FP8)
    to ~30x (NVFP4) faster: the engine's native kernel (``kernels.quantize_kv_rows``),
    handed in by the engine when it is built; None: torch ops."""

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.name)
        if self.name == "nvfp4" and self.head_dim % NVFP4_GROUP:
            raise ValueError(f"kv_cache_dtype nvfp4 needs head_dim divisible by "
                             f"{NVFP4_GROUP} (one scale per 16 values); this model's is "
                             f"{self.head_dim}: use fp8_e4m3")

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    @property
    def code(self) -> int:
        return FORMAT_CODES[self.name]

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache tensor's dtype: the model's, or ``uint8`` rows of bytes."""
        return torch.uint8 if self.quantized else self.model_dtype

    @property
    def row_elems(self) -> int:
        """The cache tensor's last dimension."""
        if self.name == "auto":
            return self.head_dim
        if self.name == "nvfp4":
            return self.head_dim // 2 + self.head_dim // NVFP4_GROUP
        return self.head_dim + 1

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) of one KV head, scales included."""
        return self.row_elems * torch.empty(0, dtype=self.storage_dtype).element_size()

    def describe(self) -> str:
        """What an error or log line names: e.g. ``fp8_e4m3 (65 B/row)``."""
        name = f"auto={str(self.model_dtype).removeprefix('torch.')}" if not self.quantized \
            else self.name
        return f"{name} ({self.row_bytes} B per {self.head_dim}-dim row)"

    # -- encode / decode -------------------------------------------------------------------

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., head_dim]`` -> rows ``[..., row_elems]`` of ``storage_dtype``."""
        if not self.quantized:
            return x.to(self.model_dtype)
        if self.native_encode is not None and x.device.type == "cpu":
            return self.native_encode(x, self.code)
        if self.name == "nvfp4":
            return _nvfp4_encode(x)
        return _fp8_encode(x, *_FP8[self.name])

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``[..., row_elems]`` -> values ``[..., head_dim]`` in ``dtype`` (default:
        the model's). Exact in bfloat16 and float32: FP8 values times a power of two and
        E2M1 times E4M3 both fit 8 mantissa bits."""
        dtype = dtype or self.model_dtype
        if not self.quantized:
            return rows.to(dtype)
        if self.name == "nvfp4":
            return _nvfp4_decode(rows, self.head_dim).to(dtype)
        return _fp8_decode(rows, self.head_dim, _FP8[self.name][0]).to(dtype)

    def round_trip(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows to store, the values attention reads back from them), both in the
        rotated basis for a quantized format (see :meth:`rotate`)."""
        if not self.quantized:
            rows = self.quantize(x)
            return rows, rows
        rows = self.quantize(self.rotate(x))
        return rows, self.dequantize(rows, x.dtype)

    def round_trip_kv(self, k: torch.Tensor, v: torch.Tensor, read: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                 torch.Tensor | None]:
        """:meth:`round_trip` of a step's keys and values: (k rows, k read, v rows, v
        read); the reads are None unless ``read`` (a decode-only step reads its new
        rows from the cache). One call for both, so a variant (``pdserve eval-kv
        --ablate``) can treat them apart."""
        if read:
            return (*self.round_trip(k), *self.round_trip(v))
        return self.quantize(self.rotate(k)), None, self.quantize(self.rotate(v)), None

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ H`` over the last axis (in fp32, back in ``x``'s dtype): into the basis
        quantized rows are stored in, and out of it again (``H @ H`` is the identity)."""
        if not self.quantized:
            return x
        h = _hadamard(self.head_dim, x.device)
        return (x.float() @ h).to(x.dtype)


def _fp8_encode(x: torch.Tensor, fp8: torch.dtype, fmax: float) -> torch.Tensor:
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # frexp: amax/fmax = m * 2**e, m in [0.5, 1) -> 2**e is the smallest power of two
    # with amax / 2**e <= fmax (exact, unlike ceil(log2(.))); amax 0 gives e 0.
    _, e = torch.frexp(amax / fmax)
    e = e.clamp(-_E8M0_BIAS, _E8M0_BIAS)
    values = (xf * torch.exp2(-e.float())).clamp(-fmax, fmax).to(fp8).view(torch.uint8)
    return torch.cat([values, (e + _E8M0_BIAS).to(torch.uint8)], dim=-1)


def _fp8_decode(rows: torch.Tensor, head_dim: int, fp8: torch.dtype) -> torch.Tensor:
    values = rows[..., :head_dim].contiguous().view(fp8).float()
    scale = torch.exp2(rows[..., head_dim:head_dim + 1].float() - _E8M0_BIAS)
    return values * scale


def _e2m1_codes(g: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 codes of ``g / s`` (``s`` 0: zeros), clipped to +-6."""
    y = torch.where(s > 0, g / torch.where(s > 0, s, 1.0), 0.0).clamp(-6.0, 6.0)
    mag = torch.bucketize(y.abs(), _e2m1_bounds(y.device))  # 0..7, ties to the lower
    return mag | ((y < 0) & (mag > 0)).to(mag.dtype) << 3


def _nvfp4_encode(x: torch.Tensor) -> torch.Tensor:
    """Each 16-value group takes, of the E4M3 scale nearest ``amax / 6`` and its two
    E4M3 neighbours, the one whose codes reconstruct the group with the least squared
    error (rounding the scale to 3 mantissa bits either clips the group's maximum or
    coarsens every step; measured on SmolLM2's KV: ~10% less error than the nearest)."""
    *lead, dim = x.shape
    g = x.float().reshape(*lead, dim // NVFP4_GROUP, NVFP4_GROUP)
    amax = g.abs().amax(-1, keepdim=True)
    nearest = (amax / (6.0 * NVFP4_TENSOR_SCALE)).clamp(max=448.0).to(torch.float8_e4m3fn)
    bits = nearest.view(torch.uint8).to(torch.int16)
    # positive E4M3 bit patterns are ordered like their values; 0x7E is 448, 0x7F NaN
    cand = torch.cat([bits, (bits - 1).clamp(min=0), (bits + 1).clamp(max=0x7E)], -1)
    cand_s = (cand.to(torch.uint8).view(torch.float8_e4m3fn).float()
              * NVFP4_TENSOR_SCALE).unsqueeze(-1)  # [..., groups, 3, 1]
    codes = _e2m1_codes(g.unsqueeze(-2), cand_s)  # [..., groups, 3, 16], all at once
    err = ((_e2m1_table(g.device)[codes] * cand_s - g.unsqueeze(-2)) ** 2).sum(-1)
    best = err.argmin(-1, keepdim=True)  # ties: the first, i.e. the nearest scale
    scale = cand.gather(-1, best).to(torch.uint8)
    codes = codes.gather(-2, best.unsqueeze(-1).expand(*best.shape, NVFP4_GROUP))
    codes = codes.to(torch.uint8).reshape(*lead, dim // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return torch.cat([packed, scale.reshape(*lead, dim // NVFP4_GROUP)], -1)


def _nvfp4_decode(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    *lead, _ = rows.shape
    packed = rows[..., :head_dim // 2].long()
    table = _e2m1_table(rows.device)
    values = torch.stack([table[packed & 15], table[packed >> 4]], -1).reshape(
        *lead, head_dim // NVFP4_GROUP, NVFP4_GROUP)
    scales = rows[..., head_dim // 2:].contiguous().view(torch.float8_e4m3fn).float()
    return (values * (scales * NVFP4_TENSOR_SCALE).unsqueeze(-1)).reshape(*lead, head_dim)
