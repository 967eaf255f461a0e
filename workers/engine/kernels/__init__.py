"""Native CPU kernels, compiled for the machine that runs them on first use.

:func:`paged_decode_attention` is fused decode attention over the paged KV cache
(``paged_attention.cpp``): one query token per sequence, K/V read straight from the
cache blocks named by each sequence's block table, no gather copy.

:func:`rms_norm`, :func:`add_rms_norm`, :func:`rope_` and :func:`silu_mul`
(``fused_ops.cpp``) fuse the decoder layer's elementwise chains into one pass each and
reproduce the torch expressions in ``workers/models/decoder.py`` bit for bit (float32
and bfloat16): same roundings, same order of the RMSNorm sum as torch's reduction
kernel, same exp as torch's silu.

:func:`quantize_kv_rows` (``kv_encode.cpp``) is the quantized KV cache's write path,
``KVFormat.quantize`` in one pass per row, byte for byte.

:func:`int8_linear` (``int8_linear.cpp``) is the weight-only int8 linear layer: a
dequantize-in-register GEMV for decode-sized batches (AVX-512 or AVX2), a blockwise
dequantized GEMM for prefill-sized ones.

:func:`decode_layer` (``decode_layer.cpp``) is a whole decoder layer of a decode step in
one call: the same ops the Python layer makes, in the same order, from C++ (~20 Python
dispatches a layer become one).

All run on torch's intra-op thread pool (``at::parallel_for``), so they honour
``torch.set_num_threads``. All sources build into one library.

The extension is built with ``-O3 -march=native`` into ``cache_dir`` (default
``~/.cache/pdserve/kernels``), in a directory named by a hash of the source, the flags,
the torch version and this CPU's feature flags, so a later process (or another machine
sharing the home directory) only reuses a build that matches. Builds use
``torch.utils.cpp_extension.load`` when ``ninja`` is on ``PATH`` and call the C++
compiler directly otherwise. A file lock serialises concurrent builders across
processes; the loser waits and then loads the winner's library.

Nothing here raises on a missing compiler: :func:`load` returns ``None`` and logs why
once, and :func:`available` is ``False``, so callers fall back to the torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from common.timing import crossover, least_seconds

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(n)
                for n in ("paged_attention.cpp", "fused_ops.cpp", "kv_encode.cpp",
                          "int8_linear.cpp", "decode_layer.cpp"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("pds_common.h", "pds_onednn.h"))
"""Included by the sources, so part of the cache key (never compiled on their own)."""
DEFAULT_CACHE_DIR = Path("~/.cache/pdserve/kernels")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17")
# -fopenmp compiles at::parallel_for's OpenMP region inline; -lgomp resolves to the
# libgomp torch already loaded (same soname), so the kernel shares torch's pool.
LDFLAGS = ("-fopenmp",)
_OP_NAMESPACE = "pdserve_kernels"
# Vectorized<float> widths of the torch kernels the fused ops reproduce: torch's sum
# kernel has no AVX-512 variant (8 lanes on AVX2 and AVX-512 machines, and on NEON);
# its silu kernel does (16 lanes under the AVX512 capability).
SUM_LANES = 8
SILU_LANES = 16 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 8


@dataclass(frozen=True)
class BuildInfo:
    library: Path
    compiled: bool  # False: an existing build was loaded
    seconds: float  # compile + load (compiled) or load only
    builder: str  # "ninja" or "c++" (compiled here), "other process" (waited), "cached"


_lock = threading.Lock()
_op: Callable | None = None
_fused: dict[str, Callable] = {}
_info: BuildInfo | None = None
_error: str | None = None


def load(cache_dir: str | os.PathLike[str] | None = None) -> Callable | None:
    """The compiled ``paged_decode_attention`` op, building the library if needed (the
    fused ops below load with it); None if unusable.

    The first call in a process decides: later calls return the same op (or None)
    whatever ``cache_dir`` they pass.
    """
    global _op, _info, _error
    if _op is not None or _error is not None:
        return _op
    with _lock:
        if _op is not None or _error is not None:
            return _op
        try:
            _info = _build_and_load(Path(cache_dir or DEFAULT_CACHE_DIR).expanduser())
            ns = getattr(torch.ops, _OP_NAMESPACE)
            _fused.update(
                (name, getattr(ns, name).default)
                for name in ("rms_norm", "add_rms_norm", "rope_", "silu_mul",
                             "quantize_kv_rows", "int8_linear", "int8_dequantize",
                             "int8_best_isa", "paged_attention_best_isa",
                             "paged_attention_row_walk", "f32_gemv",
                             "gemv_pack", "f32_gemv_packed", "paged_write_decode_attention",
                             "decode_layer", "argmax_rows")
            )
            _op = ns.paged_decode_attention
            log.info(
                "native kernels %s in %.2fs (%s)",
                "compiled" if _info.compiled else "loaded",
                _info.seconds,
                _info.library,
            )
        except Exception as e:  # noqa: BLE001 - any failure means "use the torch path"
            _error = f"{type(e).__name__}: {e}".strip()[-4000:]  # compiler output can be long
            log.warning("native kernels unavailable, using the torch path: %s", _error)
    return _op


def available(cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """Whether the kernel is (or can now be built and) loaded in this process."""
    return load(cache_dir) is not None


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None if it succeeded or was never called)."""
    return _error


def build_info() -> BuildInfo | None:
    """How this process got the kernel: library path, compiled or cached, seconds."""
    return _info


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    kv_format: int = 0,
    key_add: torch.Tensor | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged context.

    q: ``[num_seqs, num_heads, head_dim]``; k_cache, v_cache: ``[num_blocks, block_size,
    kv_heads, head_dim]`` (rows contiguous; e.g. ``cache[0].view(-1, block_size, kv,
    dim)``); block_tables: int32/int64 ``[num_seqs, max_blocks]``; context_lens:
    int32/int64 ``[num_seqs]`` (tokens attended to, the new one included; 0 gives zeros).
    Query head ``h`` reads kv head ``h // (num_heads // kv_heads)``. scale defaults to
    ``head_dim ** -0.5``. Returns ``[num_seqs, num_heads, head_dim]`` in q's dtype
    (float32, bfloat16 or float16; accumulation in float32).

    kv_format: the cache's ``KVFormat.code`` (``workers/models/kv_format.py``). 0
    (``auto``): the caches have q's dtype and ``head_dim`` per row. 1 ``fp8_e4m3``, 2
    ``fp8_e5m2``, 3 ``nvfp4``: the caches are ``uint8`` ``[num_blocks, block_size,
    kv_heads, row_elems]`` rows as ``KVFormat.quantize`` writes them (``row_elems`` =
    ``head_dim + 1`` for FP8, ``head_dim / 2 + head_dim / 16`` for nvfp4, whose head_dim
    must be a multiple of 16), e.g. ``cache[0].view(-1, block_size, kv, fmt.row_elems)``.
    Each block's rows are decoded to float32 as they are read (nothing else is copied),
    so the output equals the kv_format 0 kernel on ``fmt.dequantize(cache, float32)``
    with q in float32, rounded to q's dtype.

    key_add (quantized formats only): bfloat16 ``[positions, kv_heads, head_dim]``,
    contiguous, at least as many positions as the longest context; row ``p`` is added
    to the decoded key of the token at position ``p`` (its index in the block table's
    order) before the dot products: the add-back of a calibrated key offset
    (:class:`workers.models.kv_format.KeyTransform`).

    isa: ``avx512``, ``avx2`` or ``scalar`` (the portable loops) forces a code path
    (tests, benchmarks); None: the best this build has (:func:`paged_attention_isa`).
    The AVX2 path takes head_dims that are multiples of 8; others run the portable one.

    Raises RuntimeError if the kernel is unavailable (check :func:`available` first), and
    for an unknown kv_format, a non-uint8 quantized cache or a row size that does not
    match q's head_dim.
    """
    op = load()
    if op is None:
        raise RuntimeError(f"paged decode kernel unavailable: {_error}")
    return op(q, k_cache, v_cache, block_tables, context_lens, _scale(q, scale), int(kv_format),
              key_add, _isa_code(isa))


def paged_write_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """Write a step's K/V into the cache, then decode attention for its first rows.

    k, v: ``[tokens, kv_heads, head_dim]`` (rows contiguous), written at
    ``slot_mapping`` (int32/int64 ``[tokens]``, slot ``block * block_size + offset``) into
    ``k_cache`` / ``v_cache`` (``[num_blocks, block_size, kv_heads, head_dim]`` of q's
    dtype: unquantized caches only), as ``index_copy_`` would; then the first
    ``block_tables.shape[0]`` rows of q (the step's decode tokens) attend as in
    :func:`paged_decode_attention`. Returns a new contiguous ``[tokens, num_heads,
    head_dim]`` whose other rows are uninitialised (the caller's prefill rows). Every
    input (slots, block tables, lengths, shapes, isa) is checked before any row is
    written: RuntimeError on bad input, the cache untouched.
    """
    op = _fused_op("paged_write_decode_attention")
    return op(q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens,
              _scale(q, scale), _isa_code(isa))


INT8_GEMV_ROWS = 16
"""Rows of x up to which :func:`int8_linear` runs its GEMV by default; more: the
dequantized GEMM. A model runner measures its own (:func:`time_int8_gemv_rows`) and
passes it to both :func:`int8_linear` and :func:`decode_layer`."""


def decode_layer(x: torch.Tensor, mlp_out: torch.Tensor | None, input_norm: torch.Tensor,
                 post_norm: torch.Tensor, q_norm: torch.Tensor | None,
                 k_norm: torch.Tensor | None, eps: float, weights: list[torch.Tensor],
                 kinds: list[int], qkv_bias: torch.Tensor | None, o_bias: torch.Tensor | None,
                 cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                 cache: torch.Tensor, block_size: int, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                 scales: list[torch.Tensor | None] | None = None,
                 int8_gemv_rows: int = INT8_GEMV_ROWS) -> torch.Tensor:
    """One decoder layer of a step whose every token decodes, in one native call: bit for
    bit ``workers.models.decoder.DecoderModel``'s Python layer (its norms, projections,
    RoPE, K/V writes and paged attention, in the same order; see ``decode_layer.cpp``).

    x: the residual stream ``[tokens, hidden]``, updated in place (``+= mlp_out``, the
    previous layer's MLP output or None, then ``+=`` the attention's projection); weights:
    qkv, o, gate_up, down as ``kinds`` says (:func:`gemv_form`, or -1 oneDNN's reordered
    weight, -2 ``F.linear``'s plain one, -3 int8 values for :func:`int8_linear`, their
    scales in ``scales``: one entry per projection, None for float ones; None: all
    float; up to ``int8_gemv_rows`` rows of x by the GEMV, as the model's
    :func:`int8_linear` runs them); cache: the layer's ``[2, slots, kv_heads,
    head_dim]`` (unquantized). Returns the layer's MLP output.
    """
    return _fused_op("decode_layer")(
        x, mlp_out, input_norm, post_norm, q_norm, k_norm, float(eps), weights, kinds,
        qkv_bias, o_bias, cos, sin, num_heads, num_kv_heads, cache, block_size, slot_mapping,
        block_tables, context_lens, SUM_LANES, SILU_LANES, scales or [None] * 4,
        int(int8_gemv_rows))


def gemv_form(w: torch.Tensor | GemvTiles) -> tuple[torch.Tensor, int]:
    """A GEMV weight as :func:`decode_layer` takes it: ``(tensor, kind)``, kind the tiles'
    row count, or 0 for a row-major ``[N, K]``."""
    return (w.data, w.n) if isinstance(w, GemvTiles) else (w, 0)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    """The attention scale: ``scale``, or 1/sqrt(head_dim) when None."""
    return float(q.shape[-1] ** -0.5 if scale is None else scale)


def _isa_code(isa: str | None) -> int:
    """An op's ``isa`` argument: the code of a path by name (:data:`ISAS`); -1 (None): the
    best this build has."""
    return -1 if isa is None else ISAS[isa]


def _fused_op(name: str) -> Callable:
    if load() is None:
        raise RuntimeError(f"native kernels unavailable: {_error}")
    return _fused[name]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``decoder.rms_norm`` (transformers' LlamaRMSNorm) in one pass, bit for bit.

    x: float32 or bfloat16 ``[..., D]`` (last dim contiguous; any strides elsewhere, e.g.
    a q or k view of the fused QKV output); weight: ``[D]`` in x's dtype. Statistics in
    float32; for bfloat16 the normalised row is rounded to bfloat16 before the weight
    multiply, as transformers does. Returns a new contiguous tensor of x's shape.
    """
    return _fused_op("rms_norm")(x, weight, float(eps), SUM_LANES)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x += residual`` in place (rounded to x's dtype), then :func:`rms_norm` of it.

    Equal bit for bit to ``x = x + residual; h = decoder.rms_norm(x, weight, eps)``;
    returns ``h``. residual: x's shape and dtype, last dim contiguous.
    """
    return _fused_op("add_rms_norm")(x, residual, weight, float(eps), SUM_LANES)


def rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``decoder.apply_rope`` in place: ``qk = qk * cos + rotate_half(qk) * sin``.

    qk: ``[tokens, heads, head_dim]``, float32 or bfloat16, last dim contiguous (may be
    a view of the fused QKV output); cos/sin: ``[tokens, 1, head_dim]`` or ``[tokens,
    head_dim]`` in qk's dtype, halves duplicated. Each product and the sum are rounded
    to the dtype as torch does, so the result is bit-exact. Returns qk.
    """
    _fused_op("rope_")(qk, cos, sin)
    return qk


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``gate, up = gate_up.chunk(2, dim=-1)``, bit for bit.

    gate_up: float32 or bfloat16 ``[..., 2 * I]``, last dim contiguous. Returns a new
    contiguous ``[..., I]`` tensor.
    """
    return _fused_op("silu_mul")(gate_up, SILU_LANES)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of float32 ``[rows, n]`` (last dim contiguous), int64
    ``[rows]``: the same indices (the first largest; a NaN counts as the largest), read
    in AVX-512 or AVX2 lanes, rows spread over the threads. torch's own reduction reads
    a row of a 49,152-token vocabulary at a few GB/s, ~3% of a batch-256 decode step
    (the greedy sampler's)."""
    return _fused_op("argmax_rows")(x)


def quantize_kv_rows(x: torch.Tensor, kv_format: int) -> torch.Tensor:
    """``KVFormat(name, x.shape[-1], x.dtype).quantize(x)`` for a quantized format, byte
    for byte (``workers/models/kv_format.py``), in one native pass per row.

    x: float32, bfloat16 or float16 ``[..., head_dim]`` (made contiguous if it is not);
    kv_format: the format's code, 1 ``fp8_e4m3``, 2 ``fp8_e5m2``, 3 ``nvfp4`` (head_dim
    a multiple of 16). Returns uint8 ``[..., row_elems]``. Raises RuntimeError if the
    kernels are unavailable, for another code or an nvfp4 head_dim not divisible by 16.
    """
    return _fused_op("quantize_kv_rows")(x, int(kv_format))


ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}
"""The native kernels' code paths, by name (the ``isa`` of :func:`int8_linear` and
:func:`paged_decode_attention`)."""


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None, max_gemv_rows: int = INT8_GEMV_ROWS,
                isa: str | None = None) -> torch.Tensor:
    """``x @ (q * scale[:, None]).T + bias`` with the weight read as int8.

    x: float32 or bfloat16 ``[..., K]``; q: contiguous int8 ``[N, K]`` (or in tiles,
    :func:`int8_tiles`); scale: float32 ``[N]``; bias: ``[N]`` (float32 or x's dtype) or
    None. Returns ``[..., N]`` in x's dtype. Up to ``max_gemv_rows`` rows of x: the GEMV,
    each output ``(sum_k x * q) * scale + bias`` in float32, rounded once; more rows: the
    weight dequantized to x's dtype in blocks and torch's GEMM (see ``int8_linear.cpp``).
    ``isa``: ``avx512``, ``avx2`` or ``scalar`` forces the GEMV's code path (tests); None:
    the best this build has (:func:`int8_isa`). Raises RuntimeError for a path the build
    lacks, or if the kernels are unavailable.
    """
    return _fused_op("int8_linear")(x, q, scale, bias, int(max_gemv_rows), _isa_code(isa))


def f32_gemv(x: torch.Tensor, w: torch.Tensor | GemvTiles, bias: torch.Tensor | None = None,
             isa: str | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for x ``[..., K]`` and a weight ``[N, K]`` (contiguous, or
    :class:`GemvTiles`), both float32 or both bfloat16, by the int8 kernel's GEMV (each
    weight row read once for every row of x, float32 accumulators): the decode GEMMs of
    float models (``workers.models.linear.gemv_linear``). Returns x's dtype (bfloat16:
    each output rounded once, as a bf16 GEMM rounds). ``isa`` as for :func:`int8_linear`;
    tiles run the AVX2 tile on either SIMD path, bit for bit the row-major AVX2 path.
    Sums in float32 in another order than a GEMM (~1e-6 relative)."""
    code = _isa_code(isa)
    if isinstance(w, GemvTiles):
        return _fused_op("f32_gemv_packed")(x, w.data, w.n, bias, code)
    return _fused_op("f32_gemv")(x, w, bias, code)


@dataclass(frozen=True)
class GemvTiles:
    """A float32 or bfloat16 weight ``[N, K]`` in :func:`gemv_tiles`' layout: each tile of
    4 rows stored as one sequential stream (``data`` ``[ceil(N/4), K/8, 4, 8]``, the last
    tile padded with zero rows)."""

    data: torch.Tensor
    n: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.data.shape[1] * self.data.shape[3]))

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


PACK_CHUNK = 8
"""Elements per chunk of :class:`GemvTiles` (K must be a multiple of it)."""


def gemv_tiles(w: torch.Tensor) -> GemvTiles:
    """``w`` (float32 or bfloat16 ``[N, K]``, K a multiple of :data:`PACK_CHUNK`) in the
    tile layout (see ``int8_linear.cpp``): a new tensor of ``w``'s size, rounded up to
    whole tiles."""
    return GemvTiles(_fused_op("gemv_pack")(w), w.shape[0])


def gemv_tiles_where_whole(w: torch.Tensor) -> torch.Tensor | GemvTiles:
    """``w`` in :func:`gemv_tiles`' layout where K is whole chunks, else ``w`` itself,
    contiguous: the ``layout`` of a model whose GEMV reads tiles faster
    (:func:`time_gemv_tiles`)."""
    w = w.contiguous()
    return gemv_tiles(w) if w.shape[-1] % PACK_CHUNK == 0 else w


def int8_tiles(q: torch.Tensor) -> torch.Tensor:
    """An int8 weight's values ``[N, K]`` in the GEMV's tiles (``[ceil(N/4), K/8, 4,
    8]``) where K is whole chunks, else as given: the ``layout`` of an int8 model whose
    GEMV reads tiles faster (:func:`time_gemv_tiles`). :func:`int8_linear` and
    :func:`int8_dequantize` take either (N from the scales)."""
    return _fused_op("gemv_pack")(q) if q.shape[-1] % PACK_CHUNK == 0 else q


@dataclass(frozen=True)
class TilesTiming:
    """What :func:`time_gemv_tiles` measured: one decode step's GEMVs (one row of x)
    over the probe's weights, least seconds row-major and in tiles, and the choice."""

    tiles: bool
    row_major_s: float
    tiles_s: float
    weight_bytes: int


TILES_PROBE_BYTES = 256 * 2**20
"""Weight bytes :func:`time_gemv_tiles` reads per pass (at most): more than a CPU's
last-level cache, so the reads come from DRAM as a decode step's do."""


def time_gemv_tiles(shapes: list[tuple[int, int]], dtype: torch.dtype, layers: int,
                    reps: int = 3, margin: float = 0.95,
                    budget: int = TILES_PROBE_BYTES) -> TilesTiming:
    """Whether this CPU's GEMV (float32 or bfloat16: :func:`f32_gemv`; int8:
    :func:`int8_linear`) reads weights faster in tiles than row-major, at this thread
    count: one row of x through weights of ``shapes`` (``(in, out)`` of one layer's
    GEMMs), for up to ``layers`` layers within ``budget`` bytes, each layout ``reps``
    times after a warm-up, alternated; tiles win only under ``margin`` times row-major's
    least time. Takes ~2x ``budget`` of memory while it runs.

    Why measure: on a 2-core AMD EPYC with AVX2 only, tiles ran SmolLM2's fp32 layer
    GEMVs 1.2-1.3x faster; on a 2-core AMD EPYC Zen 4 (AVX-512), 1.3x in fp32, 1.5x in
    bf16 and 2x in int8, where row-major had been kept for every AVX-512 CPU."""
    shapes = [(k, n) for k, n in shapes if k % PACK_CHUNK == 0]
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = sum(k * n for k, n in shapes) * elem
    if not shapes or not per_layer:
        return TilesTiming(False, 0.0, 0.0, 0)
    count = max(1, min(layers, budget // per_layer))
    rows = [torch.ones(n, k, dtype=dtype) for _ in range(count) for k, n in shapes]
    ks, ns = ([s[i] for _ in range(count) for s in shapes] for i in (0, 1))
    if dtype == torch.int8:
        scales = {n: torch.ones(n) for n in ns}

        def run(x: torch.Tensor, q: torch.Tensor, n: int) -> None:
            int8_linear(x, q, scales[n])

        tiled: list = [int8_tiles(q) for q in rows]
        x_dtype = torch.float32
    else:
        def run(x: torch.Tensor, w: torch.Tensor | GemvTiles, n: int) -> None:
            f32_gemv(x, w)

        tiled = [gemv_tiles(w) for w in rows]
        x_dtype = dtype
    xs = {k: torch.ones(1, k, dtype=x_dtype) for k in ks}

    def layout(ws: list) -> Callable[[], None]:
        def once() -> None:
            for w, k, n in zip(ws, ks, ns, strict=True):
                run(xs[k], w, n)
        return once

    best = least_seconds({"row": layout(rows), "tiles": layout(tiled)}, reps)
    return TilesTiming(best["tiles"] < margin * best["row"], best["row"], best["tiles"],
                       per_layer * count)


@dataclass(frozen=True)
class Int8RowsTiming:
    """What :func:`time_int8_gemv_rows` measured: per probed row count, the least
    seconds of one pass of x's rows through the probe's int8 weights by the GEMV and by
    the dequantize-then-GEMM path, and the rows chosen (the GEMV up to ``rows``)."""

    rows: int
    probed: tuple[int, ...]
    gemv_s: tuple[float, ...]
    gemm_s: tuple[float, ...]


INT8_ROWS_PROBE = (8, 16, 32, 64, 128, 256)
"""Rows of x :func:`time_int8_gemv_rows` tries, in order (a decode batch's sizes)."""

INT8_ROWS_PROBE_BYTES = 16 * 2**20
"""int8 weight bytes per pass of :func:`time_int8_gemv_rows` (at most): past 16 rows
both paths do more arithmetic than reading, so a few layers tell the crossover."""


def time_int8_gemv_rows(shapes: list[tuple[int, int]], dtype: torch.dtype, tiles: bool,
                        layers: int, probe: tuple[int, ...] = INT8_ROWS_PROBE,
                        reps: int = 2, margin: float = 1.0,
                        budget: int = INT8_ROWS_PROBE_BYTES) -> Int8RowsTiming:
    """Up to how many rows of x :func:`int8_linear`'s GEMV beats its dequantize-then-GEMM
    path on this CPU, at this thread count: ``probe``'s row counts in order, x of
    ``dtype`` through int8 weights of ``shapes`` (``(in, out)`` of one layer's GEMMs, in
    tiles where ``tiles`` and K is whole chunks, else row-major) for up to ``layers``
    layers within ``budget`` bytes (at least one layer, however large), each path
    ``reps`` times after a warm-up, alternated. The GEMV keeps a row count where it
    takes under ``margin`` times the GEMM path's least time; a loss is timed once more
    (one slow pass on a shared machine must not cut the limit), and a second loss ends
    the probe. ``rows``: the last count it kept, or half the first probed if it lost
    there.

    Why measure: the crossover was 16 rows on a 2-core Intel Xeon (AVX-512, AMX), and
    between 128 and 256 on a 2-core AMD EPYC Zen 4, where the GEMM path at 32 rows took
    1.6-4.3x the GEMV's time (SmolLM2's layer shapes, float32 x, tiles)."""
    elem_shapes = [(k, n) for k, n in shapes if k and n]
    per_layer = sum(k * n for k, n in elem_shapes)
    if not per_layer:
        return Int8RowsTiming(INT8_GEMV_ROWS, (), (), ())
    count = max(1, min(layers, budget // per_layer))
    qs, scales, ks = [], [], []
    for _ in range(count):
        for k, n in elem_shapes:
            q = torch.ones(n, k, dtype=torch.int8)
            qs.append(int8_tiles(q) if tiles else q)
            scales.append(torch.ones(n))
            ks.append(k)
    for k, q, scale in zip(ks, qs, scales, strict=True):  # first calls: the pool wakes up
        for limit in (1, 0):
            int8_linear(torch.ones(1, k, dtype=dtype), q, scale, max_gemv_rows=limit)

    def timed(m: int) -> tuple[float, float]:
        xs = {k: torch.ones(m, k, dtype=dtype) for k in set(ks)}

        def path(limit: int) -> Callable[[], None]:
            def once() -> None:
                for q, scale, k in zip(qs, scales, ks, strict=True):
                    int8_linear(xs[k], q, scale, max_gemv_rows=limit)
            return once

        best = least_seconds({"gemv": path(m), "gemm": path(0)}, reps)
        return best["gemv"], best["gemm"]

    c = crossover(timed, probe, margin)
    rows = c.kept if c.kept is not None else (max(1, probe[0] // 2) if probe else
                                              INT8_GEMV_ROWS)
    return Int8RowsTiming(rows, c.probed, c.first_s, c.second_s)


def int8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(q.float() * scale[:, None]).to(dtype)``, natively (float32 or bfloat16)."""
    return _fused_op("int8_dequantize")(q, scale, dtype)


def paged_attention_isa() -> str:
    """The decode attention's best code path in this build: ``avx512``, ``avx2`` or
    ``scalar``."""
    return _isa_name(_fused_op("paged_attention_best_isa")())


def set_row_walk(on: bool) -> bool:
    """Allows (the default) or forbids the decode attention's row-order walk (one item per
    sequence, cache rows read whole in memory order; see paged_attention.cpp) and returns
    whether it was allowed. Both walks give the same bits: this is for A/B timing and
    for tests that hold them to that. Process-wide."""
    return bool(_fused_op("paged_attention_row_walk")(on))


@contextmanager
def row_walk(on: bool) -> Iterator[None]:
    """``with row_walk(False):`` runs the block with the per-head walk only."""
    before = set_row_walk(on)
    try:
        yield
    finally:
        set_row_walk(before)


def int8_isa() -> str:
    """The int8 GEMV's best code path in this build: ``avx512``, ``avx2`` or ``scalar``."""
    return _isa_name(_fused_op("int8_best_isa")())


def _isa_name(code: int) -> str:
    return next(name for name, c in ISAS.items() if c == code)


def _cache_key() -> str:
    h = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        h.update(source.name.encode())
        h.update(b"\0")
        h.update(source.read_bytes())
    abi = str(torch.compiled_with_cxx11_abi())
    for part in (*CFLAGS, "|", *LDFLAGS, "|", torch.__version__, abi, sys.platform,
                 platform.machine(), _cpu_flags()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _cpu_flags() -> str:
    """This CPU's feature flags: -march=native builds must not move to a lesser CPU."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor()


def _build_and_load(cache_dir: Path) -> BuildInfo:
    name = f"pdserve_paged_attention_{_cache_key()}"
    build_dir = cache_dir / name
    library = build_dir / f"{name}.so"
    stamp = build_dir / "built"
    start = time.perf_counter()
    if not (stamp.exists() and library.exists()):
        from torch.utils.cpp_extension import get_cxx_compiler

        compiler = get_cxx_compiler()
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH)")
        build_dir.mkdir(parents=True, exist_ok=True)
        with _file_lock(cache_dir / f"{name}.lock"):
            # Another process may have built it while we waited for the lock.
            if not (stamp.exists() and library.exists()):
                builder = _compile(name, build_dir, library, compiler)
                stamp.write_text("ok\n")
                return BuildInfo(library, True, time.perf_counter() - start, builder)
            torch.ops.load_library(str(library))
            return BuildInfo(library, False, time.perf_counter() - start, "other process")
    torch.ops.load_library(str(library))
    return BuildInfo(library, False, time.perf_counter() - start, "cached")


def _compile(name: str, build_dir: Path, library: Path, compiler: str) -> str:
    """Build (and load) the library in a private directory, then move it into place.

    Runs under the file lock: any other ``tmp-*`` directory is left by a builder that
    died (its compiler may still be running, hence a fresh directory per build).
    """
    from torch.utils import cpp_extension

    for old in build_dir.glob("tmp-*"):
        shutil.rmtree(old, ignore_errors=True)
    work = build_dir / f"tmp-{os.getpid()}"
    work.mkdir()
    built = work / f"{name}.so"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cpp_extension.is_ninja_available():
                # is_python_module=False: torch loads it with torch.ops.load_library.
                cpp_extension.load(
                    name=name,
                    sources=[str(s) for s in SOURCES],
                    extra_cflags=list(CFLAGS),
                    extra_ldflags=list(LDFLAGS),
                    build_directory=str(work),
                    verbose=False,
                    is_python_module=False,
                )
                os.replace(built, library)  # same inode: the loaded copy stays valid
                builder = "ninja"
            else:
                _compile_direct(compiler, built, cpp_extension)
                os.replace(built, library)
                torch.ops.load_library(str(library))
                builder = "c++"
        for w in caught:
            log.debug("while building %s: %s", name, w.message)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return builder


def _compile_direct(compiler: str, output: Path, cpp_extension) -> None:
    """One compiler call (no ninja): the flags torch would use for a non-Python library."""
    abi = int(torch.compiled_with_cxx11_abi())
    cmd = [
        compiler, *CFLAGS, "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-isystem{p}" for p in cpp_extension.include_paths()),
        *(str(s) for s in SOURCES), "-o", str(output),
        *(f"-L{p}" for p in cpp_extension.library_paths()),
        "-lc10", "-ltorch_cpu", *LDFLAGS,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}")


@contextmanager
def _file_lock(path: Path):
    """Exclusive inter-process lock, released by the OS if the holder dies."""
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on torch's baton only
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
