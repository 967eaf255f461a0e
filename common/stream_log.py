"""A capped Redis stream of small records, one per model, written in batches and read
back by time: the base of the traffic log (:mod:`common.traffic`, what routers saw) and
the served-steps log (:mod:`common.served_steps`, what workers ran), both read by the
live planner.

Lifecycle: a writer notes records in memory (:meth:`StreamLog.note`, from any thread),
and a periodic task of its process hands what :meth:`StreamLog.take` returns to
:meth:`StreamLog.flush` (one pipelined round trip; from a thread, so that serving never
waits on Redis). A reader asks for :meth:`StreamLog.recent` records. The stream holds
at most ``maxlen`` entries (approximately: Redis trims whole macro nodes), so it cannot
grow without bound; an entry that does not parse (another writer, a corrupted value) is
skipped, never trusted. Losing entries (Redis down at a flush) only makes the planner
see less; nothing waits on it.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

import redis

from .prefix_index import RedisPrefixIndex

R = TypeVar("R")


class StreamLog(Generic[R]):
    """A subclass names its stream (``suffix``, after the model's key prefix) and says
    how a record becomes stream fields and back, and when it happened (``_time``: unix
    seconds, what :meth:`recent` filters and sorts on)."""

    suffix = ""

    def __init__(self, client: redis.Redis, model: str, maxlen: int = 20000) -> None:
        self.client = client
        self.key = f"{RedisPrefixIndex(client, model).prefix}{self.suffix}"
        self.maxlen = maxlen
        self._pending: list[R] = []
        self._lock = threading.Lock()

    def note(self, record: R) -> None:
        with self._lock:
            if len(self._pending) < self.maxlen:  # Redis down for long: keep the oldest
                self._pending.append(record)

    def take(self) -> list[R]:
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def flush(self, records: list[R]) -> None:
        """Write ``records`` (blocking: one round trip). Raises Redis's errors."""
        if not records:
            return
        pipe = self.client.pipeline(transaction=False)
        for r in records:
            pipe.xadd(self.key, self._fields(r), maxlen=self.maxlen, approximate=True)
        pipe.execute()

    def recent(self, since: float) -> list[R]:
        """Records of unix time ``since`` or later, oldest first (blocking). Entries are
        keyed by when they were written, which is after they happened, so the read
        starts at ``since`` and filters on the record's own time."""
        out = []
        for _id, fields in self.client.xrange(self.key, min=f"{int(since * 1000)}-0"):
            record = self._parse(fields)
            if record is not None and self._time(record) >= since:
                out.append(record)
        out.sort(key=self._time)
        return out

    def _fields(self, record: R) -> dict:
        raise NotImplementedError

    def _parse(self, fields: dict) -> R | None:
        raise NotImplementedError

    def _time(self, record: R) -> float:
        raise NotImplementedError
