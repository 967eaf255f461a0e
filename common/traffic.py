"""Recent traffic's shapes, in Redis: what the live planner re-plans from.

Every router notes each finished request (:meth:`TrafficLog.note`: when it arrived,
its prompt, cached and output tokens; never its tokens or text) in memory, and a
periodic task of the router writes them (:meth:`TrafficLog.flush`, one pipelined round
trip, from a thread) to one capped Redis stream per model, ``<prefix>traffic``, shared by
every router of the model. The autoscaler (``pdserve up --autoscale``,
:mod:`cluster.autoscale`) reads a window of it back (:meth:`TrafficLog.recent`).

The stream holds at most ``maxlen`` entries (approximately: Redis trims whole macro
nodes), so it cannot grow without bound; an entry that does not parse (another writer,
a corrupted value) is skipped, never trusted. Losing entries (Redis down at a flush)
only makes the planner see less traffic; serving never waits on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from .prefix_index import RedisPrefixIndex

MAX_TOKENS = 1 << 24
"""No request's count of tokens is above this; a larger value is not ours."""


@dataclass(frozen=True)
class TrafficRecord:
    arrival: float
    """Unix time (s) the router received the request."""
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


class TrafficLog:
    """Not thread-safe: :meth:`note` on the router's event loop, :meth:`flush` handed the
    batch :meth:`take` returned (so the two never touch one list)."""

    def __init__(self, client: redis.Redis, model: str, maxlen: int = 20000) -> None:
        self.client = client
        self.key = f"{RedisPrefixIndex(client, model).prefix}traffic"
        self.maxlen = maxlen
        self._pending: list[TrafficRecord] = []

    def note(self, record: TrafficRecord) -> None:
        if len(self._pending) < self.maxlen:  # Redis down for long: keep the oldest
            self._pending.append(record)

    def take(self) -> list[TrafficRecord]:
        out, self._pending = self._pending, []
        return out

    def flush(self, records: list[TrafficRecord]) -> None:
        """Write ``records`` (blocking: one round trip). Raises Redis's errors."""
        if not records:
            return
        pipe = self.client.pipeline(transaction=False)
        for r in records:
            pipe.xadd(self.key, {"a": f"{r.arrival:.6f}", "p": r.prompt_tokens,
                                 "c": r.cached_tokens, "o": r.output_tokens},
                      maxlen=self.maxlen, approximate=True)
        pipe.execute()

    def recent(self, since: float) -> list[TrafficRecord]:
        """Requests that arrived at or after unix time ``since``, oldest first (blocking).
        Entries are keyed by when they were written, which is after they arrived, so
        the read starts at ``since`` and filters on arrival."""
        out = []
        for _id, fields in self.client.xrange(self.key, min=f"{int(since * 1000)}-0"):
            record = _parse(fields)
            if record is not None and record.arrival >= since:
                out.append(record)
        out.sort(key=lambda r: r.arrival)
        return out


def _parse(fields: dict) -> TrafficRecord | None:
    try:
        arrival = float(fields[b"a"])
        counts = [int(fields[k]) for k in (b"p", b"c", b"o")]
    except (KeyError, ValueError, TypeError):
        return None
    if not all(0 <= n <= MAX_TOKENS for n in counts) or not 0 < arrival < 1e11:
        return None
    p, c, o = counts
    return TrafficRecord(arrival, p, min(c, p), o)
