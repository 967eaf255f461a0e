"""GPU checks, skipped on machines without CUDA (run them when a GPU machine is lent):

    .venv/bin/python -m pytest -q tests/integration/test_gpu_checks.py

A machine with one GPU cannot run NCCL between two ranks (NCCL wants a GPU per rank),
so these check what one GPU can: KV held in CUDA tensors goes through the channel
(gloo wire, staged into the CUDA cache on the receiving end) bit-exact into the right
blocks, and gather/scatter work on CUDA caches.
"""

from __future__ import annotations

import pytest
import torch

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
