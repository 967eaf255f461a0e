"""``pdserve eval-kv``: what a quantized KV cache costs in accuracy, on a fixed offline text.

For each ``--kv-cache-dtype`` (``auto``, the model-precision cache, is the reference):

1. **Perplexity** over ``windows`` windows of ``window_tokens`` tokens spread evenly
   through the corpus. Each window runs as one prefill through the engine's own forward
   (:class:`~workers.engine.model_runner.ModelRunner`, the paged cache of that format):
   attention reads every K/V as stored, so each position's logits carry the cache's
   quantization error (see :mod:`workers.models.kv_format`).
2. **Mean KL divergence** ``KL(p_auto || p_format)`` of the next-token distributions at
   every position of those windows, and **teacher-forced top-1 agreement** (the argmax
   equals the reference's).
3. **Ablation** (``--ablate``): the same perplexity and KL with only the keys or only
   the values quantized, without the Hadamard rotation, and without each part of the key
   transform (the offset, the per-channel scales, both), per format.
4. **Greedy agreement**: ``prompts`` prompts of ``prompt_tokens`` tokens from the corpus,
   ``gen_tokens`` greedy tokens each through the offline engine (its decode path: the
   native kernel reading quantized blocks where it is built); share of streams identical
   to the reference, mean tokens before the first difference, and position-wise equality.

``weights`` adds weight formats to the same comparison, each with the model-precision
KV cache: ``int8`` (``--quantization int8``: int8 decoder-layer weights, activations in
the model dtype) and ``bfloat16`` / ``float32`` (the whole model in that dtype), scored
against the same reference (``auto`` KV, the model dtype's own weights).

The corpus is :mod:`pydoc_data.topics` (the Python reference's topic texts that ship in
every CPython; ``help()`` prints them): fixed for a Python version, offline, English
prose with code. The result says which Python. Pure measurement: no processes, no network.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from common.kv_cache_dtype import KV_CACHE_DTYPES, check_compared_kv_dtypes
from workers.engine.llm import LLM
from workers.engine.model_runner import ModelRunner, model_context_len
from workers.engine.params import EngineConfig, SamplingParams
from workers.models.attention import build_attention_batch
from workers.models.kv_format import (
    CALIBRATION_TEXT,
    CALIBRATION_TOKENS,
    KeyTransform,
    KVFormat,
)


class AblatedFormat:
    """A quantized format with parts of it switched off, for ``--ablate``: quantize only
    the keys or only the values, store rows without the Hadamard rotation, or without
    (parts of) the key transform. Duck-types the part of :class:`KVFormat` a prefill from
    position 0 uses, on the reference (model-dtype) cache: such a prefill never reads the
    cache back, so the "rows" it writes there are the values attention used. It serves
    :class:`WindowScorer` only."""

    def __init__(self, base: KVFormat, keys: bool = True, values: bool = True,
                 rotate: bool = True, key_offset: bool = True, key_scales: bool = True
                 ) -> None:
        self.base, self.keys, self.values, self.rotated = base, keys, values, rotate
        self.key_offset, self.key_scales = key_offset, key_scales
        self.quantized, self.code = True, base.code

    def transform(self, calibrated: KeyTransform) -> KeyTransform | None:
        """The engine's calibrated key transform less the parts switched off."""
        return calibrated.without(scales=not self.key_scales, offsets=not self.key_offset)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.rotate(x) if self.rotated else x

    def _one(self, x: torch.Tensor, on: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.rotate(x)
        read = self.base.dequantize(self.base.quantize(x)) if on else x
        read = read.to(self.base.model_dtype)  # what the reference cache holds
        return read, read

    def round_trip_kv(self, k: torch.Tensor, v: torch.Tensor, read: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (*self._one(k, self.keys), *self._one(v, self.values))


ABLATIONS = {"K only": {"values": False}, "V only": {"keys": False},
             "no rotation": {"rotate": False}, "no key offset": {"key_offset": False},
             "no key scales": {"key_scales": False},
             "no key transform": {"key_offset": False, "key_scales": False}}
"""What ``--ablate`` adds per quantized format: perplexity and KL only (no greedy)."""


WEIGHT_FORMATS = ("int8", "bfloat16", "float32")


@dataclass(frozen=True)
class Variant:
    """One compared configuration: its row label, KV cache format, weight quantization
    and model dtype (None: the options')."""

    label: str
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    dtype: str | None = None


def compared_variants(options: EvalOptions) -> list[Variant]:
    """The KV formats (``auto``, the reference, first), then the weight formats."""
    out = [Variant(name, name) for name in options.kv_dtypes]
    for w in options.weights:
        out.append(Variant(f"weights {w}", quantization="int8") if w == "int8"
                   else Variant(f"weights {w}", dtype=w))
    return out


@dataclass(frozen=True)
class EvalOptions:
    model: str
    kv_dtypes: tuple[str, ...] = KV_CACHE_DTYPES
    dtype: str = "auto"
    windows: int = 8
    window_tokens: int = 512
    prompts: int = 16
    prompt_tokens: int = 64
    gen_tokens: int = 32
    threads: int | None = None
    block_size: int = 16
    ablate: bool = False
    weights: tuple[str, ...] = ()
    """Weight formats compared too (see the module docstring): ``int8``, ``bfloat16``,
    ``float32``."""

    def __post_init__(self) -> None:
        check_compared_kv_dtypes(self.kv_dtypes)
        bad = sorted(set(self.weights) - set(WEIGHT_FORMATS))
        if bad:
            raise ValueError(f"unknown weight formats {bad}; choose from "
                             f"{', '.join(WEIGHT_FORMATS)}")
        for name in ("windows", "window_tokens", "prompts", "prompt_tokens", "gen_tokens"):
            if getattr(self, name) < (2 if name == "window_tokens" else 1):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass
class FormatResult:
    kv_cache_dtype: str
    row_bytes: int
    perplexity: float
    variant: str = ""
    """``--ablate`` rows: which part of the format was switched off (see ABLATIONS)."""
    perplexity_increase_pct: float = 0.0
    kl_mean: float = 0.0
    top1_agreement: float = 1.0
    greedy_identical: float = 1.0
    greedy_prefix_mean: float = 0.0
    greedy_token_agreement: float = 1.0
    seconds: float = 0.0


@dataclass
class EvalReport:
    model: str
    dtype: str
    corpus: str
    positions: int
    options: dict
    results: list[FormatResult] = field(default_factory=list)


def corpus() -> tuple[str, str]:
    """(text, description): every topic of :mod:`pydoc_data.topics`, sorted by name."""
    from pydoc_data import topics

    keys = sorted(topics.topics)
    text = "\n\n".join(topics.topics[k] for k in keys)
    return text, (f"pydoc_data.topics of Python {sys.version.split()[0]} ({len(keys)} "
                  f"topics, {len(text):,} characters)")


def windows(ids: list[int], count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens, evenly spread over ``ids``."""
    if len(ids) < length:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than one window")
    step = (len(ids) - length) // max(count - 1, 1)
    return [ids[i * step:i * step + length] for i in range(count)]


class WindowScorer:
    """One format's engine forward over whole windows, returning every position's
    log-probabilities (``[tokens, vocab]``, fp32)."""

    def __init__(self, options: EvalOptions, kv_cache_dtype: str, tokenizer=None,  # noqa: ANN001
                 quantization: str | None = None, dtype: str | None = None) -> None:
        blocks = -(-options.window_tokens // options.block_size) + 1
        config, _ = EngineConfig(model=options.model, dtype=dtype or options.dtype,
                                 quantization=quantization,
                                 kv_cache_dtype=kv_cache_dtype, num_blocks=blocks,
                                 block_size=options.block_size,
                                 num_threads=options.threads).resolved()
        self.config = config
        # RoPE tables long enough for the key offsets' calibration (``--ablate`` runs
        # it on this scorer's model)
        self.runner = ModelRunner(config, max(CALIBRATION_TOKENS, min(
            model_context_len(options.model), options.window_tokens)), tokenizer=tokenizer)
        self.block_size = options.block_size

    @torch.inference_mode()
    def log_probs(self, ids: list[int]) -> torch.Tensor:
        n, bs = len(ids), self.block_size
        table = list(range(-(-n // bs)))
        batch, positions = build_attention_batch([], [], [(table, 0, n)], bs)
        logits = self.runner.model.forward(torch.tensor(ids), positions, batch,
                                           self.runner.kv_cache, torch.arange(n), bs)
        return torch.log_softmax(logits.float(), dim=-1)


def _greedy(options: EvalOptions, v: Variant, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(options.model, dtype=v.dtype or options.dtype, kv_cache_dtype=v.kv_cache_dtype,
              quantization=v.quantization,
              num_threads=options.threads, block_size=options.block_size,
              kv_cache_memory_gb=0.25,
              max_model_len=options.prompt_tokens + options.gen_tokens + options.block_size)
    params = SamplingParams(max_tokens=options.gen_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class _Tally:
    """One scored variant's sums over the windows."""

    nll: float = 0.0
    kl: float = 0.0
    agree: int = 0
    seconds: float = 0.0

    def add(self, lp: torch.Tensor, ref: torch.Tensor, ref_top: torch.Tensor,
            target: torch.Tensor) -> None:
        """``lp``, ``ref``: log-probabilities ``[positions, vocab]``; ``ref_top``: the
        reference's argmax; ``target``: the next tokens ``[positions, 1]``."""
        self.nll -= float(lp.gather(1, target).sum())
        self.kl += float((ref.exp() * (ref - lp)).sum())
        self.agree += int((lp.argmax(-1) == ref_top).sum())


def run_eval(options: EvalOptions, log: Callable[[str], None] = print) -> EvalReport:
    from transformers import AutoTokenizer

    text, description = corpus()
    tok = AutoTokenizer.from_pretrained(options.model)
    ids = tok(text, add_special_tokens=False).input_ids
    wins = windows(ids, options.windows, options.window_tokens)
    starts = windows(ids, options.prompts, options.prompt_tokens)
    compared = compared_variants(options)
    names = [v.label for v in compared]
    scorers = {v.label: WindowScorer(options, v.kv_cache_dtype, tok, v.quantization, v.dtype)
               for v in compared}
    reference = scorers["auto"]
    report = EvalReport(options.model, reference.config.dtype, description,
                        options.windows * (options.window_tokens - 1), asdict(options))
    row_bytes = {name: sc.runner.kv_format.row_bytes for name, sc in scorers.items()}
    variants = _ablations(options, reference, tok) if options.ablate else []
    tallies = {name: _Tally() for name in names}
    tallies.update({(name, label): _Tally() for name, label, _, _ in variants})
    model = reference.runner.model
    for w, window in enumerate(wins):
        target = torch.tensor(window[1:]).unsqueeze(1)
        ref = None
        for name in names:
            t0 = time.perf_counter()
            lp = scorers[name].log_probs(window)[:-1]
            tallies[name].seconds += time.perf_counter() - t0
            if ref is None:
                ref, ref_top = lp, lp.argmax(-1)
            tallies[name].add(lp, ref, ref_top, target)
        for name, label, fmt, keys in variants:  # on the reference's model, swapped
            own = model.kv_format
            model.kv_format, model.key_transform = fmt, keys
            try:
                tallies[(name, label)].add(reference.log_probs(window)[:-1], ref, ref_top,
                                           target)
            finally:
                model.kv_format, model.key_transform = own, None
        log(f"window {w + 1}/{len(wins)} scored")
    del scorers, reference, model
    pos = report.positions
    greedy_ref = None
    for v in compared:
        name = v.label
        t0 = time.perf_counter()
        streams = _greedy(options, v, starts)
        greedy_ref = greedy_ref or streams
        t = tallies[name]
        row = FormatResult(
            kv_cache_dtype=name,
            row_bytes=row_bytes[name],
            perplexity=math.exp(t.nll / pos),
            kl_mean=t.kl / pos,
            top1_agreement=t.agree / pos,
            greedy_identical=sum(a == b for a, b in zip(streams, greedy_ref, strict=True))
            / len(streams),
            greedy_prefix_mean=sum(_prefix(a, b) for a, b in zip(streams, greedy_ref,
                                                                  strict=True)) / len(streams),
            greedy_token_agreement=sum(x == y for a, b in zip(streams, greedy_ref, strict=True)
                                       for x, y in zip(a, b, strict=False))
            / sum(len(b) for b in greedy_ref),
            seconds=t.seconds + time.perf_counter() - t0,
        )
        report.results.append(row)
        log(f"{name}: perplexity {row.perplexity:.4f}, KL {row.kl_mean:.5f}, "
            f"greedy identical {row.greedy_identical:.0%}")
    for name, label, _, _ in variants:
        t = tallies[(name, label)]
        report.results.append(FormatResult(
            name, row_bytes[name], math.exp(t.nll / pos), variant=label, kl_mean=t.kl / pos,
            top1_agreement=float("nan"), greedy_identical=float("nan"),
            greedy_prefix_mean=float("nan"), greedy_token_agreement=float("nan")))
    base = report.results[0].perplexity
    for row in report.results:
        row.perplexity_increase_pct = 100.0 * (row.perplexity / base - 1.0)
    return report


def _ablations(options: EvalOptions, reference: WindowScorer, tok
               ) -> list[tuple[str, str, AblatedFormat, KeyTransform | None]]:
    """(format, variant label, the ablated format, its key transform) for ``--ablate``:
    each quantized format with one part switched off, to run on the reference scorer's
    model. The transform is the one the engine calibrates for that format, less the
    parts switched off."""
    model = reference.runner.model
    own = model.kv_format
    calibration = tok(CALIBRATION_TEXT).input_ids[:CALIBRATION_TOKENS]
    out = []
    try:
        for name in options.kv_dtypes[1:]:
            base = KVFormat(name, own.head_dim, own.model_dtype)
            model.kv_format = base
            model.calibrate_keys(calibration, options.block_size)
            calibrated = model.key_transform
            for label, switch in ABLATIONS.items():
                variant = AblatedFormat(base, **switch)
                out.append((name, label, variant, variant.transform(calibrated)))
    finally:
        model.kv_format, model.key_transform = own, None
    return out


def markdown(report: EvalReport, header: str) -> str:
    lines = [f"**{header}**", "",
             f"Corpus: {report.corpus}; {report.positions:,} scored positions "
             f"({report.options['windows']} windows x {report.options['window_tokens']} "
             f"tokens); greedy: {report.options['prompts']} prompts x "
             f"{report.options['gen_tokens']} tokens.", "",
             "| KV cache / weights | bytes/row | perplexity | increase | mean KL | top-1 agree | "
             "greedy identical | tokens before 1st diff | greedy token agree |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report.results:
        if r.variant:
            continue
        name = (f"auto ({report.dtype})" if r.kv_cache_dtype == "auto"
                else r.kv_cache_dtype + (" (KV auto)" if r.kv_cache_dtype.startswith("weights")
                                         else ""))
        lines.append(
            f"| {name} | {r.row_bytes} | {r.perplexity:.4f} | {r.perplexity_increase_pct:+.2f}% "
            f"| {r.kl_mean:.5f} | {r.top1_agreement:.2%} | {r.greedy_identical:.0%} | "
            f"{r.greedy_prefix_mean:.1f} / {report.options['gen_tokens']} | "
            f"{r.greedy_token_agreement:.1%} |")
    ablated = [r for r in report.results if r.variant]
    if ablated:
        full = {r.kv_cache_dtype: r for r in report.results if not r.variant}
        lines += ["", "Ablation (`--ablate`; same windows): which part of each format costs "
                  "what.", "", "| KV cache | variant | perplexity increase | mean KL |",
                  "| --- | --- | --- | --- |"]
        for name in dict.fromkeys(r.kv_cache_dtype for r in ablated):
            f = full[name]
            lines.append(f"| {name} | as shipped | "
                         f"{f.perplexity_increase_pct:+.2f}% | {f.kl_mean:.5f} |")
            lines += [f"| {name} | {r.variant} | {r.perplexity_increase_pct:+.2f}% | "
                      f"{r.kl_mean:.5f} |" for r in ablated if r.kv_cache_dtype == name]
    return "\n".join(lines)


def plot(report: EvalReport, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.results[1:] if not r.variant]
    names = [r.kv_cache_dtype for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    a.bar(names, [r.perplexity_increase_pct for r in rows], color="#4c72b0")
    a.set_ylabel("perplexity increase vs auto (%)")
    b.bar(names, [r.kl_mean for r in rows], color="#dd8452")
    b.set_ylabel("mean KL(auto || format)")
    fig.suptitle(f"{report.model.rstrip('/').split('/')[-1]} ({report.dtype}): quantized KV")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
