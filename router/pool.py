"""The worker pool: which workers the router can send a request to, and how busy each is.

Lifecycle of a worker, as the router sees it:

1. **connect**: ``connect(address)`` gives a channel and a ``Worker`` stub; the pool
   calls ``GetLoad`` until it answers (loading a model takes a while, so it retries
   until ``connect_timeout_s``) and learns the worker's role, block size, model id and
   context limit. The router serves the smallest ``max_model_len`` of its workers.
2. **serving**: in its role's pool. ``in_flight`` and ``queued_tokens`` count this
   router's calls there (the dispatcher moves them); ``free_blocks`` comes from the
   registry heartbeat and breaks ties.
3. **down** for ``down_s`` after a call failed for the worker's sake (not the
   request's), or while it stalls (:mod:`router.stall`: it held a call and did not
   answer a probe; back in service at its first answer): still a candidate, but
   ordered last, so a request reaches it only when every worker of its role is down.
4. **gone**, for a worker found in the registry whose heartbeat expired: no new
   requests; it comes back if its heartbeat does. One that went while down (stopped,
   dead: its heartbeat lapsed) is **lost** until then, unlike one that drained (it
   leaves the registry while up): the pool is short of it (the overflow,
   :mod:`router.dispatch`), and still for ``down_s`` once it is back, while it
   warms an empty cache (as does a worker that joins while the router serves: a
   restarted Ray actor comes back on a new port). Workers given on the command line
   (static) never leave, unless they register too: once listed, the registry speaks
   for them as for the others (a draining worker leaves it first).
5. **retired**: a gone worker found in the registry (not static) leaves the pool, and
   ``pdserve status``, once nothing of this router's runs there and either a worker of
   its role joined after it went (its replacement: a restarted Ray actor comes back on
   a new port) or it has been gone ``retire_after_s``. Should it register again, it
   joins anew.

A worker's role is what the registry lists: one that changed its role in place
(``SetRole``, :mod:`workers.roles`: it leaves, drains and registers again) moves to its
new role's pool on the next read, its channel and stub kept.

Discovery: with a registry, :meth:`WorkerPool.start` joins every live worker and then
re-reads the registry every ``discovery_interval_s``. A registry read that fails is
reported to ``on_redis`` (the router keeps one view of whether Redis answers, shared
with the prefix lookup) and skipped: the pool keeps what it knew. When the registry
comes back empty (Redis restarted or flushed: the pool's own marker key is gone,
:meth:`~common.registry.WorkerRegistry.emptied`), workers missing from it are not gone:
they register again within a heartbeat, and marking them gone would refuse every
request meanwhile; they stay for ``reset_grace_s``.

Everything here runs on the router's event loop; nothing is thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import redis

from common.metrics import Metrics
from common.registry import LiveWorker
from common.tls import ClusterTLS
from common.wire import KEEPALIVE_CHANNEL, MAX_MESSAGE_BYTES
from protos.pdserve.v1 import api_pb2, worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    from .config import RouterConfig

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "mixed")


class ChannelLike(Protocol):
    async def close(self) -> None: ...


class RegistryLike(Protocol):
    """What the pool reads of :class:`common.registry.WorkerRegistry`. ``live`` blocks
    (one Redis round trip): the pool calls it from a thread."""

    def live(self) -> list[LiveWorker]: ...

    def emptied(self, reader: str) -> bool: ...


Connect = Callable[[str], tuple[ChannelLike, Any]]
"""``connect(address) -> (channel, stub)``; the stub has the ``Worker`` service's
methods with grpc.aio's call semantics (see :func:`grpc_connect`)."""


def grpc_connect(address: str, tls: ClusterTLS | None = None
                 ) -> tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerStub]:
    """Production wiring: a grpc.aio channel and the generated stub; messages bounded as
    on the workers. With ``tls``, mutual TLS: the router presents the cluster
    certificate and accepts only a worker whose certificate the cluster CA signed for
    the cluster name (whatever address it was dialled at); else plaintext (workers on a
    private network, or loopback)."""
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), *KEEPALIVE_CHANNEL]
    if tls is None:
        channel = grpc.aio.insecure_channel(address, options=options)
    else:
        channel = grpc.aio.secure_channel(address, tls.channel_credentials(),
                                          options=options + tls.channel_options())
    return channel, worker_pb2_grpc.WorkerStub(channel)


@dataclass
class Worker:
    address: str
    channel: ChannelLike
    stub: worker_pb2_grpc.WorkerStub
    role: str = "mixed"
    in_flight: int = 0
    queued_tokens: int = 0  # prompt tokens sent here whose first token has not come
    context_tokens: int = 0  # decode: prompt + generated tokens of this router's streams
    down_until: float = 0.0
    block_size: int = 16
    model_id: str = ""
    free_blocks: int = 0  # last reported (registry heartbeat); breaks in-flight ties
    static: bool = True  # given on the command line; False: found in the registry
    gone: bool = False  # left the registry: no new requests
    lost: bool = False  # gone while down (its heartbeat lapsed: stopped, dead), not drained
    warm_until: float = 0.0  # back from lost, or joined while serving: cold cache until
    listed: bool = False  # seen in the registry: it decides gone and role from then on
    since: float = 0.0  # when it joined the pool, or (gone) when it left the registry


class WorkerPool:
    def __init__(self, config: RouterConfig, metrics: Metrics, *,
                 connect: Connect = grpc_connect, registry: RegistryLike | None = None,
                 on_redis: Callable[[Exception | None], None] = lambda e: None) -> None:
        self.config = config
        self.metrics = metrics
        self.registry = registry
        self.max_model_len = 0
        self.workers: list[Worker] = []
        self._connect_fn = connect
        self._on_redis = on_redis
        self._discovery: asyncio.Task | None = None
        self._reset_since: float | None = None  # when the registry came back empty
        self._read_once = False
        self.reader = uuid.uuid4().hex[:12]  # this pool's marker in the registry

    def serving(self, role: str) -> list[Worker]:
        """The role's workers that take new requests (down ones included)."""
        return [w for w in self.workers if w.role == role and not w.gone]

    @property
    def disaggregated(self) -> bool:
        return bool(self.serving("prefill")) and bool(self.serving("decode"))

    def by_load(self, role: str) -> list[Worker]:
        """Least-loaded first; workers that failed lately go last."""
        now = time.monotonic()
        return sorted(self.serving(role),
                      key=lambda w: (w.down_until > now, w.in_flight, -w.free_blocks))

    def mark_down(self, worker: Worker, at_least_s: float = 0.0) -> None:
        worker.down_until = time.monotonic() + max(self.config.down_s, at_least_s)

    def short(self, role: str, accept: Callable[[Worker], bool]) -> bool:
        """Whether ``role`` is short of a worker ``accept`` takes: one down now (failed,
        stalled), lost (gone while down) and not yet retired, or back from lost (or
        joined while serving) less than ``down_s`` ago."""
        now = time.monotonic()
        return any(w.down_until > now or w.lost or w.warm_until > now for w in self.workers
                   if w.role == role and accept(w))

    def mark_up(self, worker: Worker) -> None:
        """In service again at once (a stalled worker that answers again)."""
        worker.down_until = 0.0

    def failed(self, worker: Worker, e: grpc.aio.AioRpcError) -> None:
        self.mark_down(worker)
        log.warning("worker %s (%s) failed: %s: %s", worker.address, worker.role,
                    e.code().name, e.details())

    def stalled(self, worker: Worker) -> None:
        """``worker`` holds calls but does not answer (:mod:`router.stall`): down."""
        self.mark_down(worker)
        self.metrics.inc("worker_stalls_total", worker=worker.address)
        log.warning("worker %s (%s) is stalled: it holds calls but did not answer a probe "
                    "within %.1f s; passing it over until it answers%s", worker.address,
                    worker.role, self.config.stall_probe_timeout_s,
                    ", its prompts computed on the decode workers"
                    if worker.role == "prefill" else "")

    # -- joining and leaving ---------------------------------------------------------------

    async def start(self) -> None:
        """Connect to every worker given and found in the registry, and wait until each
        answers (loading takes a while) and the pools can serve."""
        deadline = time.monotonic() + self.config.connect_timeout_s
        for address in self.config.workers:
            self.workers.append(await self._connect(address, True, deadline))
        while True:
            await self.discover(deadline)
            if self.disaggregated or self.serving("mixed"):
                break
            if self.registry is None or time.monotonic() > deadline:
                roles = sorted({w.role for w in self.workers})
                raise RuntimeError(f"workers with roles {roles} cannot serve alone: give the "
                                   "router prefill and decode workers, or mixed ones")
            await asyncio.sleep(0.5)
        self._count()
        if self.registry is not None:
            self._discovery = asyncio.create_task(self._discover_forever())

    async def _connect(self, address: str, static: bool, deadline: float) -> Worker:
        channel, stub = self._connect_fn(address)
        while True:
            try:
                load = await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
                break
            except grpc.aio.AioRpcError as e:
                if time.monotonic() > deadline:
                    await channel.close()
                    raise RuntimeError(f"worker {address} did not answer within "
                                       f"{self.config.connect_timeout_s:.0f}s: "
                                       f"{e.details()}") from e
                await asyncio.sleep(0.5)
        limit = load.max_model_len
        self.max_model_len = min(self.max_model_len, limit) if self.max_model_len else limit
        return Worker(address, channel, stub, role=load.role or "mixed",
                      block_size=load.block_size or 16, model_id=load.model_id, static=static,
                      since=time.monotonic())

    async def discover(self, deadline: float | None = None) -> None:
        """Join workers new in the registry; retire those whose heartbeat expired."""
        if self.registry is None:
            return
        try:
            entries, emptied = await asyncio.to_thread(self._read, self.registry)
        except redis.RedisError as e:
            self._on_redis(e)
            return
        self._on_redis(None)
        live = {w.info.address for w in entries}
        known = {w.address: w for w in self.workers}
        for entry in entries:
            w = known.get(entry.info.address)
            if w is None:
                continue
            w.free_blocks, w.listed = int(entry.load.get("free_blocks", 0)), True
            if entry.info.role != w.role:  # changed in place: same process, same stub
                log.info("worker %s is %s now (was %s)", w.address, entry.info.role, w.role)
                w.role, w.down_until = entry.info.role, 0.0
        for address in sorted(live - known.keys()):
            try:
                w = await self._connect(address, False, deadline or time.monotonic() + 10)
                if self._discovery is not None:  # serving: it joins with a cold cache
                    w.warm_until = w.since + self.config.down_s
                self.workers.append(w)
                log.info("worker %s joined from the registry", address)
            except RuntimeError as e:
                log.warning("registry lists %s but it does not answer: %s", address, e)
        now = time.monotonic()
        if emptied:
            self._reset_since = now
            log.warning("the registry came back empty (Redis restarted or flushed): "
                        "workers missing from it stay for up to %.0f s while they register "
                        "again", self.config.reset_grace_s)
        in_grace = (self._reset_since is not None
                    and now - self._reset_since < self.config.reset_grace_s)
        for w in self.workers:
            if in_grace and not w.gone and w.address not in live:
                continue
            if (w.listed or not w.static) and w.gone == (w.address in live):
                if w.gone and w.lost:  # it was lost and is back, with a cold cache
                    w.warm_until = now + self.config.down_s
                w.gone, w.since = w.address not in live, now
                w.lost = w.gone and w.down_until > now
                log.info("worker %s %s the registry", w.address,
                         "left" if w.gone else "rejoined")
        await self._retire(now)
        self._count()

    async def _retire(self, now: float) -> None:
        """Drop gone workers found in the registry once replaced or long gone (step 5
        of the module docstring); static ones stay (the command line named them)."""
        def replaced(w: Worker) -> bool:
            return any(o.role == w.role and not o.gone and o.since > w.since
                       for o in self.workers)

        retired = [w for w in self.workers
                   if w.gone and not w.static and w.in_flight == 0
                   and (replaced(w) or now - w.since >= self.config.retire_after_s)]
        for w in retired:
            self.workers.remove(w)
            log.info("worker %s (%s) retired from the pool", w.address, w.role)
            await w.channel.close()

    def _read(self, registry: RegistryLike) -> tuple[list[LiveWorker], bool]:
        """The live entries, and whether Redis lost the registry since the last read
        (never on the first: nothing was known then)."""
        emptied = registry.emptied(self.reader)
        first, self._read_once = not self._read_once, True
        return registry.live(), emptied and not first

    async def _discover_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.discovery_interval_s)
            await self.discover()

    def _count(self) -> None:
        for role in ROLES:
            self.metrics.set("workers", len(self.serving(role)), role=role)

    async def close(self) -> None:
        if self._discovery is not None:
            self._discovery.cancel()
        for w in self.workers:
            await w.channel.close()

    # -- status -----------------------------------------------------------------------------

    async def statuses(self) -> list[api_pb2.WorkerStatus]:
        """Every known worker's own report (``GetLoad``, all at once); ``serving=False``
        for one that does not answer within 2 s."""
        async def one(w: Worker) -> api_pb2.WorkerStatus:
            try:
                load = await w.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=2)
            except grpc.aio.AioRpcError:
                return api_pb2.WorkerStatus(address=w.address, serving=False)
            return api_pb2.WorkerStatus(
                address=w.address, role=load.role, serving=True,
                running_requests=load.running_requests,
                waiting_requests=load.waiting_requests, free_blocks=load.free_blocks,
                total_blocks=load.total_blocks, reserved_requests=load.reserved_requests,
                transfers=load.transfers, prompt_tokens=load.prompt_tokens,
                cached_prompt_tokens=load.cached_prompt_tokens)

        # At once: a worker that cannot answer (its node gone) costs 2 s, not 2 s each.
        return list(await asyncio.gather(*(one(w) for w in list(self.workers))))
