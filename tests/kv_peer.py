"""A decode-side end of the KV channel on CPU, for the silent-peer test
(``tests/integration/test_silent_peer.py``): ``python tests/kv_peer.py HOST`` prints its
channel address, accepts one transfer (request ``first``), prints ``ok`` and then idles
(its host is about to go silent)."""

from __future__ import annotations

import sys
import time

import torch

from workers.transfer import KVLayout, KVReceiver, PagedCacheDestination, TransferConfig

SHAPE, BLOCK, IDS = (2, 2, 8 * 16, 2, 16), 16, [1, 2]


def main() -> None:
    receiver = KVReceiver("peer", TransferConfig(host=sys.argv[1], connect_timeout_s=5.0))
    cache = torch.zeros(SHAPE)
    h = receiver.expect("first", KVLayout.of_cache(cache, BLOCK), IDS,
                        PagedCacheDestination(cache, IDS, BLOCK))
    print(receiver.address, flush=True)
    assert h.wait(60).ok, h.result()
    print("ok", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
