"""Typed, validated engine configuration, checked once at construction, never mutated.

Request parameters (:class:`SamplingParams`) live in ``common.sampling`` because the
router validates them too; they are re-exported here as part of the engine's API.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from common.kv_cache_dtype import KV_CACHE_DTYPES, check_kv_cache_dtype
from common.sampling import InvalidRequestError, SamplingParams

from .dtype_choice import DTYPE_CHOICES, DTYPES, resolve_dtype

__all__ = ["DTYPES", "DTYPE_CHOICES", "KV_CACHE_DTYPES", "QUANTIZATIONS",
           "QUANTIZATION_CHOICES", "EngineConfig", "InvalidRequestError", "SamplingParams",
           "SchedulerConfig", "DEFAULT_BLOCK_SIZES", "default_block_size", "local_limit",
           "resolve_block_size"]

QUANTIZATIONS: tuple[str | None, ...] = (None, "int8")
"""``EngineConfig.quantization`` values; the CLI spells None ``none``."""
QUANTIZATION_CHOICES = ("none", "int8")

DEFAULT_BLOCK_SIZES = {"cpu": 64, "cuda": 16}
"""Tokens per KV block when none is asked for, per device kind. A server that has run a
while holds each sequence's blocks in scattered places, and on CPUs the decode attention
pays per piece; prefix-cache hits land on block boundaries, so a chat turn recomputes
what the last block of the cached history left over (half a block on average). Measured
on one 2-core Zen 4 (SmolLM2 fp32; ``loadtest/results/block-size-zen4-1205/``), against
16: the attention over churned tables 0.76x at 64 and 0.66x at 128
(``python -m benchmarks.kv_layout``); a 3-turn chat's later turns' prefill 1.06x at 64
and 1.18x at 128 (``python -m benchmarks.block_size_chat``). CPUs take 64: 70% of the
first for a third of the second (vLLM's CPU backend takes 128; ``--block-size 128`` does
too). GPUs keep 16."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of the torch-free core: block pool, per-step budget, batch size."""

    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    prefill_tokens_while_decoding: int = 0
    """Most prompt tokens one step computes while a request on this engine is decoding
    (0: no cap beyond ``max_num_batched_tokens``). Sarathi-Serve's stall-free batching:
    the decodes' step stays short; an engine with no decodes running still computes
    prompts at the full budget."""
    model_id: str = "model"
    enable_prefix_caching: bool = True
    watermark_blocks: int = 0
    """Blocks kept free when admitting new requests, so running ones can grow a little
    before anyone is preempted."""

    def __post_init__(self) -> None:
        checks = {
            "num_blocks": self.num_blocks >= 1,
            "block_size": self.block_size >= 1,
            "max_num_batched_tokens": self.max_num_batched_tokens >= 1,
            "max_num_seqs": self.max_num_seqs >= 1,
            "prefill_tokens_while_decoding": self.prefill_tokens_while_decoding >= 0,
            "watermark_blocks": 0 <= self.watermark_blocks < self.num_blocks,
            # A sequence must fit in the whole pool, or it could never be scheduled.
            "max_model_len": 2 <= self.max_model_len <= self.num_blocks * self.block_size,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"SchedulerConfig.{name} out of range: {getattr(self, name)}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs; the CLI reads flags and environment into it once.

    The KV cache is preallocated from ``kv_cache_memory_gb`` (or exactly ``num_blocks``
    when given) and never grows per request.
    """

    model: str
    dtype: str = "auto"
    """``float32``, ``bfloat16``, or ``auto``: bfloat16 where the hardware computes in it
    natively, else float32 (:func:`~workers.engine.dtype_choice.resolve_dtype`), decided
    by the engine on the machine it runs on (:meth:`resolved`)."""
    block_size: int = 0
    """Tokens per KV cache block; 0: the device's default (:data:`DEFAULT_BLOCK_SIZES`:
    64 on CPU, 16 on CUDA), set at construction, so a built config always holds the
    size it runs with."""
    kv_cache_memory_gb: float = 2.0
    num_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    """How the paged cache stores K/V: ``auto`` (the model's dtype), ``fp8_e4m3``,
    ``fp8_e5m2`` or ``nvfp4`` (:mod:`workers.models.kv_format`). Quantized blocks hold
    more tokens in ``kv_cache_memory_gb`` and cross the KV channel as stored; prefill and
    decode workers must use the same one."""
    max_num_batched_tokens: int = 2048
    prefill_tokens_while_decoding: int = 0
    """:attr:`SchedulerConfig.prefill_tokens_while_decoding`; ``SetRole`` may change it
    live (:meth:`LLMEngine.set_prefill_cap`)."""
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    use_native_kernels: bool = True
    """Fused native decode attention and elementwise ops, compiled on first use; falls
    back to torch ops (with a logged warning) where no C++ compiler is found."""
    kernel_cache_dir: str | None = None  # None: ~/.cache/pdserve/kernels
    prepacked_weights: bool = True
    """CPU: GEMM weights reordered once into oneDNN's blocked layout (faster small-batch
    GEMMs, same memory; :mod:`workers.models.linear`); False: plain ``F.linear``. In
    bf16/fp16 the runner times both at load and keeps, per row count, the faster
    (:func:`workers.models.linear.tuned_linear`; both layouts where each wins somewhere and
    a second copy of the weights fits in a quarter of the free memory)."""
    decode_gemv: bool = True
    """CPU, float32 or bfloat16, native kernels: decode steps of up to a few tokens run a
    native GEMV on its own copy of each weight, row-major or in tiles as timed at load
    (1.4-2x faster single-stream GEMMs on AMD EPYCs; each weight kept twice, when a copy
    fits in a quarter of the free memory: :func:`workers.models.linear.gemv_linear`);
    False: one layout only."""
    native_layers: bool = True
    """CPU, native kernels: a step whose every token decodes runs each decoder layer as one
    native call (``workers.engine.kernels.decode_layer``: the same ops, bit for bit,
    without ~20 Python dispatches a layer) wherever its GEMMs have a native form; False:
    the Python layer always (the step profile's per-part probes need it)."""
    quantization: str | None = None
    """Weight quantization of the decoder layers' linear layers: None (the model dtype)
    or ``int8`` (weight-only, per-output-channel scales; :mod:`workers.models.linear`).
    Embeddings and the LM head stay in the model dtype. A plain checkpoint is quantized
    at load; a ``pdserve quantize`` directory must be loaded with ``int8``. Prefill and
    decode workers must use the same one (the KV they compute differs)."""
    device: str = "cpu"
    """Where weights, the KV cache and the forward live: ``cpu`` or ``cuda[:N]``. The
    native kernels are CPU-only (CUDA runs the torch ops); sampling stays on the CPU."""

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, "
                             f"got {self.dtype!r}")
        # frozen: the one place a field is filled in
        object.__setattr__(self, "block_size", resolve_block_size(self.block_size, self.device))
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of None, "
                             f"{', '.join(q for q in QUANTIZATIONS if q)}, "
                             f"got {self.quantization!r}")
        if self.kv_cache_memory_gb <= 0 and self.num_blocks is None:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")

    def resolved(self) -> tuple[EngineConfig, str]:
        """(this config with ``dtype`` concrete for this machine, why that dtype). Reads
        the CPU's flags when ``dtype`` is ``auto``; call it where the engine runs."""
        dtype, reason = resolve_dtype(self.dtype, self.device)
        return dataclasses.replace(self, dtype=dtype), reason


def default_block_size(device: str = "cpu") -> int:
    """Tokens per KV block for ``device`` (``cpu``, ``cuda`` or ``cuda:N``) when the
    configuration names none (:data:`DEFAULT_BLOCK_SIZES`)."""
    return DEFAULT_BLOCK_SIZES["cpu" if device == "cpu" else "cuda"]


def resolve_block_size(asked: int, device: str = "cpu", name: str = "block_size") -> int:
    """``asked`` tokens per KV block, or ``device``'s default when it is 0; ValueError
    naming ``name`` when negative. Every config that takes 0 for "the default" fills it in
    here, so none holds a 0 once built."""
    if asked < 0:
        raise ValueError(f"{name} must be >= 1 (0: the device's default), got {asked}")
    return asked or default_block_size(device)


def local_limit(threshold: int | None, cached_tokens: int, block_size: int) -> int:
    """The uncached tokens from which a decode worker sends a reserved prompt to a prefill
    worker (``workers/engine_reservations.py``, and the planner's copy of it). Below
    ``threshold`` (0 or None: never local) it is computed here; and a prompt found cached
    here computes here what its last whole block leaves over (less than a block), as it
    did when blocks were smaller than the threshold, instead of a transfer for part of a
    block."""
    if not threshold:
        return 0
    return max(threshold, block_size) if cached_tokens else threshold
