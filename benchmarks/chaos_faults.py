"""The faults ``pdserve chaos`` injects into a launched cluster (a
:class:`~benchmarks.chaos_targets.ChaosTarget`), and how it waits for the cluster to be
whole again.

Each fault type is a scenario. The victim is chosen round robin among the components
of its type; a kill waits (up to 2 s) until a worker victim holds requests, so that it
dies mid-stream rather than idle.

- ``kill-prefill`` / ``kill-decode`` / ``kill-mixed`` / ``kill-router`` /
  ``kill-redis``: SIGKILL; the launcher starts it again (the process launcher's
  supervision on the same address; Ray an actor, on a new port; see
  :func:`benchmarks.chaos_targets.refused` for what Ray cannot run);
- ``stop-prefill`` / ``stop-decode``: SIGSTOP for a while (a straggler: 1-10 s in the
  long run), then SIGCONT; ``stop-redis``: Redis frozen the same way (Redis slowed
  down to nothing: routers and workers time out on it and serve on);
- ``flush-redis``: FLUSHALL (the registry and the prefix index vanish at once);
- ``flip-kv``: requests sent in the fault window carry a request id that the prefill
  workers' fault hook (``PDSERVE_FAULT_FLIP_KV_BYTE``, set when the cluster starts)
  flips one byte of the KV payload for, after its checksum was computed;
- ``cancel``: the load's client cancels a third of the requests at random moments
  (before the first token: reserved, prefilling or transferring; after it: decoding);
- ``delay-kv`` / ``loss-kv`` / ``partition-kv``: network faults on a decode worker's
  link, the one its KV arrives over (:mod:`benchmarks.chaos_hosts`: the cluster spread
  over test hosts): for a while (as long as a stop), every frame delayed
  :data:`DELAY_MS` ± :data:`JITTER_MS` each way, or :data:`LOSS` of them dropped, or
  the link cut (a partition: connections stay open, nothing crosses); then clean again;
- ``slow-redis``: Redis's link delayed :data:`REDIS_DELAY_MS` ± :data:`JITTER_MS` each
  way for as long (Redis slowed, not stopped: every call answers, late);
- ``none``: the control: load, no fault.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from dataclasses import dataclass
from typing import cast

import grpc

from cluster.testhosts import Host
from common.redis_url import connect
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.client import Client, busy_workers, describe_busy

from .chaos_hosts import KV_VICTIM, HostsTarget
from .chaos_targets import NETWORK, ChaosTarget, Component

FLIP_MARK = "corrupt-this-kv"
"""The request-id mark the ``flip-kv`` scenario's requests carry (the prefill hook's)."""
FLIP_ENV = "PDSERVE_FAULT_FLIP_KV_BYTE"

KILLS = ("kill-prefill", "kill-decode", "kill-mixed", "kill-router", "kill-redis")
STOPS = ("stop-prefill", "stop-decode", "stop-redis")
SCENARIOS = ("none", *KILLS, *STOPS, "flush-redis", "flip-kv", "cancel", *NETWORK)
DELAY_MS, JITTER_MS, LOSS, REDIS_DELAY_MS = 40.0, 10.0, 0.05, 75.0
"""The network scenarios' impairments: each way, on the victim's link."""
WORKER_FAULTS = ("kill-prefill", "kill-decode", "kill-mixed", "stop-prefill",
                 "stop-decode")
REDIS_FAULTS = ("kill-redis", "stop-redis", "flush-redis", "slow-redis")
WORKER_ROLES = ("prefill", "decode", "mixed")


def shape_of(scenario: str) -> str:
    """The cluster a scenario runs on: ``mixed`` (2 mixed workers) for the mixed
    worker's kill, ``hosts`` (2 prefill + 2 decode over test hosts) for the network
    faults, ``disagg`` (2 prefill + 2 decode on loopback) for the rest; two routers
    each."""
    if scenario in NETWORK:
        return "hosts"
    return "mixed" if scenario == "kill-mixed" else "disagg"


@dataclass
class Fault:
    scenario: str
    victim: str
    at_s: float  # since the load's start (a kill: the moment of the signal)
    note: str = ""
    restored_s: float | None = None  # a kill: until whole again (:func:`wait_restored`)


def victim_of(cluster: ChaosTarget, scenario: str, k: int) -> str:
    """The ``k``-th fault's victim: round robin over the components of its type."""
    if scenario in REDIS_FAULTS:
        return "redis"
    if scenario in NETWORK:
        return KV_VICTIM
    kind = scenario.split("-", 1)[1]
    names = [c.name for c in cluster.components() if c.role == kind]
    if not names:
        raise ValueError(f"{scenario}: the cluster has no {kind} component")
    return names[k % len(names)]


def _worker_load(address: str) -> worker_pb2.WorkerLoad | None:
    try:
        with grpc.insecure_channel(address) as ch:
            return worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(),
                                                          timeout=1)
    except grpc.RpcError:
        return None


def component_of(cluster: ChaosTarget, name: str) -> Component:
    found = [c for c in cluster.components() if c.name == name]
    if not found:
        raise ValueError(f"the cluster has no component {name!r}")
    return found[0]


def _wait_busy(cluster: ChaosTarget, name: str, within_s: float = 2.0) -> bool:
    victim = component_of(cluster, name)
    address = victim.address if victim.role in WORKER_ROLES else None
    if address is None:
        return True
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        load = _worker_load(address)
        if load is not None and (load.running_requests or load.reserved_requests):
            return True
        time.sleep(0.01)
    return False


async def inject(cluster: ChaosTarget, scenario: str, victim: str,
                 rng: random.Random, stop_s: tuple[float, float]) -> str:
    """Do the fault; returns a note (how long a stop lasted, a kill that found its
    victim idle). Runs beside the load, on its event loop."""
    if scenario in KILLS:
        busy = await asyncio.to_thread(_wait_busy, cluster, victim)
        now = await asyncio.to_thread(component_of, cluster, victim)
        if now.running and now.pid is not None:  # already gone: nothing (Popen's rule)
            os.kill(now.pid, signal.SIGKILL)
        return "" if busy else "victim was idle"
    if scenario in STOPS:
        seconds = round(rng.uniform(*stop_s), 1)
        pid = (await asyncio.to_thread(component_of, cluster, victim)).pid
        if pid is None:
            return "victim had no process to stop"
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        return f"stopped {seconds} s"
    if scenario in NETWORK:
        seconds = round(rng.uniform(*stop_s), 1)
        host = cast(HostsTarget, cluster).link(victim)
        dropped = _dropped(host)
        await asyncio.to_thread(_impair, host, scenario, True)
        try:
            await asyncio.sleep(seconds)
        finally:
            await asyncio.to_thread(_impair, host, scenario, False)
        return f"impaired {seconds} s, {_dropped(host) - dropped} frames dropped"
    if scenario == "flush-redis":
        client = connect(cluster.redis_url)
        try:
            await asyncio.to_thread(client.flushall)
        finally:
            client.close()
    return ""


def _dropped(host: Host) -> int:
    """Frames the host's emulated link dropped so far (0 without one)."""
    return host.link.counters()["dropped"] if host.link is not None else 0


def _impair(host: Host, scenario: str, on: bool) -> None:
    """Put a network scenario's impairment on ``host``'s link, or take it off."""
    if scenario == "partition-kv":
        host.cut(on)
    elif not on:
        host.shape()
    elif scenario == "delay-kv":
        host.shape(delay_ms=DELAY_MS, jitter_ms=JITTER_MS)
    elif scenario == "slow-redis":
        host.shape(delay_ms=REDIS_DELAY_MS, jitter_ms=JITTER_MS)
    else:
        host.shape(loss=LOSS)


def wait_whole(cluster: ChaosTarget, timeout_s: float = 180.0) -> float:
    """Until every component runs and every router lists every worker as serving;
    returns how long that took. Raises TimeoutError naming what is missing."""
    start = time.monotonic()
    deadline = start + timeout_s
    missing: list[str] = []
    while time.monotonic() < deadline:
        if cluster.gave_up is not None:
            raise RuntimeError(f"supervision gave up: {cluster.gave_up}")
        missing = _missing(cluster, cluster.components())
        if not missing:
            return time.monotonic() - start
        time.sleep(0.25)
    raise TimeoutError(f"the cluster is not whole after {timeout_s:.0f} s: {missing}")


def _missing(cluster: ChaosTarget, components: list[Component]) -> list[str]:
    """What keeps the cluster from being whole: components not running, else workers
    some router does not list as serving ([]: whole)."""
    missing = [c.name for c in components if not c.running]
    return missing or _unlisted(cluster, [c.address for c in components
                                          if c.role in WORKER_ROLES])


def wait_restored(cluster: ChaosTarget, victim: str, restarts_before: int,
                  timeout_s: float = 120.0) -> float | None:
    """After a kill: seconds until ``victim`` was started again (its restart count
    passed ``restarts_before``) and the cluster is whole (:func:`wait_whole`); None if
    that took longer than ``timeout_s``. Blocking; polls every 0.1 s."""
    start = time.monotonic()
    deadline = start + timeout_s
    while time.monotonic() < deadline:
        if cluster.gave_up is not None:
            return None
        components = cluster.components()
        if (any(c.name == victim and c.restarts > restarts_before for c in components)
                and not _missing(cluster, components)):
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def _unlisted(cluster: ChaosTarget, workers: list[str]) -> list[str]:
    out = []
    for target in cluster.targets:
        try:
            with Client(target) as client:
                serving = {w.address for w in client.status(timeout=2).workers if w.serving}
        except grpc.RpcError:
            out.append(target)
            continue
        out += [f"{a} (at {target})" for a in workers if a not in serving]
    return out


def leaked_blocks(cluster: ChaosTarget, timeout_s: float = 30.0) -> tuple[int, str]:
    """KV blocks not free once the cluster is idle (0: none leaked), and the busy
    workers' rows when it never got idle."""
    deadline = time.monotonic() + timeout_s
    while True:
        with Client(cluster.target) as client:
            status = client.status()
        busy = busy_workers(status)
        if not busy and status.requests_in_flight == 0:
            return 0, ""
        if time.monotonic() > deadline:
            return (sum(w.total_blocks - w.free_blocks for w in busy),
                    "; ".join(map(describe_busy, busy)))
        time.sleep(0.1)
