"""Publishes one worker's KV block events to the shared prefix index in Redis.

Lifecycle: the engine calls ``on_blocks_stored`` / ``on_blocks_evicted`` on its own
thread (a :class:`~workers.engine.block_manager.KVEventListener`); they only queue.
A publisher thread drains the queue, folds the events into a mirror of the blocks this
worker holds, and writes the net change of each batch in one MULTI/EXEC (so events of a
block stored and evicted within one batch cancel, in order). When Redis fails, the
mirror keeps the truth and the thread retries every ``retry_s``; once Redis answers
again it replaces this worker's entries with the whole mirror, and the index converges.
``close`` stops the thread; the registry, not the publisher, purges a dead worker.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import redis

from common.prefix_index import RedisPrefixIndex

log = logging.getLogger(__name__)

_STOP = object()


class KVEventPublisher:
    def __init__(self, index: RedisPrefixIndex, worker_id: str, retry_s: float = 0.5) -> None:
        self.index, self.worker_id, self.retry_s = index, worker_id, retry_s
        self._events: queue.Queue = queue.Queue()
        self._held: set[int] = set()
        self._resync = True  # the first write replaces whatever an earlier life left
        self._cond = threading.Condition()
        self._queued = 0  # events put so far
        self._written = 0  # of those, how many are in Redis
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-publisher")
        self._thread.start()

    # -- engine thread -------------------------------------------------------------------

    def on_blocks_stored(self, block_hashes: list[int]) -> None:
        self._put(True, list(block_hashes))

    def on_blocks_evicted(self, block_hashes: list[int]) -> None:
        self._put(False, list(block_hashes))

    def _put(self, stored: bool | None, hashes: list[int]) -> None:
        with self._cond:
            self._queued += 1
            self._events.put((self._queued, stored, hashes))

    # -- any thread ----------------------------------------------------------------------

    def resync(self) -> None:
        """Rewrite this worker's whole state at the next chance (e.g. re-registered)."""
        self._resync = True
        self._put(None, [])

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far is in Redis; False on timeout."""
        with self._cond:
            target = self._queued
            return self._cond.wait_for(lambda: self._written >= target, timeout)

    def close(self) -> None:
        self._events.put(_STOP)
        self._thread.join(timeout=5)

    # -- publisher thread ----------------------------------------------------------------

    def _run(self) -> None:
        touched: set[int] = set()
        seen = 0  # the newest event folded into the mirror
        while True:
            try:
                item = self._events.get(timeout=self.retry_s if touched or self._resync
                                        else None)
            except queue.Empty:
                item = None
            items = [item]
            while True:  # take everything already queued: one batch, one transaction
                try:
                    items.append(self._events.get_nowait())
                except queue.Empty:
                    break
            for it in items:
                if it is _STOP:
                    return
                if it is None:
                    continue
                seen, stored, hashes = it
                if stored is None:
                    continue
                touched.update(hashes)
                if stored:
                    self._held.update(hashes)
                else:
                    self._held.difference_update(hashes)
            try:
                if self._resync:
                    self.index.replace(self.worker_id, self._held)
                    self._resync = False
                elif touched:
                    self.index.publish(self.worker_id, touched & self._held,
                                       touched - self._held)
                touched = set()
            except redis.RedisError as e:
                if not self._resync:
                    log.warning("prefix index unreachable (%s); publishing the whole state "
                                "once it is back", e)
                self._resync = True
                touched = set()
                time.sleep(self.retry_s)
                continue
            with self._cond:  # a resync also covers events of failed batches
                self._written = max(self._written, seen)
                self._cond.notify_all()
