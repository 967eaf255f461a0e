"""The in-process backend of the prefix index: one process's own view, no I/O.

Two uses. Tests and single-process tools use it as the index itself (``ttl_s=None``:
entries live until evicted or purged). A router uses it to remember where it just *sent*
each prefix (``ttl_s=30``): the shared index only learns a prefix once a worker has
computed it, and requests for the same prefix arriving meanwhile would all miss it (the
approximate tree of SGLang's router does the same job).

Each (block, worker) entry carries its own expiry, ``clock() + ttl_s`` when last
published; an expired entry counts for nothing. The map is bounded by ``max_blocks``:
a publish that grows it past the bound prunes it, dropping expired entries and then, if
still too many, the blocks first inserted. Dropping a live entry only costs a cache miss.
"""

from __future__ import annotations

import math
import operator
import threading
import time
from collections.abc import Callable, Iterable, Sequence


class MemoryPrefixIndex:
    """A :class:`~.interface.PrefixIndexBackend` in a dict: never blocks beyond a short
    lock, never raises, thread-safe. One instance per model (no namespacing inside)."""

    def __init__(self, ttl_s: float | None = None, max_blocks: int = 200_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive seconds or None (never expire), "
                             f"got {ttl_s!r}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, got {max_blocks!r}")
        self.ttl_s, self.max_blocks, self.clock = ttl_s, max_blocks, clock
        self._lock = threading.Lock()
        # Insertion order is the pruning order: a re-published block keeps its place.
        self._blocks: dict[int, dict[str, float]] = {}  # hash -> worker -> expiry
        self._held: dict[str, set[int]] = {}  # worker -> hashes (some maybe expired)

    def __len__(self) -> int:
        """Blocks in the map, expired ones not yet pruned included (the bound's measure)."""
        return len(self._blocks)

    # -- writers -------------------------------------------------------------------------

    def publish(self, worker: str, stored: Iterable[int] = (),
                evicted: Iterable[int] = ()) -> None:
        """Store (or refresh the expiry of) ``stored``, then drop ``evicted``."""
        now = self.clock()
        with self._lock:
            self._publish(worker, stored, evicted, now)

    def purge(self, worker: str) -> int:
        """Forget every block of ``worker``; returns how many it held unexpired."""
        now = self.clock()
        with self._lock:
            return self._purge(worker, now)

    def replace(self, worker: str, held: Iterable[int]) -> None:
        """Purge, then publish ``held``; atomic to a concurrent ``lookup``."""
        now = self.clock()
        with self._lock:
            self._purge(worker, now)
            self._publish(worker, held, (), now)

    # -- readers -------------------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker, its leading blocks of ``block_hashes`` among unexpired entries.

        On the router's path for every request, so the work per block runs in C: while
        several workers are in the running, one subset test and one ``min`` per block
        (Python looks at each worker only at the block where it drops out); once one is
        left (the usual case: a prefix is routed to one worker), its run is found by a
        scan over its own set of hashes."""
        if not block_hashes:
            return {}
        now = self.clock()
        counts: dict[str, int] = {}
        with self._lock:
            blocks = self._blocks
            alive = {w for w, t in blocks.get(block_hashes[0], {}).items() if t > now}
            i = 1
            while len(alive) > 1 and i < len(block_hashes):
                holders = blocks.get(block_hashes[i])
                if holders is None:
                    break
                if not (holders.keys() >= alive and min(holders.values()) > now):
                    kept = {w for w in alive if holders.get(w, now) > now}
                    for w in alive - kept:
                        counts[w] = i
                    alive = kept
                i += 1
            for w in alive:
                counts[w] = i + self._run(w, block_hashes[i:], now)
        return counts

    def _run(self, worker: str, block_hashes: Sequence[int], now: float) -> int:
        """How many leading blocks of ``block_hashes`` ``worker`` holds unexpired; scans
        in C (it is called under the lock)."""
        held = self._held.get(worker, ())
        try:
            run = list(map(held.__contains__, block_hashes)).index(False)
        except ValueError:
            run = len(block_hashes)
        expiry = operator.itemgetter(worker)
        if run and min(map(expiry, map(self._blocks.__getitem__, block_hashes[:run]))) <= now:
            run = next(j for j, h in enumerate(block_hashes) if self._blocks[h][worker] <= now)
        return run

    def blocks_of(self, worker: str) -> set[int]:
        now = self.clock()
        with self._lock:
            return {h for h in self._held.get(worker, ()) if self._blocks[h][worker] > now}

    # -- under the lock ------------------------------------------------------------------

    def _publish(self, worker: str, stored: Iterable[int], evicted: Iterable[int],
                 now: float) -> None:
        until = math.inf if self.ttl_s is None else now + self.ttl_s
        held = self._held.setdefault(worker, set())
        for h in stored:
            self._blocks.setdefault(h, {})[worker] = until
            held.add(h)
        for h in evicted:
            holders = self._blocks.get(h)
            if holders is not None and holders.pop(worker, None) is not None:
                held.discard(h)
                if not holders:
                    del self._blocks[h]
        if not held:
            del self._held[worker]
        if len(self._blocks) > self.max_blocks:
            self._prune(now)

    def _purge(self, worker: str, now: float) -> int:
        live = 0
        for h in self._held.pop(worker, ()):
            holders = self._blocks[h]
            live += holders.pop(worker) > now
            if not holders:
                del self._blocks[h]
        return live

    def _prune(self, now: float) -> None:
        for h in list(self._blocks):
            holders = self._blocks[h]
            for w in [w for w, t in holders.items() if t <= now]:
                del holders[w]
                self._forget(w, h)
            if not holders:
                del self._blocks[h]
        while len(self._blocks) > self.max_blocks:  # still too many: the oldest go
            h = next(iter(self._blocks))
            for w in self._blocks.pop(h):
                self._forget(w, h)

    def _forget(self, worker: str, h: int) -> None:
        held = self._held[worker]
        held.discard(h)
        if not held:
            del self._held[worker]
