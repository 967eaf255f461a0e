"""Owns the tensors: model weights, the preallocated paged KV cache, the sampler.

Lifecycle: construct (load the checkpoint with transformers' ``from_pretrained``, build
the fused forward, allocate the whole KV cache once from the memory budget) ->
:meth:`ModelRunner.execute` once per scheduler step -> drop. The cache never grows: a
request gets blocks from the block manager, never new tensors.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from workers.models.attention import build_attention_batch
from workers.models.decoder import (
    TORCH_OPS,
    DecoderModel,
    ElementwiseOps,
    ModelShape,
    supported_architecture,
)
from workers.models.int8_checkpoint import load_model as load_int8_model
from workers.models.int8_checkpoint import quantization_of
from workers.models.kv_format import CALIBRATION_TEXT, CALIBRATION_TOKENS
from workers.models.linear import (
    TORCH_LINEAR,
    GemvRowsTiming,
    gemv_linear,
    gemv_op,
    int8_linear,
    onednn_linear,
    time_gemv_rows,
    tuned_linear,
)

from . import kernels
from .params import EngineConfig
from .sampler import Sampler, SampleResult, TokenLogprobs, TokenMasks
from .scheduler import ScheduledChunk
from .sequence import Sequence

log = logging.getLogger(__name__)

NATIVE_OPS = ElementwiseOps(kernels.rms_norm, kernels.add_rms_norm, kernels.rope_, kernels.silu_mul)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class StepResult:
    """Tokens sampled this step, by sequence id, with optional logprobs."""

    seq_ids: list[str]
    sample: SampleResult
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = dataclasses.field(
        default_factory=dict)
    """seq id -> (prompt position, log-probability of the token after it) for the
    positions this step computed, of the sequences that asked for them."""


def model_context_len(model_path: Path) -> int:
    """The longest context the checkpoint supports (sliding-window models: the window)."""
    cfg = AutoConfig.from_pretrained(model_path)
    limit = cfg.max_position_embeddings
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True):
        # Full attention inside the window is exact; beyond it we would need masking.
        limit = min(limit, window)
    return int(limit)


def default_intra_op_threads() -> int:
    """Intra-op threads an engine gets when its config names none: ``OMP_NUM_THREADS``,
    else every core (what torch itself would pick)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return os.cpu_count() or 1


def keep_freed_memory() -> None:
    """Stop glibc from returning large freed buffers to the OS after every op.

    Each step allocates activations of the same few sizes; by default glibc serves them
    with fresh ``mmap``s, so every op page-faults on zeroed pages. Raising the mmap and
    trim thresholds keeps them in the heap for reuse (what tcmalloc/jemalloc would do,
    which vLLM asks users to preload). Process-wide and harmless to repeat.
    """
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 31)


GEMV_DTYPES = (torch.float32, torch.bfloat16)
"""Model dtypes whose decode steps run the native GEMV (:func:`kernels.f32_gemv`)."""


def _room_for_a_copy(model: torch.nn.Module, share: float = 0.25) -> bool:
    """Whether a second copy of the model's weights takes at most ``share`` of the
    memory available now (Linux's MemAvailable, page cache included; elsewhere: assume
    not). Each extra layout the runner keeps (both GEMM layouts, the GEMV's) asks once,
    before the model is built: together at most half of what was free."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        free = kib * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return False
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights <= share * free


class ModelRunner:
    def __init__(self, config: EngineConfig, max_model_len: int,
                 eos_token_ids: frozenset[int] = frozenset(), tokenizer=None) -> None:  # noqa: ANN001
        """``tokenizer``: the checkpoint's, when the caller has it loaded (an NVFP4
        cache tokenizes its calibration text; None: loaded here then)."""
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        keep_freed_memory()
        self.dtype = TORCH_DTYPES[config.dtype]
        self.device = torch.device(config.device)
        prequantized = None
        stored = quantization_of(config.model)
        if stored is not None and config.quantization != stored:
            raise ValueError(f"{config.model} holds {stored} weights (written by `pdserve "
                             f"quantize`): pass --quantization {stored} "
                             f"(EngineConfig.quantization={stored!r})")
        if stored is not None:
            hf, prequantized = load_int8_model(config.model, self.dtype)
        else:
            hf = AutoModelForCausalLM.from_pretrained(config.model, dtype=self.dtype)
        hf.eval().to(self.device)
        if prequantized and self.device.type != "cpu":
            prequantized = {k: type(w)(w.q.to(self.device), w.scale.to(self.device))
                            for k, w in prequantized.items()}
        native = (self.device.type == "cpu" and config.use_native_kernels
                  and kernels.load(config.kernel_cache_dir) is not None)
        linear = None
        self.linear_tuning: list[tuple[int, float, float]] = []
        """Reduced-precision CPU GEMMs: (rows, F.linear s, oneDNN s) as timed at load."""
        self.gemv_tiling: kernels.TilesTiming | None = None
        """The decode GEMV's layout as timed at load (None: no native GEMV)."""
        self.gemv_rows: GemvRowsTiming | None = None
        """Up to how many rows a float model's GEMV runs, as timed at load (None: no
        float GEMV)."""
        shape = (ModelShape.of(hf.config)
                 if supported_architecture(hf.config, type(hf).__name__) else None)
        if self.device.type == "cpu" and config.prepacked_weights:
            linear = onednn_linear(self.dtype)
            if (linear is not None and self.dtype != torch.float32
                    and config.quantization is None and shape is not None):
                # Which is faster depends on the CPU and the thread count (AMX bf16:
                # F.linear below ~256 rows at 16 threads, oneDNN at 2): measured here.
                linear, self.linear_tuning = tuned_linear(
                    linear, shape.layer_gemms(), self.dtype, keep_both=_room_for_a_copy(hf))
                log.info("%s GEMMs: %s (%s)", self.dtype, linear.name, ", ".join(
                    f"{m} rows: F.linear {p * 1e3:.2f} ms, oneDNN {q * 1e3:.2f} ms"
                    for m, p, q in self.linear_tuning))
        gemv_dtype = torch.int8 if config.quantization == "int8" else self.dtype
        if native and shape is not None and (
                gemv_dtype == torch.int8
                or (gemv_dtype in GEMV_DTYPES and config.decode_gemv and _room_for_a_copy(hf))):
            # Row-major or tiles: which the GEMV streams faster depends on the CPU
            # (tiles: 1.2-2x on AMD EPYCs, AVX2 and AVX-512): measured here.
            self.gemv_tiling = kernels.time_gemv_tiles(shape.layer_gemms(), gemv_dtype,
                                                       shape.num_layers)
            t = self.gemv_tiling
            log.info("decode GEMV (%s): %s (row-major %.2f ms, tiles %.2f ms per %d MB)",
                     gemv_dtype, "tiles" if t.tiles else "row-major", t.row_major_s * 1e3,
                     t.tiles_s * 1e3, t.weight_bytes >> 20)
        layer_linear = None
        layer_op = kernels.decode_layer if native and config.native_layers else None
        self.int8_rows: kernels.Int8RowsTiming | None = None
        """Up to how many rows the int8 GEMV runs, as timed at load (None: no int8 kernel)."""
        if config.quantization == "int8":
            # Every layer's projections and the LM head (the step's biggest GEMV: 113 of
            # SmolLM2's 220 MB per fp32 step with it in fp32; +0.13 points of perplexity).
            # Native: the int8 GEMV/GEMM kernel; else dequantize per call (slow, any device).
            tiles = self.gemv_tiling is not None and self.gemv_tiling.tiles
            if native and shape is not None:
                # GEMV or dequantize-then-GEMM: the crossover is 16 rows on one CPU and
                # 128-256 on another (kernels.time_int8_gemv_rows): measured here.
                self.int8_rows = kernels.time_int8_gemv_rows(
                    shape.layer_gemms(), self.dtype, tiles, shape.num_layers)
                log.info("int8 GEMV up to %d rows (%s)", self.int8_rows.rows, ", ".join(
                    f"{m}: GEMV {g * 1e3:.2f} ms, GEMM {q * 1e3:.2f} ms" for m, g, q in zip(
                        self.int8_rows.probed, self.int8_rows.gemv_s, self.int8_rows.gemm_s,
                        strict=True)))
            rows = self.int8_rows.rows if self.int8_rows else kernels.INT8_GEMV_ROWS
            layer_linear = (int8_linear(
                functools.partial(kernels.int8_linear, max_gemv_rows=rows),
                kernels.int8_tiles if tiles else None, native=True) if native
                else int8_linear())
            if layer_op is not None:
                layer_op = functools.partial(kernels.decode_layer, int8_gemv_rows=rows)
        elif self.gemv_tiling is not None:
            # Up to how many rows the GEMV beats the batched op depends on the CPU, the
            # dtype and the threads (a Zen 4, one thread: bf16 3, fp32 4): measured here.
            layout = kernels.gemv_tiles_where_whole if self.gemv_tiling.tiles else None
            batched = linear or TORCH_LINEAR
            self.gemv_rows = time_gemv_rows(
                gemv_op(kernels.f32_gemv, layout), batched, shape.layer_gemms(),
                gemv_dtype, shape.num_layers)
            g = self.gemv_rows
            log.info("decode GEMV up to %d rows (%s)", g.rows, ", ".join(
                f"{m}: GEMV {a * 1e3:.2f} ms, {batched.name} {b * 1e3:.2f} ms"
                for m, a, b in zip(g.probed, g.gemv_s, g.batched_s, strict=True)))
            linear = gemv_linear(kernels.f32_gemv, batched, max_rows=g.rows, layout=layout,
                                 native=kernels.gemv_form)
        # RoPE tables reach the calibration's positions too, whatever max_model_len is:
        # workers with different limits must calibrate the same key transform.
        self.model = DecoderModel(
            hf, max(max_model_len, CALIBRATION_TOKENS
                    if config.kv_cache_dtype != "auto" else 0),
            decode_op=kernels.paged_decode_attention if native else None,
            write_decode_op=kernels.paged_write_decode_attention if native else None,
            layer_op=layer_op,
            ops=NATIVE_OPS if native else TORCH_OPS,
            linear=layer_linear or linear or TORCH_LINEAR,
            kv_cache_dtype=config.kv_cache_dtype,
            prequantized=prequantized,
        )
        del hf  # its weights now live in the model's own (fused, reordered) tensors
        self.vocab_size = self.model.shape.vocab_size
        self.block_size = config.block_size
        s = self.model.shape
        if native and self.model.kv_format.quantized:  # the same bytes, natively
            self.model.kv_format = dataclasses.replace(
                self.model.kv_format, native_encode=kernels.quantize_kv_rows)
        self.kv_format = self.model.kv_format
        """How each cache row stores a token's K or V of one head."""
        self.kv_digest = 0
        """Digest of the key transform a quantized cache stores keys under (0: none);
        both ends of a KV transfer must hold the same (:mod:`workers.models.kv_format`)."""
        if self.kv_format.quantized:
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(config.model)
            ids = tokenizer(CALIBRATION_TEXT).input_ids
            self.kv_digest = self.model.calibrate_keys(ids[:CALIBRATION_TOKENS],
                                                       config.block_size)
        self.block_bytes = (s.num_layers * 2 * config.block_size * s.num_kv_heads
                            * self.kv_format.row_bytes)
        if config.num_blocks is not None:
            self.num_blocks = config.num_blocks
        else:
            self.num_blocks = int(config.kv_cache_memory_gb * 2**30) // self.block_bytes
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_gb={config.kv_cache_memory_gb} holds no block of "
                f"{self.block_bytes} bytes; raise it"
            )
        # Zeroed, not empty: padded decode rows read real memory under a mask, and
        # uninitialised NaNs would leak through 0 * NaN.
        self.kv_cache = torch.zeros(
            s.num_layers, 2, self.num_blocks * config.block_size, s.num_kv_heads,
            self.kv_format.row_elems, dtype=self.kv_format.storage_dtype, device=self.device,
        )
        self.sampler = Sampler(eos_token_ids=eos_token_ids,
                               argmax=kernels.argmax_rows if native else None)
        self.forward_s = 0.0
        """Wall seconds in :meth:`DecoderModel.forward`, summed (read anywhere)."""
        self.forward_cpu_s = 0.0
        """CPU seconds the calling (engine) thread spent there; intra-op helpers not
        included (see :mod:`common.threads`)."""

    @property
    def gemv_handover_rows(self) -> int:
        """Up to how many rows a step's linear layers run a GEMV rather than the batched
        op (the float GEMV's or the int8 kernel's limit as timed at load; 0: no GEMV):
        where a step's cost turns (``common.cost_model``, ``StepModel.gemv_rows``)."""
        if self.gemv_rows is not None:
            return self.gemv_rows.rows
        return self.int8_rows.rows if self.int8_rows is not None else 0

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], masks: TokenMasks | None = None,
                forks: Mapping[str, list[Sequence]] | None = None,
                prompt_logprobs: Mapping[str, int] | None = None,
                after_layer: Callable[[int], None] | None = None) -> StepResult:
        """One forward over ``chunks``, then sampling (``masks``: structured output).
        ``after_layer``: told as each layer's KV is in the cache (the model's forward).
        ``forks``: the other choices of a sequence whose chunk samples here; each gets a
        row of its own, drawn from that sequence's logits (the prompt computed once).
        ``prompt_logprobs``: seq id -> alternatives, for sequences whose prompt positions
        computed here also get the log-probability of the prompt token that follows."""
        decode = [c for c in chunks if c.num_tokens == 1]
        prefill = [c for c in chunks if c.num_tokens > 1]
        ordered = decode + prefill
        ids: list[int] = []
        sample_rows: list[int] = []
        sampling: list[Sequence] = []
        scored_rows: list[int] = []  # rows whose logits score the prompt token after them
        prompt_rows: list[tuple[str, int, int, int]] = []  # (seq id, position, next, top)
        for c in ordered:
            offset = len(ids)  # this chunk's first row
            ids.extend(c.seq.token_ids[c.start : c.start + c.num_tokens])
            if c.samples:
                sample_rows.append(len(ids) - 1)
                sampling.append(c.seq)
                for child in (forks or {}).get(c.seq.seq_id, ()):
                    sample_rows.append(len(ids) - 1)
                    sampling.append(child)
            top = (prompt_logprobs or {}).get(c.seq.seq_id)
            if top is not None:
                last = min(c.start + c.num_tokens, c.seq.num_prompt_tokens - 1)
                prompt_rows += [(c.seq.seq_id, pos, c.seq.token_ids[pos + 1], top)
                                for pos in range(c.start, last)]
                scored_rows += [offset + pos - c.start for pos in range(c.start, last)]
        sample_rows += scored_rows  # after the sampled ones: the sampler takes the first
        batch, positions = build_attention_batch(
            [c.seq.block_table for c in decode],
            [c.start + 1 for c in decode],
            [(c.seq.block_table, c.start, c.num_tokens) for c in prefill],
            self.block_size,
        )
        dev = self.device
        if dev.type != "cpu":
            batch, positions = batch.to(dev), positions.to(dev)
        wall, cpu = time.perf_counter(), time.thread_time()
        # On CUDA a layer's KV is written when its stream gets there, not when the layer's
        # calls return: no per-layer word there (the caller's word after the step holds).
        logits = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=dev), positions, batch, self.kv_cache,
            torch.tensor(sample_rows, dtype=torch.long, device=dev), self.block_size,
            after_layer if dev.type == "cpu" else None,
        )
        self.forward_cpu_s += time.thread_time() - cpu
        self.forward_s += time.perf_counter() - wall
        if dev.type != "cpu":
            logits = logits.cpu()  # the sampler and its per-request generators live here
        seq_ids = [seq.seq_id for seq in sampling]
        sample = self.sampler.sample(logits[: len(sampling)], seq_ids,
                                     [seq.params for seq in sampling], sampling, masks)
        return StepResult(seq_ids, sample,
                          _prompt_logprobs(logits[len(sampling):], prompt_rows))

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks' K and V in every layer, (source, destination) each: the
        copy-on-write of a forked choice's first block of its own."""
        if not pairs:
            return
        bs = self.block_size
        offsets = torch.arange(bs, device=self.device)
        src = torch.cat([s * bs + offsets for s, _ in pairs])
        dst = torch.cat([d * bs + offsets for _, d in pairs])
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]


def _prompt_logprobs(logits: torch.Tensor, rows: list[tuple[str, int, int, int]]
                     ) -> dict[str, list[tuple[int, TokenLogprobs]]]:
    """Each row's log-probability of its next prompt token and its ``top`` most likely
    alternatives, by sequence: (position, entry) in position order."""
    out: dict[str, list[tuple[int, TokenLogprobs]]] = {}
    if not rows:
        return out
    lp = torch.log_softmax(logits.float(), dim=-1)
    nexts = torch.tensor([r[2] for r in rows])
    chosen_t = lp.gather(1, nexts.unsqueeze(1))
    ranks = ((lp > chosen_t).sum(dim=-1) + 1).tolist()
    chosen = chosen_t.squeeze(1).tolist()
    k = min(max(r[3] for r in rows), lp.shape[-1])
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for i, (seq_id, pos, nxt, top) in enumerate(rows):
        alts = tuple(zip(top_i[i][:top], top_v[i][:top], strict=True))
        out.setdefault(seq_id, []).append((pos, TokenLogprobs(nxt, chosen[i], alts,
                                                              ranks[i])))
    return out
