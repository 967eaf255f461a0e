"""A worker's role change (workers/roles.py) against fakes of the engine loop, servicer
and registry presence, and the router following a worker whose registry entry changed
role (router/pool.py). The real thing, under load: tests/integration/test_role_change.py."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
import pytest
from fake_workers import Cluster, FakeRegistry
from test_router import collect, metric, req, wait_for

from common.metrics import Metrics
from common.registry import WorkerInfo
from workers.engine.params import EngineConfig
from workers.engine.surface import EngineLoad
from workers.roles import ChannelEnd, RoleChangeError, RoleSwitch
from workers.server import WorkerConfig


@dataclass
class FakeLoop:
    busy: int = 0  # running requests the drain waits for
    reserved: int = 0  # reservations waiting for their KV
    barriers: int = 0  # the engine thread's commands caught up with
    hooks: list[tuple[object, str]] = field(default_factory=list)
    engine: object = None
    caps: list[int] = field(default_factory=list)  # set_prefill_cap's, in order

    def load(self) -> EngineLoad:
        return EngineLoad(running=self.busy, waiting=0, free_blocks=8, total_blocks=8,
                          reserved=self.reserved)

    async def barrier(self) -> None:
        self.barriers += 1

    def set_kv_receiver(self, expect: object, address: str = "") -> None:
        self.hooks.append((expect, address))

    def set_prefill_cap(self, tokens: int) -> None:
        self.caps.append(tokens)


@dataclass
class FakeServicer:
    used: list[tuple[str, object, object]] = field(default_factory=list)

    def use(self, config: WorkerConfig, sender: object, receiver: object,
            targets: object) -> None:
        self.used.append((config.role, sender, receiver))


@dataclass
class FakePresence:
    events: list[tuple[str, str]] = field(default_factory=list)
    registry: FakeRegistry = field(default_factory=FakeRegistry)  # KV targets read it

    async def step_out(self) -> None:
        self.events.append(("out", ""))

    async def step_in(self, info: WorkerInfo) -> None:
        self.events.append(("in", info.role))


def switch(role: str = "mixed", busy: int = 0, timeout_s: float = 5.0
           ) -> tuple[RoleSwitch, FakeLoop, FakeServicer, FakePresence, Metrics]:
    config = WorkerConfig(engine=EngineConfig(model="unused"), model_name="m", role=role,
                          drain_timeout_s=timeout_s, drain_grace_s=0.05)
    loop, servicer, presence = FakeLoop(busy), FakeServicer(), FakePresence()
    metrics = Metrics({"model": "m", "role": role})
    s = RoleSwitch(config, loop, ChannelEnd(role), servicer, presence,  # type: ignore[arg-type]
                   WorkerInfo("w:1", role, "w:1"), metrics)
    return s, loop, servicer, presence, metrics


def test_role_change_drains_swaps_the_channel_end_and_registers_in_the_new_role() -> None:
    async def body() -> None:
        s, loop, servicer, presence, metrics = switch("mixed", busy=3)
        metrics.set("kv_blocks_free", 8)
        done = await s.change("prefill", "planner: prefill queue too deep")
        assert (done.role, done.previous_role, done.kv_address) == ("prefill", "mixed", "")
        assert done.drained_s == 0.0  # no end to drain: what runs goes on as prefill
        assert s.role == "prefill" and s.end.sender is not None
        assert servicer.used == [("prefill", s.end.sender, None)]
        assert loop.hooks == [(None, "")]
        assert presence.events == [("out", ""), ("in", "prefill")]
        assert s.info is not None and s.info.role == "prefill"
        reg = metrics.registry
        assert reg.get_sample_value("pdserve:worker_role_changes_total", {
            "model": "m", "role": "prefill", "from_role": "mixed", "to_role": "prefill"}) == 1
        # the old role's gauges are gone (a sum would count them twice)
        assert reg.get_sample_value("pdserve:kv_blocks_free",
                                    {"model": "m", "role": "mixed"}) is None
        again = await s.change("prefill")  # the role it has: nothing to do
        assert (again.previous_role, again.drained_s) == ("prefill", 0.0)
        assert len(presence.events) == 2
        s.close()

    asyncio.run(body())


def test_each_role_drains_what_its_channel_end_carries() -> None:
    """A decode worker waits for its reservations' KV, not for the sequences decoding (they
    go on in the new role); a prefill worker for what runs (its KV leaves through the old
    end)."""
    async def body() -> None:
        s, loop, servicer, _, _ = switch("decode", busy=2)
        loop.reserved = 1
        change = asyncio.ensure_future(s.change("mixed"))
        await asyncio.sleep(0.2)
        assert not change.done() and servicer.used == []  # a reservation's KV to come
        loop.reserved = 0
        done = await change
        assert done.role == "mixed" and 0.2 <= done.drained_s < 1  # 2 still run
        assert loop.barriers == 1  # a reserve let in just before counted first
        s, loop, servicer, _, _ = switch("prefill", busy=1)
        change = asyncio.ensure_future(s.change("decode"))
        await asyncio.sleep(0.2)
        assert not change.done()
        loop.busy = 0
        assert (await change).drained_s >= 0.2
        s.close()

    asyncio.run(body())


def test_invalid_role_is_refused_naming_the_roles() -> None:
    async def body() -> None:
        s, _, servicer, presence, _ = switch()
        with pytest.raises(RoleChangeError) as e:
            await s.change("verifier")
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert all(r in str(e.value) for r in ("prefill", "decode", "mixed"))
        assert servicer.used == [] and presence.events == []

    asyncio.run(body())


def test_set_role_sets_the_stall_free_cap_with_or_without_a_new_role() -> None:
    async def body() -> None:
        s, loop, _, presence, _ = switch("mixed")
        assert s.prefill_cap == 0
        done = await s.change("mixed", "planner: decodes wait", prefill_cap=256)
        assert (done.role, done.prefill_cap, loop.caps) == ("mixed", 256, [256])
        assert presence.events == []  # the role it has: the registry never heard
        kept = await s.change("mixed")  # no cap asked: kept, nothing posted
        assert (kept.prefill_cap, loop.caps) == (256, [256])
        only = await s.change("", prefill_cap=128)  # no role named: the one it has
        assert (only.role, only.previous_role, loop.caps) == ("mixed", "mixed", [256, 128])
        with pytest.raises(RoleChangeError):  # a bad role sets nothing
            await s.change("chef", prefill_cap=128)
        moved = await s.change("decode", prefill_cap=0)  # with a new role: both
        assert (moved.role, moved.prefill_cap, loop.caps) == ("decode", 0, [256, 128, 0])
        s.close()

    asyncio.run(body())


def test_a_second_change_while_one_drains_is_refused() -> None:
    async def body() -> None:
        s, loop, _, _, _ = switch("prefill", busy=1)
        first = asyncio.ensure_future(s.change("mixed"))
        await asyncio.sleep(0.05)
        with pytest.raises(RoleChangeError) as e:
            await s.change("decode", prefill_cap=64)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "under way" in str(e.value)
        assert (loop.caps, s.prefill_cap) == ([], 0)  # refused: its cap not set either
        loop.busy = 0
        assert (await first).role == "mixed"
        s.close()

    asyncio.run(body())


def test_a_caller_hanging_up_does_not_leave_the_worker_out_of_the_registry() -> None:
    async def body() -> None:
        s, loop, _, presence, _ = switch("prefill", busy=1)
        call = asyncio.ensure_future(s.change("mixed"))
        await asyncio.sleep(0.05)
        call.cancel()  # the caller's deadline: the change goes on to its end
        await asyncio.sleep(0.05)
        loop.busy = 0
        deadline = time.monotonic() + 2
        while presence.events[-1] != ("in", "mixed") or s.changing is not None:
            assert time.monotonic() < deadline, presence.events
            await asyncio.sleep(0.01)
        assert s.role == "mixed"
        assert (await s.change("prefill")).role == "prefill"  # no change is left under way
        s.close()

    asyncio.run(body())


def test_drain_timeout_keeps_the_old_role_and_aborts_nothing() -> None:
    async def body() -> None:
        s, loop, servicer, presence, _ = switch("prefill", busy=1, timeout_s=0.3)
        started = time.monotonic()
        with pytest.raises(RoleChangeError) as e:
            await s.change("mixed", "test")
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "1 running" in str(e.value) and "still prefill" in str(e.value)
        assert 0.3 <= time.monotonic() - started < 2
        assert s.role == "prefill" and servicer.used == [] and loop.hooks == []
        assert presence.events == [("out", ""), ("in", "prefill")]  # registered again
        loop.busy = 0
        assert (await s.change("mixed", drain_timeout_s=5)).role == "mixed"

    asyncio.run(body())


# -- the router follows -------------------------------------------------------------------


def test_worker_registered_again_in_another_role_moves_pools_with_its_stub() -> None:
    async def body() -> None:
        registry = FakeRegistry()
        async with Cluster(["prefill", "prefill", "decode"], registry=registry,
                           discovery_interval_s=0.005) as c:
            a, b, d = c.workers
            for w in c.workers:
                registry.add(w.address, w.role)
            await wait_for(lambda: c.router_worker(b).listed)
            stub = c.router_worker(b).stub
            registry.expire(b.address)  # it drains: a listed worker leaves, static or not
            await wait_for(lambda: c.router_worker(b).gone)
            assert [w.address for w in c.router.pool("prefill")] == [a.address]
            b.role = "decode"
            registry.add(b.address, "decode")
            await wait_for(lambda: c.router_worker(b).role == "decode"
                           and not c.router_worker(b).gone)
            assert c.router_worker(b).stub is stub
            assert [w.address for w in c.router.pool("prefill")] == [a.address]
            assert {w.address for w in c.router.pool("decode")} == {b.address, d.address}
            assert metric(c, "workers", role="decode") == 2
            c.router_worker(d).down_until = time.monotonic() + 60  # b first
            msgs = await collect(c, req(max_tokens=3))
            assert msgs[-1].routing.decode_worker == b.address
            assert msgs[-1].routing.worker == a.address

    asyncio.run(body())
