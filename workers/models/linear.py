"""The GEMMs of the decoder: weights in the form the fastest available kernel wants.

:class:`LinearOps` is a pair: ``prepare`` turns a weight ``[out, in]`` into what
``apply(x, weight, bias)`` takes, once, when the model is built. :data:`TORCH_LINEAR`
is ``F.linear`` on the plain weight (any device). :func:`onednn_linear` (CPU) reorders
each weight once into oneDNN's blocked layout, so no GEMM repacks its weight on every
call: measured on a 2-core Xeon (AVX-512, AMX), SmolLM2's 120 layer GEMMs per step took
1.4-1.6x less time at 8-40 tokens in fp32 and 1.4-1.6x less at every size in bf16; at
one token and at hundreds (prefill) fp32 was unchanged. The reordered weight replaces
the plain one (no extra memory).

Both compute the same product up to summation order (fp32: ~1e-5 relative), like any
two GEMM kernels; greedy output still equals Hugging Face's (tests/integration).

:func:`tuned_linear` (reduced-precision dtypes) measures instead of assuming: on a
16-vCPU Sapphire Rapids, oneDNN's reordered bf16 weights ran 2-6x *slower* than
``F.linear`` at 8-128 rows with 16 threads, and faster with 2. The model runner times
both on the model's own layer shapes at load and keeps the faster per row count.

:func:`gemv_linear` puts a native GEMV in front of another op for the small batches of
decode (up to :data:`GEMV_ROWS` rows): a step of one token is a matrix-vector product
bound by reading the weights, which oneDNN's GEMM streams at ~8-9 GB/s on a 2-core AMD
EPYC (AVX2) where the GEMV reaches ~12-13 GB/s (SmolLM2's fp32 layer GEMMs: 42 -> 30 ms at
1-4 tokens, level at 8), and bf16 at ~17 GB/s on a 2-core Zen 4 where the GEMV on tiles
reads ~28. The GEMV's copy is in the layout its kernel reads fastest on this CPU
(``layout``: row-major, or tiles of 4 rows stored as one stream, as the model runner
measured at load: ``workers.engine.kernels.time_gemv_tiles``). The cost is memory: each
weight is kept twice, for the GEMV and in the other op's layout (:class:`DualWeight`;
SmolLM2 fp32: +425 MB of layer weights, and +113 MB where the LM head is tiled:
row-major, a tied head's GEMV copy is the embedding itself).

:func:`int8_linear` is weight-only int8 (``--quantization int8``): each weight row
(output channel) becomes int8 values and one float32 scale, symmetric absmax
(:func:`quantize_int8`); activations stay in the model dtype, so a request's output
never depends on its batch-mates' values. Its prepared weight is an :class:`Int8Weight`,
not a tensor; the kernel is passed in (``workers.engine.kernels.int8_linear`` on CPU),
so this module needs nothing from the engine.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from common.timing import crossover, least_seconds


@dataclass(frozen=True)
class Int8Weight:
    """A weight ``[out, in]`` as ``q * scale[:, None]``: q int8 (values in [-127, 127],
    contiguous), scale float32 ``[out]``. q is ``[out, in]``, or, once an int8 op's
    ``layout`` prepared it, in that kernel's own tiles (``tiled``; only its kernel reads
    it then)."""

    q: torch.Tensor
    scale: torch.Tensor
    tiled: bool = False

    @property
    def shape(self) -> torch.Size:
        if self.tiled:  # [ceil(out/4), in/8, 4, 8]
            return torch.Size((self.scale.shape[0], self.q.shape[1] * self.q.shape[3]))
        return self.q.shape

    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


@dataclass(frozen=True)
class DualWeight:
    """A float weight in two layouts, for an op chosen per call by its row count
    (:func:`by_rows`): ``gemv``, the small-batch op's (the GEMV's ``[out, in]`` contiguous
    or its kernel's own tiles, or ``F.linear``'s plain weight; it has ``shape``) and
    ``packed``, what the other op's ``prepare`` made of it."""

    gemv: Any
    packed: Any

    @property
    def shape(self) -> torch.Size:
        return self.gemv.shape


Weight = torch.Tensor | Int8Weight
"""A weight as a checkpoint gives it: float, or already quantized (pre-quantized
checkpoints, :mod:`workers.models.int8_checkpoint`)."""
Linear = Callable[[torch.Tensor, Any, "torch.Tensor | None"], torch.Tensor]


NativeForm = Callable[
    [Any, int], "tuple[torch.Tensor, int] | tuple[torch.Tensor, int, torch.Tensor] | None"]
"""``native(prepared, rows)``: how a native decode layer runs this op's prepared weight
for ``rows`` rows of x, as ``(tensor, kind)`` (``workers.engine.kernels.decode_layer``'s
kinds: > 0 a GEMV's tiles of that many rows, 0 a GEMV on ``[out, in]``, -1 oneDNN's
reordered weight, -2 ``F.linear``) or, for int8 weights, ``(values, -3, scales)``; None
where it cannot."""
ONEDNN_KIND, TORCH_KIND, INT8_KIND = -1, -2, -3


@dataclass(frozen=True)
class LinearOps:
    """``prepare(weight)`` once per weight when the model is built, then ``apply(x,
    prepared, bias)`` per call. ``prepare`` takes a float weight; only ops with
    ``quantized`` set also take an :class:`Int8Weight` (used as is). ``native``: the
    same product as a native decode layer calls it (:data:`NativeForm`); None: never."""

    name: str
    prepare: Callable[[Weight], Any]
    apply: Linear
    quantized: bool = False
    native: NativeForm | None = None


def by_weight(quantized: Linear, plain: Linear) -> Linear:
    """One ``apply`` for a model whose layers are quantized but whose LM head is not:
    :class:`Int8Weight` goes to ``quantized``, anything else to ``plain``."""

    def apply(x: torch.Tensor, w: Any, bias: torch.Tensor | None) -> torch.Tensor:  # noqa: ANN401
        return (quantized if isinstance(w, Int8Weight) else plain)(x, w, bias)

    return apply


def weight_nbytes(w: Any) -> int:  # noqa: ANN401 - a prepared weight of any LinearOps
    """Bytes a prepared weight occupies (what one pass over it reads)."""
    if isinstance(w, DualWeight):  # one pass reads one layout
        return weight_nbytes(w.gemv)
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return w.nbytes()  # Int8Weight, a GEMV kernel's packed weight


def cat_weights(ws: list[Weight]) -> Weight:
    """Weights stacked along the output dim (fused q/k/v, gate/up): per-output-channel
    quantization commutes with this, so int8 weights stack by rows and scales."""
    if any(isinstance(w, Int8Weight) and w.tiled for w in ws):
        raise ValueError("cannot fuse weights already in a kernel's tiles: fuse, then prepare")
    if all(isinstance(w, Int8Weight) for w in ws):
        return Int8Weight(torch.cat([w.q for w in ws]).contiguous(),
                          torch.cat([w.scale for w in ws]))
    if any(isinstance(w, Int8Weight) for w in ws):
        raise ValueError("cannot fuse int8 and float weights into one projection")
    return torch.cat(ws).contiguous()


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8: ``scale = max|row| / 127`` (float32, computed
    from the weight in float32), ``q = round(w / scale)`` in [-127, 127] (-128 never
    used, so negation is exact); an all-zero row gets scale 1. Error per weight: at most
    ``scale / 2``."""
    w32 = w.detach().to(torch.float32)
    absmax = w32.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


def dequantize_int8(w: Int8Weight, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in float32, rounded to ``dtype`` (row-major q; a kernel's tiles:
    ``workers.engine.kernels.int8_dequantize``)."""
    if w.tiled:
        raise ValueError("dequantize_int8 takes row-major q; tiles: the kernel's own op")
    return (w.q.to(torch.float32) * w.scale[:, None]).to(dtype)


TORCH_LINEAR = LinearOps("torch", lambda w: w, F.linear,
                         native=lambda w, rows: (w, TORCH_KIND))

_BATCH_HINT = 64
"""Tokens per GEMM the blocked layout is tuned for (a step's decode batch plus a prefill
chunk; measured best of 1/8/64 on both dtypes)."""


def onednn_linear(dtype: torch.dtype = torch.float32) -> LinearOps | None:
    """oneDNN GEMMs on pre-reordered weights of ``dtype``; None where this torch has no
    oneDNN CPU backend or it refuses the dtype on this CPU (its bf16 reorder needs
    AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU refuses it), then the caller keeps
    :data:`TORCH_LINEAR`."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        reorder = torch.ops.mkldnn._reorder_linear_weight
        pointwise = torch.ops.mkldnn._linear_pointwise
        probe = torch.ones(16, 16, dtype=dtype)
        pointwise(probe, reorder(probe, _BATCH_HINT), None, "none", [], "")
    except (AttributeError, RuntimeError):
        return None

    def prepare(w: torch.Tensor) -> torch.Tensor:
        return reorder(w.contiguous(), _BATCH_HINT)

    def apply(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return pointwise(x, w, bias, "none", [], "")

    return LinearOps("onednn", prepare, apply, native=lambda w, rows: (w, ONEDNN_KIND))


TUNE_ROWS = (1, 8, 32, 64, 128, 256, 512)
"""Tokens per GEMM :func:`tuned_linear` times: decode batches, then prefill chunks."""


def plain_rows(plain_s: list[float], packed_s: list[float],
               margin: float = 0.9) -> list[bool]:
    """Per measured row count: whether the plain op runs there, which takes its seconds
    under ``margin`` times the packed op's (a tie or a win inside the noise keeps the
    packed op)."""
    return [p < margin * q for p, q in zip(plain_s, packed_s, strict=True)]


def by_rows(plain: LinearOps, packed: LinearOps, rows: tuple[int, ...],
            use_plain: list[bool]) -> LinearOps:
    """Both ops, each weight kept in both layouts (:class:`DualWeight`); a call of ``m``
    rows runs the op chosen at the least measured row count >= m (past the last, the
    last's choice)."""
    table = [use_plain[bisect.bisect_left(rows, m)] for m in range(rows[-1] + 1)]
    last = use_plain[-1]

    def prepare(w: Weight) -> DualWeight:
        if isinstance(w, torch.Tensor):
            w = w.contiguous()  # one copy both layouts start from
        return DualWeight(plain.prepare(w), packed.prepare(w))

    def plain_at(m: int) -> bool:
        return table[m] if m < len(table) else last

    def apply(x: torch.Tensor, w: DualWeight, bias: torch.Tensor | None) -> torch.Tensor:
        m = x.numel() // x.shape[-1]
        if plain_at(m):
            return plain.apply(x, w.gemv, bias)
        return packed.apply(x, w.packed, bias)

    def native(w: DualWeight, m: int) -> tuple[torch.Tensor, int] | None:
        if plain_at(m):
            return plain.native(w.gemv, m) if plain.native else None
        return packed.native(w.packed, m) if packed.native else None

    spans = ", ".join(f"{m}: {plain.name if u else packed.name}"
                      for m, u in zip(rows, use_plain, strict=True))
    return LinearOps(f"by rows ({spans})", prepare, apply,
                     native=native if plain.native or packed.native else None)


def _seconds(ops: LinearOps, weights: list[Any], xs: list[torch.Tensor], reps: int) -> float:
    """Least seconds of ``reps`` passes over every (x, weight) pair, after one warm-up."""
    best = float("inf")
    for i in range(reps + 1):
        t = time.perf_counter()
        for x, w in zip(xs, weights, strict=True):
            ops.apply(x, w, None)
        if i:
            best = min(best, time.perf_counter() - t)
    return best


def tuned_linear(packed: LinearOps, shapes: list[tuple[int, int]], dtype: torch.dtype,
                 rows: tuple[int, ...] = TUNE_ROWS, reps: int = 3,
                 plain: LinearOps | None = None, keep_both: bool = True,
                 ) -> tuple[LinearOps, list[tuple[int, float, float]]]:
    """``packed`` (e.g. :func:`onednn_linear`) or ``plain`` (default
    :data:`TORCH_LINEAR`, ``F.linear`` on the weight as it is), whichever this CPU at
    this thread count runs faster, timed on weights of ``shapes`` (``(in, out)`` of one
    layer's GEMMs; seeded random values) at each of ``rows`` (:func:`plain_rows`); where
    each wins somewhere, both, chosen per call by its row count (:func:`by_rows`; each
    weight kept twice), unless ``keep_both`` is False (the caller has not the memory for
    a second copy): then the one with the least time summed over ``rows``. Returns the
    op and what was measured: ``(rows, plain seconds, packed seconds)`` per row count.

    Why measure: on a 16-vCPU Sapphire Rapids (AMX), oneDNN's bf16 GEMMs on reordered
    weights took 2.3-6x longer than ``F.linear`` at 8-128 rows with 16 threads and were
    1.2x faster at 256, while with 2 threads they were 1.1-2x faster at every size
    (``loadtest/results/device-h200-1204/reorder.log``): no fixed rule holds for both."""
    plain = plain or TORCH_LINEAR
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).to(dtype) for k, n in shapes]
    plain_w = [plain.prepare(w) for w in weights]
    packed_w = [packed.prepare(w) for w in weights]
    measured = []
    for m in rows:
        xs = [torch.randn(m, k, generator=gen).to(dtype) for k, _ in shapes]
        measured.append((m, _seconds(plain, plain_w, xs, reps),
                         _seconds(packed, packed_w, xs, reps)))
    use_plain = plain_rows([p for _, p, _ in measured], [q for _, _, q in measured])
    if not any(use_plain):
        return packed, measured
    if all(use_plain):
        return plain, measured
    if not keep_both:
        plain_total, packed_total = (sum(t[i] for t in measured) for i in (1, 2))
        return (plain if plain_total < packed_total else packed), measured
    return by_rows(plain, packed, rows, use_plain), measured


GEMV_ROWS = 4
"""Rows of x up to which :func:`gemv_linear` runs its GEMV by default (measured on a
2-core AMD EPYC, AVX2, SmolLM2 fp32: 1.4x faster than the reordered oneDNN GEMM at 1-4
rows, level at 8). The model runner measures its own (:func:`time_gemv_rows`)."""

GEMV_ROWS_PROBE = (1, 2, 3, 4, 5, 6, 8)
"""Rows of x :func:`time_gemv_rows` tries, in order."""

GEMV_MARGIN = 1.15
"""How much slower than the batched op the GEMV may run its layer GEMMs and keep a row
count (:func:`time_gemv_rows`: it also keeps the step in one native call per layer)."""

GEMV_ROWS_PROBE_BYTES = 48 * 2**20
"""Weight bytes per pass of :func:`time_gemv_rows` (at most; at least one layer)."""


@dataclass(frozen=True)
class GemvRowsTiming:
    """What :func:`time_gemv_rows` measured: per probed row count, the least seconds of
    one pass of x's rows through the probe's weights by the GEMV and by the batched op,
    and the rows chosen (the GEMV up to ``rows``; 0: never)."""

    rows: int
    probed: tuple[int, ...]
    gemv_s: tuple[float, ...]
    batched_s: tuple[float, ...]


def time_gemv_rows(gemv: LinearOps, batched: LinearOps, shapes: list[tuple[int, int]],
                   dtype: torch.dtype, layers: int, probe: tuple[int, ...] = GEMV_ROWS_PROBE,
                   reps: int = 3, margin: float = GEMV_MARGIN,
                   budget: int = GEMV_ROWS_PROBE_BYTES) -> GemvRowsTiming:
    """Up to how many rows of x ``gemv`` (:func:`gemv_linear`'s small op, with its
    layout) beats ``batched`` on this CPU, at this thread count: ``probe``'s row counts in
    order, x of ``dtype`` through seeded weights of ``shapes`` (``(in, out)`` of one
    layer's GEMMs) for up to ``layers`` layers within ``budget`` bytes, both ops ``reps``
    times after a warm-up, alternated. The GEMV keeps a row count where it takes under
    ``margin`` times the batched op's least time; a loss is timed once more (one slow
    pass on a shared machine must not cut the limit), and a second loss ends the probe.

    The margin is not 1 because the GEMV's rows are also the rows a decode-only step runs
    each decoder layer as one native call (``kernels.decode_layer`` takes the GEMV's
    weights), which saves the Python layer's dispatch, ~5-10% of a small step: on the
    Zen 4 below at one thread, fp32 at 4 rows (probe: GEMV 1.05x oneDNN) ran its decode
    step 1.07x slower without the GEMV, bf16 (probe: 1.25x) 0.87x as long.

    Why measure: the GEMV reads each weight row once for every row of x, so it wins
    while reading the weights is the cost, and where that stops depends on the CPU and
    the dtype: SmolLM2's layer GEMMs on a 2-core AMD EPYC Zen 4 (one thread) took, GEMV
    over oneDNN, 0.55 / 0.57 / 1.02 / 1.31x at 1 / 2 / 3 / 4 rows in bf16 (its rows
    widen bf16 to fp32 in the inner loop) and 0.51 / 0.48 / 0.76 / 1.00x in fp32."""
    gen = torch.Generator().manual_seed(0)
    per_layer = sum(k * n for k, n in shapes) * torch.finfo(dtype).bits // 8
    count = max(1, min(layers, budget // max(per_layer, 1)))
    plain = [torch.randn(n, k, generator=gen).to(dtype) * 0.05
             for _ in range(count) for k, n in shapes]
    ks = [k for _ in range(count) for k, _ in shapes]
    small = [gemv.prepare(w) for w in plain]
    big = [batched.prepare(w) for w in plain]

    def timed(m: int) -> tuple[float, float]:
        xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k in set(ks)}

        def run(ops: LinearOps, weights: list[Any]) -> Callable[[], None]:
            def once() -> None:
                for k, w in zip(ks, weights, strict=True):
                    ops.apply(xs[k], w, None)
            return once

        best = least_seconds({"gemv": run(gemv, small), "batched": run(batched, big)}, reps)
        return best["gemv"], best["batched"]

    return gemv_rows_from(timed, probe, margin)


def gemv_rows_from(timed: Callable[[int], tuple[float, float]], probe: tuple[int, ...],
                   margin: float = 1.0) -> GemvRowsTiming:
    """:func:`time_gemv_rows`' rule on ``timed(rows) -> (GEMV s, batched s)``
    (:func:`common.timing.crossover`): the GEMV up to the last row count it kept, none
    where it lost at the first."""
    c = crossover(timed, probe, margin)
    return GemvRowsTiming(c.kept or 0, c.probed, c.first_s, c.second_s)


Gemv = Callable[[torch.Tensor, Any, "torch.Tensor | None"], torch.Tensor]
"""``gemv(x, w, bias)``: ``workers.engine.kernels.f32_gemv``'s contract (float32 or
bfloat16; ``w`` plain or in the layout the kernel's own ``layout`` made)."""


def gemv_linear(gemv: Gemv, batched: LinearOps, max_rows: int = GEMV_ROWS,
                layout: Callable[[torch.Tensor], Any] | None = None,
                native: Callable[[Any], tuple[torch.Tensor, int]] | None = None) -> LinearOps:
    """``gemv`` for up to ``max_rows`` rows of x (decode), on the weight as ``layout``
    gives it (default: plain ``[out, in]``, contiguous; the kernel's own tiles where it
    reads those faster), ``batched`` on its own layout above (prefill, large decode
    batches). Each weight is kept in both (:class:`DualWeight`). ``native``: the GEMV's
    weight as a native decode layer takes it (``workers.engine.kernels.gemv_form``).
    ``max_rows`` 0: ``batched`` alone."""
    if max_rows < 1:
        return batched
    both = by_rows(gemv_op(gemv, layout, native), batched, (max_rows, max_rows + 1),
                   [True, False])
    return LinearOps(f"gemv+{batched.name}", both.prepare, both.apply, native=both.native)


def gemv_op(gemv: Gemv, layout: Callable[[torch.Tensor], Any] | None = None,
            native: Callable[[Any], tuple[torch.Tensor, int]] | None = None) -> LinearOps:
    """The GEMV alone as an op (:func:`gemv_linear`'s small side; timed on its own by
    :func:`time_gemv_rows`)."""

    def gemv_layout(w: Weight) -> Any:  # noqa: ANN401 - the kernel's own layout
        if isinstance(w, Int8Weight):
            raise ValueError("gemv_linear takes float weights")
        return layout(w) if layout else w

    return LinearOps("gemv", gemv_layout, gemv,
                     native=(lambda w, rows: native(w)) if native else None)


Int8Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"],
                      torch.Tensor]
"""``kernel(x, q, scale, bias)``: ``workers.engine.kernels.int8_linear``'s contract."""


def _int8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's contract in torch ops (any device): dequantize, then the GEMM."""
    return F.linear(x, dequantize_int8(Int8Weight(q, scale), x.dtype),
                    None if bias is None else bias.to(x.dtype))


def int8_linear(kernel: Int8Kernel | None = None,
                layout: Callable[[torch.Tensor], torch.Tensor] | None = None,
                native: bool = False) -> LinearOps:
    """Weight-only int8 linear layers: weights quantized at ``prepare`` (or taken as
    :class:`Int8Weight`), their values put in ``layout`` (the kernel's fastest, e.g. its
    tiles; default: as they are), ``apply`` through ``kernel`` (the native CPU kernel);
    None: dequantize per call and ``F.linear`` (any device; slower than the float model,
    a fallback only). ``native``: ``kernel`` is ``workers.engine.kernels.int8_linear``
    (with the GEMV rows the model's native decode layer is given), which that layer
    calls the same way (kind -3)."""
    run = kernel or _int8_reference

    def prepare(w: Weight) -> Int8Weight:
        w = w if isinstance(w, Int8Weight) else quantize_int8(w)
        if layout is None or w.tiled:
            return w
        q = layout(w.q)
        return w if q is w.q else Int8Weight(q, w.scale, tiled=True)

    def apply(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
        return run(x, w.q, w.scale, bias)

    return LinearOps("int8" if kernel is not None else "int8-torch", prepare, apply,
                     quantized=True,
                     native=(lambda w, rows: (w.q, INT8_KIND, w.scale)) if native else None)
