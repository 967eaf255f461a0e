"""Where a prefill worker may send KV: the decode workers the registry lists.

A ``Prefill`` call names its decode target (the decode worker's KV receiver,
``HOST:PORT``). Without a check any caller could have a prefill worker compute a prompt
and push its KV to an address of the caller's choosing. So a prefill worker with a
registry computes nothing and sends nothing for a target that no live decode worker
registered as its ``kv_address``.

A Prefill to a known address never waits for the registry: the view is refreshed in the
background once it is older than ``refresh_s``. An address not in the view waits for a read
that began after it was asked for (at most one read every ``miss_refresh_s``, shared by
the misses waiting meanwhile): a decode worker that joined a moment ago is found on its
first request, even when a read was already in flight. An address stays
allowed for ``grace_s`` after it was last listed: a draining decode worker leaves the
registry while it still serves what was routed to it, and a registry outage must not
fail every transfer at once. While the registry does not answer, the last view holds
(unknown addresses stay refused; known ones expire after ``grace_s``).

Runs on the server's event loop (the registry read goes to a thread); not thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from common.registry import LiveWorker

log = logging.getLogger(__name__)


class KVTargets:
    def __init__(self, live: Callable[[], list[LiveWorker]], refresh_s: float = 1.0,
                 miss_refresh_s: float = 0.2, grace_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._live, self._clock = live, clock
        self.refresh_s, self.miss_refresh_s, self.grace_s = refresh_s, miss_refresh_s, grace_s
        self._seen: dict[str, float] = {}  # kv address -> when last listed
        self._attempted = float("-inf")  # the last registry read (answered or not)
        self._lock = asyncio.Lock()
        self._background: asyncio.Task | None = None
        self._warned = False

    def _listed(self, address: str) -> bool:
        seen = self._seen.get(address)
        return seen is not None and self._clock() - seen <= self.grace_s

    async def allowed(self, address: str) -> bool:
        """Whether a live (or lately listed) decode worker registered ``address``. Waits
        for the registry (one round trip, off the event loop) only for an address it
        does not know: for a read that began after this call did (a read already in
        flight may predate the worker's registration), no sooner than ``miss_refresh_s``
        after the previous one, shared by the misses waiting meanwhile."""
        if self._listed(address):
            since = self._clock() - self._attempted
            if since > self.refresh_s and (self._background is None
                                           or self._background.done()):
                self._background = asyncio.create_task(self.refresh())
            return True
        arrived = self._clock()
        async with self._lock:  # behind a read in flight, which may list it
            if not self._listed(address) and self._attempted < arrived:
                wait = self._attempted + self.miss_refresh_s - self._clock()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._read()
        return self._listed(address)

    async def refresh(self) -> None:
        """Read the registry once (unless another read has just been made)."""
        async with self._lock:
            if self._clock() - self._attempted > self.miss_refresh_s:
                await self._read()

    async def _read(self) -> None:
        """One registry read; the caller holds the lock."""
        self._attempted = self._clock()
        try:
            entries = await asyncio.to_thread(self._live)
        except Exception as e:  # noqa: BLE001 - Redis down: keep the last view
            if not self._warned:
                log.warning("worker registry unreachable (%s); KV targets are checked "
                            "against the last view", e)
                self._warned = True
            return
        self._warned = False
        now = self._clock()
        for w in entries:
            if w.info.role == "decode" and w.info.kv_address:
                self._seen[w.info.kv_address] = now
        for address, seen in list(self._seen.items()):
            if now - seen > self.grace_s:
                del self._seen[address]
