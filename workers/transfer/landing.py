"""Landing an accepted payload on the decode side: the two framings' receive loops.

Both run on the receive thread of one transfer, after the accept, and either return
with every byte in the destination or raise (the caller then fails the transfer and
closes the pair). Neither blocks longer than ``data_timeout_s`` per message. Both return
the checksum of what landed (:mod:`workers.transfer.checksum`, the payload in canonical
order), for the caller to compare with the offer's before the transfer can be DONE.

- direct: every message is received straight into its destination region. Such writes
  cannot be called back, so the handle was sealed before the accept; on an error every
  posted receive is resolved before raising, so nothing lands after the transfer ended.
- staged: messages land in a ring of channel-owned buffers and are written into the
  destination one by one under the handle, so a cancel stops the writes at once while
  the rest of the payload is drained (the pair stays in step).
"""

from __future__ import annotations

import math
import threading

import torch
import torch.distributed as dist

from workers.transfer.blocks import KVDestination
from workers.transfer.checksum import PayloadHash
from workers.transfer.header import Message, TransferHeader, direct_plan_fits, message_plan, tag_for
from workers.transfer.rendezvous import settle_when_resolved, td
from workers.transfer.state import TransferHandle


class BufferPool:
    """Staging buffers kept between staged receives: a fresh buffer costs a page fault
    per 4 KiB on first touch, about as much as the copy it stages. Thread-safe; keeps at
    most ``limit`` bytes, the least recently returned dropped first."""

    def __init__(self, device: str, limit: int):
        self.device, self.limit = device, limit
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for i, b in enumerate(self._free):
                if b.numel() == nbytes:
                    return self._free.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.insert(0, buf)
            while sum(b.numel() for b in self._free) > self.limit:
                self._free.pop()


def use_direct(header: TransferHeader, block_ids: list[int], destination: KVDestination,
               wire_device: str, min_bytes: int) -> bool:
    """Receive in place when the destination allows it, lives where the wire lands, and
    the runs of target ids make messages of ``min_bytes`` on average. Side-effect free."""
    if not getattr(destination, "direct", False) or not direct_plan_fits(
            header, block_ids, min_bytes):
        return False
    first = message_plan(header, block_ids, True)[0]
    probe = destination.region(first.p0, first.i0, first.i1)
    return probe.device == torch.device(wire_device)


def receive_direct(pg: dist.ProcessGroup, header: TransferHeader, plan: list[Message],
                   destination: KVDestination, handle: TransferHandle, timeout_s: float,
                   wire_device: str, first_timeout_s: float | None = None) -> int:
    """All messages posted at once into their regions (no buffers of ours needed), each
    region hashed as it lands (while the later ones are still on the wire). On a failure
    the receives still posted may yet write the destination: the handle does not
    quiesce until they resolve. The first message may wait ``first_timeout_s`` (an early
    offer's follows the prefill's first layer)."""
    regions = [destination.region(m.p0, m.i0, m.i1) for m in plan]
    works: list[dist.Work] = []
    digest = PayloadHash()
    try:
        for i, r in enumerate(regions):  # one failing to post: the ones before are held
            works.append(pg.recv([r], 0, tag_for(header.seq, i)))
        for i, (w, r) in enumerate(zip(works, regions, strict=True)):
            w.wait(td(first_timeout_s if i == 0 and first_timeout_s else timeout_s))
            digest.update(r)  # a device region: the host copy orders after the receive
        _sync(wire_device)
    except BaseException:
        settle_when_resolved(handle, works, "direct receive", timeout_s)
        raise
    return digest.digest()


def receive_staged(pg: dist.ProcessGroup, header: TransferHeader, plan: list[Message],
                   destination: KVDestination, handle: TransferHandle, timeout_s: float,
                   window: int, pool: BufferPool, first_timeout_s: float | None = None) -> int:
    """Messages through a ring of ``window`` pooled buffers, each hashed and written on
    arrival; the first may wait ``first_timeout_s``."""
    lay = header.layout
    window = min(window, len(plan))
    shape = (header.chunk_planes, header.num_blocks, lay.block_size, lay.kv_heads,
             lay.head_dim)
    raw = [pool.take(math.prod(shape) * lay.element_size) for _ in range(window)]
    ring = [b.view(lay.dtype).view(shape) for b in raw]
    works = {}
    digest = PayloadHash()

    def post(i: int) -> None:
        m = plan[i]
        works[i] = pg.recv([ring[i % window][: m.p1 - m.p0]], 0, tag_for(header.seq, i))

    for i in range(window):
        post(i)
    for i, m in enumerate(plan):
        works.pop(i).wait(td(first_timeout_s if i == 0 and first_timeout_s else timeout_s))
        digest.update(ring[i % window][: m.p1 - m.p0])
        with handle.writing() as may_write:
            if may_write:
                destination.write(m.p0, ring[i % window][: m.p1 - m.p0])
        if i + window < len(plan):
            post(i + window)
    _sync(pool.device)
    # Only now: after an error a posted receive may still hold a buffer, so those
    # buffers are dropped with the failed transfer, never reused.
    for b in raw:
        pool.give(b)
    return digest.digest()


def _sync(device: str) -> None:
    """NCCL receives complete on a stream; DONE must mean the bytes are there."""
    if device.startswith("cuda"):  # pragma: no cover - NCCL path, untested here
        torch.cuda.current_stream(torch.device(device)).synchronize()
