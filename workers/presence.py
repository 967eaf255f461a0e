"""A worker's presence in Redis: its registry entry, kept alive by a heartbeat, and its
KV block events, published to the shared prefix index.

Lifecycle: ``Presence(url, ...)`` connects lazily and starts the block-event publisher
(give ``presence.publisher`` to the engine as a KV listener); once the engine is up,
``run`` registers the worker (new epoch, earlier entries purged) and refreshes its TTL
every third of it with the live load, but only while ``serving()`` says the engine can
take requests: a worker whose engine failed deregisters at once (routers stop choosing
it) and heartbeats no more; should it serve again, it registers anew. If Redis goes away
the worker keeps serving; when it answers again the worker registers anew and the
publisher rewrites its whole state.
``leave`` (draining) and ``close`` deregister (best effort) so the entries go at once,
not after the TTL. A role change (:mod:`workers.roles`) steps out (``step_out``: the
entry goes, the heartbeat pauses, the publisher goes on) and back in with its new entry
(``step_in``: registered at once, a new epoch, the whole block state rewritten).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import redis

from common.redis_url import connect
from common.registry import WorkerInfo, WorkerRegistry

from .kv_publisher import KVEventPublisher

log = logging.getLogger(__name__)


class Presence:
    _running = False  # run is running: its lock orders the registry writes
    _away = False  # stepped out (a role change): the heartbeat registers nothing

    def __init__(self, url: str, model: str, worker_id: str, ttl_s: float = 3.0) -> None:
        self.client = connect(url, socket_timeout=2, socket_connect_timeout=2)
        self.registry = WorkerRegistry(self.client, model)
        self.publisher = KVEventPublisher(self.registry.index, worker_id)
        self.worker_id, self.ttl_s = worker_id, ttl_s

    async def run(self, info: WorkerInfo, load: Callable[[], dict], stop: asyncio.Event,
                  serving: Callable[[], bool] = lambda: True) -> None:
        self.info, self._load, self._serving = info, load, serving  # step_in: a new info
        self._lock = asyncio.Lock()  # one registry write at a time: a beat's, or a step's
        self._registered, self._running, warned = False, True, False
        try:
            while not stop.is_set():
                try:
                    async with self._lock:
                        again = await self._beat()
                    if again:
                        continue
                    warned = False
                except redis.RedisError as e:
                    if not warned:
                        log.warning("worker registry unreachable (%s); serving on, retrying", e)
                    self._registered, warned = False, True
                try:
                    await asyncio.wait_for(stop.wait(), timeout=self.ttl_s / 3)
                except asyncio.TimeoutError:  # not the builtin on 3.10
                    pass
        finally:
            self._running = False

    async def _beat(self) -> bool:
        """One round of ``run`` (the lock held); True: go again at once."""
        if self._away:
            return False
        if not self._serving():
            if self._registered:
                self._registered = False
                log.warning("the engine no longer serves: leaving the registry")
                await asyncio.to_thread(self.registry.deregister, self.worker_id)
        elif not self._registered:
            await self._register()
        elif not await asyncio.to_thread(self.registry.heartbeat, self.worker_id,
                                         self._load(), self.ttl_s):
            self._registered = False  # expired or purged: register again at once
            return True
        return False

    async def _register(self) -> None:
        await asyncio.to_thread(self.registry.register, self.info, self._load(), self.ttl_s)
        self.publisher.resync()
        self._registered = True
        log.info("registered as %s in the worker registry", self.worker_id)

    async def step_out(self) -> None:
        """Leave the registry until :meth:`step_in` (routers stop choosing this worker);
        the heartbeat pauses meanwhile. Best effort: if Redis fails, the TTL removes us."""
        self._away = True
        async with self._lock if self._running else contextlib.nullcontext():
            self._registered = False
            try:
                await asyncio.to_thread(self.registry.deregister, self.worker_id)
            except redis.RedisError as e:
                log.warning("could not leave the worker registry (%s); the TTL will", e)

    async def step_in(self, info: WorkerInfo) -> None:
        """Register ``info`` now (if ``run`` runs and the engine serves) and let the
        heartbeat keep it. If Redis fails, the heartbeat retries."""
        self.info, self._away = info, False
        if not self._running:
            return
        async with self._lock:
            if not self._serving():
                return
            try:
                await self._register()
            except redis.RedisError as e:
                log.warning("could not register again (%s); the heartbeat retries", e)

    def leave(self) -> None:
        """Stop publishing and deregister (draining: routers stop choosing us). Stop
        ``run`` first, or its next heartbeat registers the worker again."""
        self.publisher.close()
        try:
            self.registry.deregister(self.worker_id)
        except redis.RedisError:
            pass  # the TTL removes us anyway

    def close(self) -> None:
        self.leave()
        self.client.close()
