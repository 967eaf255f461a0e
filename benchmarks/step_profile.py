"""Where a decode step's wall time goes: ``pdserve bench-engine --profile``.

For one batch size B at a time, on an engine already built:

1. **Into decode without prefill.** B requests enter through the decode worker's door
   (``reserve_request``, KV written straight into their blocks, ``commit_request`` with
   a first token), so a batch of 256 x 128-token prompts is decoding in a second instead
   of after minutes of prefill. Attention's cost depends on the context's length, not
   on what the KV holds, so the KV is a random pattern. The requests carry their own
   cache salt and the prefix cache is reset at the end: that KV can never serve anyone.
2. **Bare steps.** ``warmup`` steps, then ``steps`` timed steps: the step time is
   their median (robust to a neighbour taking the cores for a moment).
3. **Probed steps.** ``steps`` more with wall-clock probes (``time.perf_counter``)
   around the model's GEMMs (``model.linear``: the LM head apart), paged attention
   (cache writes included), the elementwise ops (``model.ops``) and the sampler. The
   probes replace attributes of this engine's objects and the ``paged_attention`` name
   :mod:`workers.models.decoder` calls, and are removed on the way out; nothing in
   ``workers/`` changes. CPU ops run synchronously (intra-op threads join before a call
   returns), so a timer around a call times the call. The rest of the step (the
   scheduler, input building, detokenizing, Python between the ops) is the step minus
   the parts; ``fwd glue`` is the share of it inside the forward (embedding, RoPE table
   lookup, residual add, logits to fp32, the Python of the layer loop). The breakdown
   reported is that of the median probed step, so its parts always add up to it.
   Probed steps run the Python layer (the probes sit on its calls), so where the model
   runs each layer as one native call (``model.layer_op``), the bare step is the faster
   of the two and the gap between them is what that call saves plus the probes' cost.
4. **Counted steps.** One step under a dispatch mode counts the torch ops it runs, one
   under ``sys.setprofile`` counts Python function calls (each in its own step: the
   counting slows the step down and is not timed).

Then every request is aborted (its blocks freed) and the prefix cache reset. Not
thread-safe: run it on the thread that drives the engine, with no other requests in it.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import workers.models.decoder as decoder_module
from benchmarks.machine import cpu_name
from workers.engine import kernels
from workers.engine.dtype_choice import cpu_flags
from workers.engine.llm_engine import LLMEngine
from workers.engine.params import SamplingParams
from workers.models.decoder import TORCH_OPS, DecoderModel
from workers.models.linear import GEMV_ROWS, GemvRowsTiming

PARTS = ("gemm", "attention", "elementwise", "lm_head", "sampling")
BATCHES = (1, 32, 256)
PROMPT_LEN = 128
CACHE_SALT = "pdserve-bench-step-profile"
"""Salts the profile's block hashes: its random KV can match no other request."""
SHOWN_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
               "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class StepProfile:
    """Milliseconds of the median decode step of ``batch`` sequences, bare
    (``step_ms``) and probed; ``parts_ms`` (by :data:`PARTS`) and ``forward_ms`` are
    those of the median probed step."""

    batch: int
    context_len: int  # mean tokens per sequence in the probed steps (prompt included)
    step_ms: float  # bare steps, no probes
    probed_step_ms: float
    forward_ms: float  # DecoderModel.forward, as the model runner times it
    parts_ms: dict[str, float]
    torch_ops: int | None  # dispatched per step (None: this torch cannot count them)
    python_calls: int

    @property
    def rest_ms(self) -> float:
        """Scheduler, inputs, detokenizing, Python dispatch: the probed step minus the
        parts (a small negative value is timer noise; it is not clamped)."""
        return self.probed_step_ms - sum(self.parts_ms.values())

    @property
    def forward_glue_ms(self) -> float:
        """The part of :attr:`rest_ms` spent inside the forward."""
        return self.forward_ms - sum(self.parts_ms[p] for p in PARTS if p != "sampling")

    def as_json(self) -> dict[str, Any]:
        return asdict(self) | {"rest_ms": self.rest_ms, "forward_glue_ms": self.forward_glue_ms}


class PartClock:
    """Seconds spent in each of :data:`PARTS`, summed over every probed call."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self._sync = sync  # a GPU's ops are asynchronous: wait for them at each edge

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._sync:
                self._sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self._sync:
                    self._sync()
                self.seconds[part] += time.perf_counter() - start

        return timed

    def wrap_linear(self, linear: Callable[..., torch.Tensor], lm_head: torch.Tensor
                    ) -> Callable[..., torch.Tensor]:
        """``model.linear`` timed as ``lm_head`` when its weight is the LM head's, else
        as ``gemm`` (the layers' projections)."""
        gemm, head = self.wrap("gemm", linear), self.wrap("lm_head", linear)

        def timed(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return head(x, w, bias) if w is lm_head else gemm(x, w, bias)

        return timed


@contextmanager
def _patched(obj: object, name: str, value: object) -> Iterator[None]:
    """``obj.name = value`` for the block; then the old attribute, or none if ``obj``
    had none of its own (a method then shows through again)."""
    own = vars(obj)
    had, old = name in own, own.get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


@contextmanager
def probes(engine: LLMEngine) -> Iterator[PartClock]:
    """Wall-clock probes on ``engine``'s GEMMs, attention, elementwise ops and sampler
    for the block (see the module docstring); every probe is removed on exit."""
    runner = engine.runner
    model: DecoderModel = runner.model
    clock = PartClock(torch.cuda.synchronize if runner.device.type == "cuda" else None)
    ops = replace(model.ops, **{f.name: clock.wrap("elementwise", getattr(model.ops, f.name))
                                for f in fields(model.ops)})
    with ExitStack() as stack:
        stack.enter_context(_patched(model, "linear",
                                     clock.wrap_linear(model.linear, model.lm_head)))
        stack.enter_context(_patched(model, "ops", ops))
        # The probes sit on the Python layer's calls: no layer runs as one native call.
        stack.enter_context(_patched(model, "layer_op", None))
        stack.enter_context(_patched(decoder_module, "paged_attention",
                                     clock.wrap("attention", decoder_module.paged_attention)))
        stack.enter_context(_patched(runner.sampler, "sample",
                                     clock.wrap("sampling", runner.sampler.sample)))
        yield clock


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += 1
        return func(*args, **(kwargs or {}))


def start_decoding(engine: LLMEngine, prompts: list[list[int]], max_tokens: int,
                   seed: int = 0) -> list[str]:
    """Put every prompt straight into the decode batch (step 1 of the module docstring);
    returns the request ids. Raises RuntimeError when the KV pool cannot hold them."""
    cache = engine.kv_view().cache
    layers, _, _, kv_heads, head_dim = cache.shape
    longest = max(len(p) for p in prompts)
    gen = torch.Generator().manual_seed(seed)
    pattern = torch.randn(layers, 2, longest, kv_heads, head_dim, generator=gen
                          ).to(cache.dtype).to(cache.device)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids: list[str] = []
    for i, prompt in enumerate(prompts):
        rid = f"step-profile-{i}"
        res = engine.reserve_request(rid, prompt, params, cache_salt=CACHE_SALT)
        if res is None:
            for done in ids:
                engine.abort_request(done)
            engine.scheduler.block_manager.reset_prefix_cache()
            raise RuntimeError(f"the KV pool cannot hold {len(prompts)} sequences of "
                               f"{longest} tokens; raise kv_cache_memory_gb")
        ids.append(rid)
        bs = res.block_size
        slots = torch.tensor([b * bs + o for b in res.block_table for o in range(bs)]
                             [: res.num_tokens], device=cache.device)
        cache[:, :, slots] = pattern[:, :, : res.num_tokens]
        engine.commit_request(rid, prompt[-1])
    return ids


def _step(engine: LLMEngine, batch: int) -> float:
    start = time.perf_counter()
    outputs = engine.step()
    elapsed = time.perf_counter() - start
    if len(outputs) != batch or any(o.finished for o in outputs):
        raise RuntimeError(f"a profiled step decoded {len(outputs)} sequences, not {batch}")
    return elapsed


def profile_decode(engine: LLMEngine, prompts: list[list[int]], steps: int = 8,
                   warmup: int = 2) -> StepProfile:
    """Decode steps of ``len(prompts)`` sequences, timed bare and then by part."""
    batch = len(prompts)
    if engine.has_unfinished_requests():
        raise RuntimeError("profile an idle engine: it still has requests")
    ids = start_decoding(engine, prompts, max_tokens=warmup + 2 * steps + 4)
    try:
        for _ in range(warmup):
            _step(engine, batch)
        bare = statistics.median(_step(engine, batch) for _ in range(steps))
        context = sum(len(p) for p in prompts) / batch + warmup + steps + (steps + 1) / 2
        probed: list[tuple[float, float, dict[str, float]]] = []  # wall, forward, parts
        with probes(engine) as clock:
            for _ in range(steps):
                parts, forward = dict(clock.seconds), engine.runner.forward_s
                wall = _step(engine, batch)
                probed.append((wall, engine.runner.forward_s - forward,
                               {p: clock.seconds[p] - parts[p] for p in PARTS}))
        wall, forward, parts = sorted(probed, key=lambda r: r[0])[len(probed) // 2]
        try:
            with _OpCounter() as counter:
                _step(engine, batch)
            torch_ops: int | None = counter.count
        except Exception:  # noqa: BLE001 - counting is optional; the step still ran
            torch_ops = None
        python_calls = _count_python_calls(lambda: _step(engine, batch))
    finally:
        for rid in ids:
            engine.abort_request(rid)
        engine.scheduler.block_manager.reset_prefix_cache()
    return StepProfile(
        batch=batch, context_len=round(context), step_ms=bare * 1e3,
        probed_step_ms=wall * 1e3, forward_ms=forward * 1e3,
        parts_ms={p: s * 1e3 for p, s in parts.items()},
        torch_ops=torch_ops, python_calls=python_calls,
    )


def _count_python_calls(fn: Callable[[], object]) -> int:
    calls = 0

    def count(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def _gemv_layout(model: DecoderModel) -> str:
    """How the GEMV holds the weights: row-major, its kernel's tiles, or some of each
    (a weight whose K is not whole chunks stays row-major)."""
    weights = [model.lm_head, *(w for lw in model.layers for w in vars(lw).values())]
    tiled = [isinstance(getattr(w, "gemv", None), kernels.GemvTiles) for w in weights
             if hasattr(w, "gemv")]
    if tiled and all(tiled):
        return "tiles of 4 rows"
    return "tiles of 4 rows where K allows, else plain" if any(tiled) else "plain weights"


def backend_report(model: DecoderModel,
                   tuning: Sequence[tuple[int, float, float]] = (),
                   gemv: kernels.TilesTiming | None = None,
                   gemv_rows: GemvRowsTiming | None = None) -> dict[str, Any]:
    """Which kernels this engine's model runs, what this torch was built with, and the
    CPU's name and matrix-math flags; ``tuning``: the model runner's ``linear_tuning``
    (how it chose the GEMMs), ``gemv``: its ``gemv_tiling`` (how it chose the GEMV's
    layout), ``gemv_rows``: its ``gemv_rows`` (up to how many rows the GEMV runs). Call it
    before :func:`probes` wraps the model."""
    name = getattr(model, "linear_name", "")
    onednn = "oneDNN _linear_pointwise (weights reordered once)"
    names = {"torch": "torch F.linear (plain weights)", "onednn": onednn}
    linear = names.get(name, name or repr(model.linear))
    if name.startswith("gemv+"):
        rest = name.removeprefix("gemv+")
        rows = gemv_rows.rows if gemv_rows is not None else GEMV_ROWS
        linear = (f"native GEMV up to {rows} rows ({_gemv_layout(model)}), "
                  f"above: {names.get(rest, rest)}")
    settings = {}
    build = [line.strip() for line in torch.__config__.show().splitlines()]
    for line in build:
        if line.startswith("- Build settings:"):
            for item in line.split(":", 1)[1].split(","):
                key, _, value = item.strip().partition("=")
                if key in ("BLAS_INFO", "USE_MKL", "USE_MKLDNN", "USE_OPENMP"):
                    settings[key] = value
    libraries = [line.lstrip("- ") for line in build
                 if any(k in line for k in ("Math Kernel Library", "MKL-DNN", "oneDNN",
                                            "CPU capability"))]
    flags = cpu_flags() or frozenset()
    return {
        "cpu": cpu_name(), "cpu_flags": [f for f in SHOWN_FLAGS if f in flags],
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "linear": linear,
        "linear_tuning": [{"rows": m, "plain_ms": p * 1e3, "onednn_ms": q * 1e3}
                          for m, p, q in tuning],
        "gemv_tiling": None if gemv is None else {
            "tiles": gemv.tiles, "row_major_ms": gemv.row_major_s * 1e3,
            "tiles_ms": gemv.tiles_s * 1e3, "weight_mb": gemv.weight_bytes / 2**20},
        "gemv_rows": None if gemv_rows is None else {
            "rows": gemv_rows.rows, "probed": [
                {"rows": m, "gemv_ms": a * 1e3, "batched_ms": b * 1e3} for m, a, b in zip(
                    gemv_rows.probed, gemv_rows.gemv_s, gemv_rows.batched_s, strict=True)]},
        "elementwise": "torch reference ops" if model.ops is TORCH_OPS else "native fused kernels",
        "decode_attention": (f"native paged kernel ({kernels.paged_attention_isa()})"
                             if model.decode_op else "torch (gathered SDPA)"),
        "layers": ("one native call each in decode-only steps (bare steps)"
                   if model.layer_op is not None else "Python, op by op"),
        "mkldnn_available": torch.backends.mkldnn.is_available(),
        "mkl_available": torch.backends.mkl.is_available(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "build_settings": settings, "libraries": libraries,
    }


def print_backend(report: dict[str, Any]) -> None:
    print(f"\nCPU: {report['cpu']}; flags: {' '.join(report['cpu_flags']) or 'none of note'}; "
          f"{report['torch_threads']} torch threads")
    print(f"torch {report['torch']}: GEMMs via {report['linear']}; elementwise: "
          f"{report['elementwise']}; decode attention: {report['decode_attention']}; "
          f"decoder layers: {report['layers']}")
    print(f"  mkldnn available: {report['mkldnn_available']}, mkl available: "
          f"{report['mkl_available']}, "
          + ", ".join(f"{k}={v}" for k, v in report["build_settings"].items()))
    for line in report["libraries"]:
        print(f"  {line}")
    if report.get("linear_tuning"):
        print("  GEMMs chosen at load, one layer's GEMMs timed: " + ", ".join(
            f"{t['rows']} rows F.linear {t['plain_ms']:.2f} / oneDNN {t['onednn_ms']:.2f} ms"
            for t in report["linear_tuning"]))
    if report.get("gemv_tiling"):
        g = report["gemv_tiling"]
        print(f"  GEMV layout chosen at load: {'tiles' if g['tiles'] else 'row-major'} "
              f"(one row through {g['weight_mb']:.0f} MB of layer weights: row-major "
              f"{g['row_major_ms']:.2f} ms, tiles {g['tiles_ms']:.2f} ms)")
    if report.get("gemv_rows"):
        g = report["gemv_rows"]
        print(f"  GEMV up to {g['rows']} rows, chosen at load (layer GEMMs, GEMV / batched: "
              + ", ".join(f"{t['rows']} rows {t['gemv_ms']:.2f} / {t['batched_ms']:.2f} ms"
                          for t in g["probed"]) + ")")


def print_profile(dtype: str, rows: list[dict[str, Any]]) -> None:
    """One table: each row a :meth:`StepProfile.as_json` plus ``gemm_floor_ms``,
    ``bandwidth_floor_ms``, ``kv_floor_ms`` and ``floor_share_bound`` (see
    :func:`benchmarks.engine.step_profile`)."""
    print(f"\n{dtype} decode step profile: prompts of {PROMPT_LEN} tokens, greedy; ms of the "
          "median step (share of the probed one)")
    head = ("batch", "ctx", "step", "probed", "GEMM", "attention", "elementw", "LM head",
            "sampling", "rest", "fwd glue", "GEMM flr", "BW flr", "KV flr", "share",
            "bound", "ops", "py calls")
    widths = (5, 5, 8, 8, 13, 13, 13, 13, 13, 13, 8, 9, 8, 7, 5, 5, 6, 9)
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, widths, strict=True)))
    for r in rows:
        total = r["probed_step_ms"]

        def cell(ms: float, total: float = total) -> str:
            return f"{ms:6.2f} ({ms / total:3.0%})"

        parts = [cell(r["parts_ms"][p]) for p in PARTS]
        values = (r["batch"], r["context_len"], f"{r['step_ms']:.2f}", f"{total:.2f}", *parts,
                  cell(r["rest_ms"]), f"{r['forward_glue_ms']:.2f}",
                  f"{r['gemm_floor_ms']:.2f}", f"{r['bandwidth_floor_ms']:.2f}",
                  f"{r['kv_floor_ms']:.2f}", f"{r['gemm_floor_ms'] / r['step_ms']:.0%}",
                  f"{r['floor_share_bound']:.0%}",
                  r["torch_ops"] if r["torch_ops"] is not None else "-", r["python_calls"])
        print(" ".join(f"{v:>{w}}" for v, w in zip(values, widths, strict=True)))
    print("  step: without probes; the parts are from a probed step (the probes' own cost "
          "lands in 'rest'); GEMM flr: the layer GEMMs and LM head alone at this batch; BW "
          "flr: weights + the KV the step reads, at the measured copy bandwidth; KV flr: "
          "that KV alone (the least the attention can take); share: GEMM flr / step; "
          "bound: the most share such a step can reach, GEMM flr / (GEMM flr + KV flr); "
          "ops: torch ops called from Python (a native layer counts as one); py calls: "
          "Python function calls")
