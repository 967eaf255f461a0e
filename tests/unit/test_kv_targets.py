"""Where a prefill worker may send KV: only to decode addresses the registry lists (or
listed lately), with registry reads bounded and never on a known address's path."""

from __future__ import annotations

import asyncio

from common.registry import LiveWorker, WorkerInfo
from workers.kv_targets import KVTargets


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


class Registry:
    def __init__(self) -> None:
        self.entries: list[LiveWorker] = []
        self.reads = 0
        self.down = False

    def live(self) -> list[LiveWorker]:
        self.reads += 1
        if self.down:
            raise ConnectionError("redis down")
        return list(self.entries)

    def add(self, role: str, address: str, kv_address: str = "") -> None:
        self.entries.append(LiveWorker(WorkerInfo(address, role, address,
                                                  kv_address=kv_address), {}))


def test_only_registered_decode_kv_addresses_are_targets() -> None:
    async def run() -> None:
        reg, clock = Registry(), Clock()
        reg.add("decode", "10.0.0.2:50061", "10.0.0.2:40000")
        reg.add("prefill", "10.0.0.3:50061")
        reg.add("mixed", "10.0.0.4:50061", "10.0.0.4:40000")  # mixed workers receive no KV
        targets = KVTargets(reg.live, clock=clock)
        assert await targets.allowed("10.0.0.2:40000")
        for address in ("10.0.0.2:50061", "10.0.0.3:50061", "10.0.0.4:40000", "6.6.6.6:1"):
            assert not await targets.allowed(address), address
        assert reg.reads == 1  # misses within miss_refresh_s share the first read
        clock.t += 0.3  # a decode worker that joined since is found on its first miss
        reg.add("decode", "10.0.0.5:50061", "10.0.0.5:40000")
        assert await targets.allowed("10.0.0.5:40000") and reg.reads == 2

    asyncio.run(run())


def test_a_known_target_never_waits_and_expires_after_the_grace() -> None:
    async def run() -> None:
        reg, clock = Registry(), Clock()
        reg.add("decode", "d:1", "d:2")
        targets = KVTargets(reg.live, refresh_s=1.0, grace_s=30.0, clock=clock)
        assert await targets.allowed("d:2")
        reg.entries.clear()  # the decode worker left the registry (draining)
        reg.down = True  # and then Redis went away
        clock.t += 5
        assert await targets.allowed("d:2")  # answered at once; a refresh runs behind
        await asyncio.sleep(0.05)
        assert reg.reads == 2
        clock.t += 26  # 31 s after it was last listed
        assert not await targets.allowed("d:2")
        reg.down = False
        clock.t += 1
        assert not await targets.allowed("d:2")  # listed nowhere: refused

    asyncio.run(run())


def test_a_miss_during_a_read_in_flight_waits_for_it_instead_of_being_refused() -> None:
    """Found by test_disagg_e2e under load: a Prefill naming the second decode worker
    arrived while the first decode worker's miss was still reading the registry and was
    refused (the read in flight lists both). It now waits behind that read."""
    async def run() -> None:
        reg, clock = Registry(), Clock()
        reg.add("decode", "a:1", "a:2")
        reg.add("decode", "b:1", "b:2")
        targets = KVTargets(reg.live, clock=clock)
        assert await asyncio.gather(targets.allowed("a:2"), targets.allowed("b:2")) == [
            True, True]
        assert reg.reads == 1  # one read served both

    asyncio.run(run())


def test_a_decode_worker_registered_just_after_a_read_is_found_after_the_throttle() -> None:
    async def run() -> None:
        reg, clock = Registry(), Clock()
        reg.add("decode", "a:1", "a:2")
        targets = KVTargets(reg.live, miss_refresh_s=0.05, clock=clock)
        assert await targets.allowed("a:2") and reg.reads == 1
        reg.add("decode", "b:1", "b:2")  # joined just after that read
        clock.t += 0.01  # asked within the throttle: waits it out, then reads
        assert await targets.allowed("b:2") and reg.reads == 2

    asyncio.run(run())
