"""Indexes made of indexes: several read as one, a remote one that fails soft, metrics.

Each is itself a :class:`~.interface.PrefixIndexBackend`, so they stack; a router's is

    LayeredIndex(MemoryPrefixIndex(ttl_s=30),                  # where it just routed
                 FailSoftIndex(InstrumentedIndex(RedisPrefixIndex(client, model),
                                                 metrics, backend="redis"),
                               on_change=note_redis))         # what workers published
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import redis

from .interface import PrefixIndexBackend

if TYPE_CHECKING:
    from common.metrics import Metrics


class LayeredIndex:
    """Reads all its members, writes only its first.

    ``lookup`` is, per worker, the largest count any member gives (each member's leading
    run, never a run spliced from two members); it calls the members in order, so it
    blocks and raises as the slowest of them does (wrap a remote one in
    :class:`FailSoftIndex`). ``publish``, ``purge``, ``replace`` and ``blocks_of`` go to
    ``primary`` only: the others are written by their owners (workers publish to Redis;
    a router only records where it routed)."""

    def __init__(self, primary: PrefixIndexBackend, *others: PrefixIndexBackend) -> None:
        self.primary = primary
        self.members: tuple[PrefixIndexBackend, ...] = (primary, *others)

    def publish(self, worker: str, stored: Iterable[int] = (),
                evicted: Iterable[int] = ()) -> None:
        self.primary.publish(worker, stored, evicted)

    def purge(self, worker: str) -> int:
        return self.primary.purge(worker)

    def replace(self, worker: str, held: Iterable[int]) -> None:
        self.primary.replace(worker, held)

    def lookup(self, block_hashes: Sequence[int]) -> dict[str, int]:
        best: dict[str, int] = {}
        for member in self.members:
            for w, n in member.lookup(block_hashes).items():
                if n > best.get(w, 0):
                    best[w] = n
        return best

    def blocks_of(self, worker: str) -> set[int]:
        return self.primary.blocks_of(worker)


class FailSoftIndex:
    """A remote index whose unreachability costs cache hits, not requests.

    A ``lookup`` that raises one of ``errors`` answers ``{}`` (route by load) and the
    next ones answer ``{}`` without trying, for ``retry_after_s``, so a dead Redis costs
    one timeout a second rather than one per request. ``on_change(error)`` hears each
    transition, once: the error when the index goes down, ``None`` when a lookup works
    again; it runs on the thread that called ``lookup``.

    Only ``lookup`` is softened. A lost write must reach its writer (the KV publisher
    keeps a mirror and resyncs) and ``blocks_of`` is for checks that want the truth, so
    those delegate and raise. Thread-safe; blocks as ``inner`` does."""

    def __init__(self, inner: PrefixIndexBackend,
                 on_change: Callable[[Exception | None], None] | None = None,
                 retry_after_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 errors: tuple[type[Exception], ...] = (redis.RedisError,)) -> None:
        if not retry_after_s >= 0:
            raise ValueError(f"retry_after_s must be >= 0 seconds, got {retry_after_s!r}")
        self.inner, self.on_change = inner, on_change
        self.retry_after_s, self.clock, self.errors = retry_after_s, clock, errors
        self._lock = threading.Lock()
        self._up = True
        self._retry_at = 0.0

    @property
    def up(self) -> bool:
        """False from a failed lookup until one succeeds."""
        return self._up

    def lookup(self, block_hashes: Sequence[int]) -> dict[str, int]:
        if not self._up and self.clock() < self._retry_at:
            return {}
        try:
            found = self.inner.lookup(block_hashes)
        except self.errors as e:
            self._note(e)
            return {}
        self._note(None)
        return found

    def _note(self, error: Exception | None) -> None:
        with self._lock:
            if error is not None:
                self._retry_at = self.clock() + self.retry_after_s
            changed, self._up = self._up != (error is None), error is None
        if changed and self.on_change is not None:
            self.on_change(error)

    def publish(self, worker: str, stored: Iterable[int] = (),
                evicted: Iterable[int] = ()) -> None:
        self.inner.publish(worker, stored, evicted)

    def purge(self, worker: str) -> int:
        return self.inner.purge(worker)

    def replace(self, worker: str, held: Iterable[int]) -> None:
        self.inner.replace(worker, held)

    def blocks_of(self, worker: str) -> set[int]:
        return self.inner.blocks_of(worker)


class InstrumentedIndex:
    """``inner`` with counters around it (llm-d's ``instrumented_index.go``), labelled
    ``backend`` so a stack can instrument more than one layer:

    - ``prefix_index_lookups_total``, ``prefix_index_lookup_blocks_total`` (blocks asked),
      ``prefix_index_matched_blocks_total`` (the best worker's leading blocks) and
      ``prefix_index_lookup_seconds``, failed lookups' time included;
    - ``prefix_index_errors_total`` by ``op`` (the method), for any exception, re-raised.

    Behaves, blocks and raises exactly as ``inner``; thread-safe as ``inner`` is."""

    def __init__(self, inner: PrefixIndexBackend, metrics: Metrics, backend: str) -> None:
        self.inner, self.metrics, self.backend = inner, metrics, backend
        for name in ("prefix_index_lookups_total", "prefix_index_lookup_blocks_total",
                     "prefix_index_matched_blocks_total"):
            metrics.inc(name, 0, backend=backend)  # the series exist from the start
        metrics.inc("prefix_index_errors_total", 0, backend=backend, op="lookup")

    def lookup(self, block_hashes: Sequence[int]) -> dict[str, int]:
        m, b = self.metrics, self.backend
        m.inc("prefix_index_lookups_total", backend=b)
        m.inc("prefix_index_lookup_blocks_total", len(block_hashes), backend=b)
        t0 = time.perf_counter()
        try:
            with self._counting_errors("lookup"):
                found = self.inner.lookup(block_hashes)
        finally:
            m.observe("prefix_index_lookup_seconds", time.perf_counter() - t0, backend=b)
        m.inc("prefix_index_matched_blocks_total", max(found.values(), default=0), backend=b)
        return found

    @contextmanager
    def _counting_errors(self, op: str) -> Iterator[None]:
        try:
            yield
        except Exception:
            self.metrics.inc("prefix_index_errors_total", backend=self.backend, op=op)
            raise

    def publish(self, worker: str, stored: Iterable[int] = (),
                evicted: Iterable[int] = ()) -> None:
        with self._counting_errors("publish"):
            self.inner.publish(worker, stored, evicted)

    def purge(self, worker: str) -> int:
        with self._counting_errors("purge"):
            return self.inner.purge(worker)

    def replace(self, worker: str, held: Iterable[int]) -> None:
        with self._counting_errors("replace"):
            self.inner.replace(worker, held)

    def blocks_of(self, worker: str) -> set[int]:
        with self._counting_errors("blocks_of"):
            return self.inner.blocks_of(worker)
