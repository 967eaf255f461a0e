"""One end of a KV transfer pair on CUDA, for the cross-host NCCL test
(``tests/integration/test_nccl_hosts.py``): ``python tests/nccl_pair.py recv HOST`` prints
its channel address, then the SHA-256 of the blocks it received; ``python
tests/nccl_pair.py send HOST ADDRESS`` sends seeded blocks there and prints theirs. Each
runs in its own test host with its own GPU (``CUDA_VISIBLE_DEVICES``)."""

from __future__ import annotations

import hashlib
import sys

import torch

from common.process_exit import exit_after_shutdown
from workers.transfer import (
    KVLayout,
    KVReceiver,
    KVSender,
    PagedCacheDestination,
    TransferConfig,
    gather_blocks,
)

SHAPE, BLOCK = (4, 2, 32 * 16, 2, 64), 16
SRC, DST = [1, 2, 3, 10], [20, 21, 5, 6]


def digest(cache: torch.Tensor, ids: list[int]) -> str:
    return hashlib.sha256(gather_blocks(cache, ids, BLOCK).cpu().numpy().tobytes()).hexdigest()


def main() -> None:
    role, host = sys.argv[1], sys.argv[2]
    cfg = TransferConfig(host=host, device="cuda", connect_timeout_s=60.0)
    if role == "recv":
        receiver = KVReceiver("nccl-decode", cfg)
        dst = torch.zeros(SHAPE, device="cuda")
        h = receiver.expect("nccl-1", KVLayout.of_cache(dst, BLOCK), DST,
                            PagedCacheDestination(dst, DST, BLOCK))
        print(receiver.address, flush=True)
        assert h.wait(120).ok, h.result()
        torch.cuda.synchronize()
        print(digest(dst, DST), flush=True)
        receiver.close()
    else:
        g = torch.Generator(device="cuda").manual_seed(7)
        src = torch.randn(SHAPE, device="cuda", generator=g)
        sender = KVSender("nccl-prefill", cfg)
        s = sender.send_blocks(sys.argv[3], "nccl-1", src, SRC, DST, BLOCK)
        assert s.wait(120).ok, s.result()
        print(cfg.backend, flush=True)
        print(digest(src, SRC), flush=True)
        sender.close()


if __name__ == "__main__":
    main()
    exit_after_shutdown(0)  # as a worker ends (common.process_exit says why)
