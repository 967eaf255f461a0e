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
not after the TTL.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis

from common.redis_url import connect
from common.registry import WorkerInfo, WorkerRegistry

from .kv_publisher import KVEventPublisher

log = logging.getLogger(__name__)


class Presence:
    def __init__(self, url: str, model: str, worker_id: str, ttl_s: float = 3.0) -> None:
        self.client = connect(url, socket_timeout=2, socket_connect_timeout=2)
        self.registry = WorkerRegistry(self.client, model)
        self.publisher = KVEventPublisher(self.registry.index, worker_id)
        self.worker_id, self.ttl_s = worker_id, ttl_s

    async def run(self, info: WorkerInfo, load: Callable[[], dict], stop: asyncio.Event,
                  serving: Callable[[], bool] = lambda: True) -> None:
        registered, warned = False, False
        while not stop.is_set():
            try:
                if not serving():
                    if registered:
                        registered = False
                        log.warning("the engine no longer serves: leaving the registry")
                        await asyncio.to_thread(self.registry.deregister, self.worker_id)
                elif not registered:
                    await asyncio.to_thread(self.registry.register, info, load(), self.ttl_s)
                    self.publisher.resync()
                    registered = True
                    log.info("registered as %s in the worker registry", self.worker_id)
                elif not await asyncio.to_thread(self.registry.heartbeat, self.worker_id,
                                                 load(), self.ttl_s):
                    registered = False  # expired or purged: register again at once
                    continue
                warned = False
            except redis.RedisError as e:
                if not warned:
                    log.warning("worker registry unreachable (%s); serving on, retrying", e)
                registered, warned = False, True
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.ttl_s / 3)
            except TimeoutError:
                pass

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
