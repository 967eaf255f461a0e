"""Quantized KV caches through the disaggregated path: real worker processes, real gRPC
and gloo over loopback, a tiny random llama whose head_dim (16) NVFP4 can group.

- greedy output with a quantized KV cache through prefill -> KV transfer -> decode equals
  the offline engine with the same KV dtype, token for token; the bytes that crossed the
  KV channel are exactly the quantized blocks (values and scales), not model precision;
- a prefill worker whose KV dtype differs from its decode worker's is never paired with
  it: the router names both and the decode worker computes the prompts; nothing leaks.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch
from cluster_helpers import assert_cluster_idle, start
from tiny_models import _init_weights
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from cluster.local import LocalCluster
from router.client import AsyncClient, Client
from workers.engine.llm import LLM
from workers.engine.params import SamplingParams
from workers.models.kv_format import KVFormat

GREEDY = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
BLOCK = 4


@pytest.fixture(scope="module")
def llama16(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny llama with head_dim 16 (the shared one has 12): NVFP4 needs groups of 16."""
    src = tiny_checkpoints["llama"]
    out = tmp_path_factory.mktemp("llama16")
    cfg = AutoConfig.from_pretrained(src)
    cfg.head_dim = 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    _init_weights(model, torch.Generator().manual_seed(16), sorted(set(tok.all_special_ids)))
    model.save_pretrained(str(out), safe_serialization=True)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat")):
            shutil.copyfile(f, out / f.name)
    return out


def prompts_of(path: Path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(path)
    return [tok(t).input_ids for t in ("The quick brown fox jumps over the lazy dog",
                                       "def main():\n    return 42\n", "A " * 30,
                                       "Hello there, how are you today?")]


async def run_all(target: str, prompts: list[list[int]]) -> list[object]:
    async with AsyncClient(target) as client:
        return await asyncio.gather(*(client.generate(p, **GREEDY) for p in prompts))


def offline(path: Path, prompts: list[list[int]], kv_cache_dtype: str,
            max_tokens: int = GREEDY["max_tokens"]) -> list[list[int]]:
    llm = LLM(path, dtype="float32", kv_cache_dtype=kv_cache_dtype, block_size=BLOCK,
              kv_cache_memory_gb=0.01, num_threads=1)
    params = SamplingParams(**{**GREEDY, "max_tokens": max_tokens})
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "nvfp4"])
def test_quantized_kv_through_prefill_and_decode_equals_the_offline_engine(
        kv_cache_dtype, llama16, tmp_path) -> None:
    prompts = prompts_of(llama16)
    expected = offline(llama16, prompts, kv_cache_dtype)
    assert expected != offline(llama16, prompts, "auto") or kv_cache_dtype == "fp8_e4m3", (
        "nvfp4 changes this random model's greedy tokens: the test would not notice a "
        "cache that silently stored full precision")
    c = start(llama16, tmp_path, prefill=1, decode=1, local_prefill_threshold=0,
              block_size=BLOCK, kv_cache_dtype=kv_cache_dtype)
    try:
        served = asyncio.run(run_all(c.target, prompts))
        assert [s.token_ids for s in served] == expected
        with Client(c.target) as client:
            status = client.status()
        [decode] = [w for w in status.workers if w.role == "decode"]
        assert decode.transfers.entered["done"] == len(prompts)
        assert decode.transfers.entered["failed"] == 0
        # every prompt's blocks but the one its last token lands in, at the format's size
        cfg = AutoConfig.from_pretrained(llama16)
        row = KVFormat(kv_cache_dtype, 16, torch.float32).row_bytes
        block_bytes = cfg.num_hidden_layers * 2 * BLOCK * cfg.num_key_value_heads * row
        blocks = sum(-(-len(p) // BLOCK) for p in prompts)
        assert decode.transfers.bytes_moved == blocks * block_bytes
        assert row < 16 * 4 / 3  # >= 3x smaller than the fp32 rows this model computes in
        assert_cluster_idle(c)
    finally:
        c.stop()


class _MismatchedCluster(LocalCluster):
    """Prefill workers started with another --kv-cache-dtype than the decode workers."""

    prefill_kv = "fp8_e4m3"

    def _worker_args(self, i: int) -> list[str]:
        args = super()._worker_args(i)
        if args[args.index("--role") + 1] == "prefill":
            args[args.index("--kv-cache-dtype") + 1] = self.prefill_kv
        return args


def test_prefill_and_decode_with_different_kv_dtypes_refuse_to_pair(llama16, tmp_path,
                                                                    monkeypatch) -> None:
    """The router never pairs them (their model ids, which name the KV format, differ):
    the decode worker computes every prompt itself, and the router says why, naming
    both. (Were their KV sent anyway, the decode worker would refuse it, naming both
    formats: ``check_offer``, tests/unit/test_kv_format.py.)"""
    import cluster_helpers

    monkeypatch.setattr(cluster_helpers, "LocalCluster", _MismatchedCluster)
    prompts = prompts_of(llama16)
    c = start(llama16, tmp_path, prefill=1, decode=1, local_prefill_threshold=0,
              block_size=BLOCK)
    try:
        served = asyncio.run(run_all(c.target, prompts))
        assert [s.token_ids for s in served] == offline(llama16, prompts, "auto")
        with Client(c.target) as client:
            status = client.status()
        [prefill] = [w for w in status.workers if w.role == "prefill"]
        [decode] = [w for w in status.workers if w.role == "decode"]
        assert prefill.transfers.entered["done"] == decode.transfers.entered["done"] == 0
        assert decode.transfers.bytes_moved == 0
        assert_cluster_idle(c)
    finally:
        c.stop()
    logs = "\n".join(p.read_text(errors="replace") for p in Path(tmp_path).glob("*.log"))
    line = next((ln for ln in logs.splitlines() if "has no prefill worker" in ln), "")
    assert f"decode worker {decode.address} (" in line, logs[-3000:]
    assert f"(prefill workers: {prefill.address} (" in line and ":kv=fp8_e4m3:" in line
    assert ":float32)" in line.split("has no prefill")[0]  # the decode side: no kv= suffix
    assert "--kv-cache-dtype" in line


def test_bench_kv_capacity_drives_the_real_engine(llama16) -> None:
    """``pdserve bench-kv``'s capacity run steps the real engine with its forward stubbed:
    the stub must keep the runner's call signature and the vocabulary, and the count
    must follow the format's row size (head_dim 16: NVFP4 rows of 9 bytes against
    float32's 64)."""
    from benchmarks.kv_capacity import BenchKVOptions, KVResult, measure_capacity

    o = BenchKVOptions(model=str(llama16), kv_dtypes=("auto", "nvfp4"), dtype="float32",
                       kv_cache_gb=0.0002, seq_tokens=64, output_tokens=8, block_size=BLOCK,
                       threads=1)
    results = {kv: KVResult(kv) for kv in o.kv_dtypes}
    for kv, r in results.items():
        measure_capacity(o, kv, r, lambda _line: None)
        assert r.concurrent == r.concurrent_expected > 0
        assert r.preemptions == 0 or r.peak_running > r.concurrent
    auto, nvfp4 = results["auto"], results["nvfp4"]
    assert (auto.row_bytes, nvfp4.row_bytes) == (64, 9)
    assert nvfp4.concurrent >= 6 * auto.concurrent
