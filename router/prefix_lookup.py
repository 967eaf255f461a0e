"""Which worker already holds how much of a prompt: the one place the router asks.

One index, built from the pieces of :mod:`common.prefix_index`:

    LayeredIndex(MemoryPrefixIndex(ttl_s=30),        # what this router just routed where
                 FailSoftIndex(InstrumentedIndex(RedisPrefixIndex)))   # what workers published

A lookup is, per worker, the larger of the two counts of leading blocks. The routed
memory covers the seconds before a worker has computed and published a prefix (a burst
of requests sharing one would otherwise all miss); the shared index in Redis covers
everything published, by any router's traffic. The Redis lookup blocks, so it runs in a
thread.

Redis being down never fails a request: :class:`~common.prefix_index.FailSoftIndex`
answers ``{}`` and asks Redis again no sooner than ``retry_s`` later, and the lookup
answers from the routed memory alone. Redis being *slow* does not hold requests either:
a lookup that has not answered within ``budget_s`` is answered from the routed memory
(a Redis call under way finishes in its thread, unread), and Redis is not asked again for
``retry_s`` (``prefix_index_slow_total`` counts each time): a slowed Redis costs one
request a second at most ``budget_s``, not every request its round trip.

:meth:`note_redis` is the router's one view of Redis health: the pool's registry reads
report to it too, it logs only the changes, and ``GetStatus`` shows it as
``prefix_index_up``.

Runs on the router's event loop (the Redis part in a worker thread).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from common.metrics import Metrics
from common.prefix_index import (
    FailSoftIndex,
    InstrumentedIndex,
    LayeredIndex,
    MemoryPrefixIndex,
    PrefixIndexBackend,
)

log = logging.getLogger(__name__)

ROUTED_TTL_S = 30.0
"""How long the router credits a worker with a prefix it sent there, unpublished."""


class PrefixLookup:
    def __init__(self, index: PrefixIndexBackend | None, metrics: Metrics | None = None,
                 *, retry_s: float = 1.0, routed_ttl_s: float = ROUTED_TTL_S,
                 budget_s: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        """``index``: the shared (remote, blocking) index, or None (routed memory only);
        ``metrics``: counts its lookups (``prefix_index_*``, backend ``shared``);
        ``budget_s``: the longest a request waits for the shared index (0: no limit)."""
        self.metrics = metrics
        self.budget_s, self.retry_s, self.clock = budget_s, retry_s, clock
        self._slow_until = 0.0
        self.routed = MemoryPrefixIndex(ttl_s=routed_ttl_s, clock=clock)
        self.shared: FailSoftIndex | None = None
        if index is not None:
            if metrics is not None:
                index = InstrumentedIndex(index, metrics, backend="shared")
            self.shared = FailSoftIndex(index, on_change=self.note_redis,
                                        retry_after_s=retry_s, clock=clock)
        self.index = LayeredIndex(self.routed, *([self.shared] if self.shared else []))
        self._redis_down = False

    @property
    def up(self) -> bool:
        """A shared index is configured and Redis answered last time it was asked."""
        return self.shared is not None and not self._redis_down

    async def lookup(self, hashes: list[int]) -> dict[str, int]:
        """Per worker address, how many leading blocks of ``hashes`` it holds (absent:
        none). Never raises for Redis."""
        if self.shared is None or self.clock() < self._slow_until:
            return (self.index if self.shared is None else self.routed).lookup(hashes)
        try:
            found = await asyncio.wait_for(asyncio.to_thread(self.index.lookup, hashes),
                                           self.budget_s or None)
        except asyncio.TimeoutError:  # not the builtin on 3.10
            self._slow_until = self.clock() + self.retry_s
            if self.metrics is not None:
                self.metrics.inc("prefix_index_slow_total")
            log.info("prefix index lookup took over %.0f ms: routing from this router's "
                     "memory for %.1f s", self.budget_s * 1000, self.retry_s)
            return self.routed.lookup(hashes)
        if self.shared.up and self._redis_down:
            self.note_redis(None)  # a lookup worked: clears an outage the registry reported
        return found

    def note_routed(self, hashes: list[int], worker: str) -> None:
        """This router just sent the prompt of ``hashes`` to ``worker``."""
        self.index.publish(worker, stored=hashes)  # the routed memory, LayeredIndex's primary

    def note_redis(self, error: Exception | None) -> None:
        """Redis answered (None) or failed (the error); logs only the changes. Called
        from the event loop (registry reads) and the lookup's thread (a plain flag)."""
        if error is not None and not self._redis_down:
            log.warning("prefix index / registry unreachable (%s): routing by load until it "
                        "is back", error)
        elif error is None and self._redis_down:
            log.info("prefix index / registry reachable again")
        self._redis_down = error is not None
