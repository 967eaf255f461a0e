"""GPU checks, skipped on machines without CUDA (run them when a GPU machine is lent):

    .venv/bin/python -m pytest -q tests/integration/test_gpu_checks.py

A machine with one GPU cannot run NCCL between two ranks (NCCL wants a GPU per rank),
so these check what one GPU can: the engine on CUDA gives Hugging Face's greedy tokens;
KV held in CUDA tensors goes through the channel (gloo wire, staged into the CUDA cache
on the receiving end) bit-exact into the right blocks; a prefill engine and a decode
engine on CUDA, joined by the channel, give the same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leaks, hf_greedy

from workers.engine.llm_engine import LLMEngine
from workers.engine.params import EngineConfig, SamplingParams
from workers.transfer import (
    KVLayout,
    KVReceiver,
    KVSender,
    PagedCacheDestination,
    TransferConfig,
    gather_blocks,
    scatter_blocks,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 4, 2, 64, 16, 32


def cuda_cache(seed: int | None = None) -> torch.Tensor:
    shape = (LAYERS, 2, BLOCKS * BLOCK, HEADS, DIM)
    if seed is None:
        return torch.zeros(shape, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", generator=g)


def test_cuda_gather_scatter_roundtrip() -> None:
    src, dst = cuda_cache(1), cuda_cache()
    kv = gather_blocks(src, [3, 4, 9], BLOCK)
    scatter_blocks(dst, [0, 7, 8], BLOCK, kv)
    assert torch.equal(gather_blocks(dst, [0, 7, 8], BLOCK), kv)


def test_cuda_kv_through_the_channel_lands_bit_exact() -> None:
    cfg = TransferConfig(connect_timeout_s=20.0)  # gloo wire: one GPU cannot host NCCL
    receiver, sender = KVReceiver("gpu-decode", cfg), KVSender("gpu-prefill", cfg)
    try:
        src, dst = cuda_cache(2), cuda_cache()
        src_ids, dst_ids = [1, 2, 3, 10], [20, 21, 5, 6]
        layout = KVLayout.of_cache(dst, BLOCK)
        h = receiver.expect("gpu-1", layout, dst_ids, PagedCacheDestination(dst, dst_ids, BLOCK))
        s = sender.send_blocks(receiver.address, "gpu-1", src, src_ids, dst_ids, BLOCK)
        assert s.wait(60).ok and h.wait(60).ok, (s.result(), h.result())
        torch.cuda.synchronize()
        assert torch.equal(gather_blocks(dst, dst_ids, BLOCK), gather_blocks(src, src_ids, BLOCK))
        untouched = [b for b in range(BLOCKS) if b not in dst_ids]
        assert gather_blocks(dst, untouched, BLOCK).abs().sum().item() == 0
    finally:
        sender.close()
        receiver.close()


def cuda_engine(path) -> LLMEngine:  # noqa: ANN001
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", num_blocks=64,
                                  block_size=4, max_num_batched_tokens=23, device="cuda"))


def finish(eng: LLMEngine, rid: str):  # noqa: ANN201
    while True:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return out


def run_all(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams
            ) -> list[list[int]]:
    """Every prompt's tokens, the engine stepped until all finish, in prompt order."""
    for i, ids in enumerate(prompts):
        eng.add_request(f"r{i}", ids, params)
    outs = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
    return [outs[f"r{i}"] for i in range(len(prompts))]


def test_cuda_engine_greedy_equals_hf(tiny_checkpoints) -> None:
    path = tiny_checkpoints["qwen2"]
    eng = cuda_engine(path)
    prompts = [eng.tokenizer(t).input_ids for t in ("Hello", "The quick brown fox " * 5)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert run_all(eng, prompts, params) == hf_greedy(path, prompts, 12)
    assert_no_leaks(eng)


def test_cuda_prefill_and_decode_engines_through_the_channel(tiny_checkpoints) -> None:
    path = tiny_checkpoints["llama"]
    p, d = cuda_engine(path), cuda_engine(path)
    ids = p.tokenizer("A " * 30 + "story").input_ids
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cfg = TransferConfig(connect_timeout_s=20.0)
    receiver, sender = KVReceiver("gpu-d", cfg), KVSender("gpu-p", cfg)
    try:
        seq = d.reserve_request("x", ids, params)
        dst = seq.block_table
        h = receiver.expect("x", KVLayout.of_cache(d.runner.kv_cache, 4), dst,
                            PagedCacheDestination(d.runner.kv_cache, dst, 4))
        sends = []
        p.add_request("x", ids, params, on_prefilled=lambda table, release: sends.append(
            (sender.send_paged(receiver.address, "x", p.runner.kv_cache, table, dst, 4),
             release)))
        first = finish(p, "x")
        assert h.wait(60).ok
        for s, release in sends:
            assert s.wait(60).ok
            release()
        d.commit_request("x", first.token_ids[0])
        out = finish(d, "x")
        assert [out.token_ids] == hf_greedy(path, [ids], 12)
        assert_no_leaks(p)
        assert_no_leaks(d)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_cuda_quantized_kv_equals_the_cpu_engine(tiny_checkpoints, kv_cache_dtype) -> None:
    """torch's native float8 casts on the GPU write the rows the CPU writes (the CPU's
    native kernel reads them there): same greedy tokens."""
    path = tiny_checkpoints["qwen2"]
    prompts = [[5, 6, 7], list(range(5, 45))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = []
    for device in ("cuda", "cpu"):
        eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_blocks=64,
                                     block_size=4, device=device,
                                     kv_cache_dtype=kv_cache_dtype))
        tokens.append(run_all(eng, prompts, params))
        assert_no_leaks(eng)
    assert tokens[0] == tokens[1]
