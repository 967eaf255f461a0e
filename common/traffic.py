"""Recent traffic's shapes, in Redis: what the live planner re-plans from.

Every router notes each finished request (:meth:`TrafficLog.note`: when it arrived,
its prompt, cached and output tokens; never its tokens or text) in memory, and a
periodic task of the router writes them (:meth:`TrafficLog.flush`, one pipelined round
trip, from a thread) to one capped Redis stream per model, ``<prefix>traffic``, shared by
every router of the model. The autoscaler (``pdserve up --autoscale``,
:mod:`cluster.autoscale`) reads a window of it back (:meth:`TrafficLog.recent`).

The stream's bounds and its trust in entries are :class:`common.stream_log.StreamLog`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from .stream_log import StreamLog

MAX_TOKENS = 1 << 24
"""No request's count of tokens is above this; a larger value is not ours."""


@dataclass(frozen=True)
class TrafficRecord:
    arrival: float
    """Unix time (s) the router received the request."""
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


class TrafficLog(StreamLog[TrafficRecord]):
    """The routers' finished requests (:class:`~common.stream_log.StreamLog`): noted on
    a router's event loop, flushed every second."""

    suffix = "traffic"

    def _fields(self, r: TrafficRecord) -> dict:
        return {"a": f"{r.arrival:.6f}", "p": r.prompt_tokens, "c": r.cached_tokens,
                "o": r.output_tokens}

    def _parse(self, fields: dict) -> TrafficRecord | None:
        try:
            arrival = float(fields[b"a"])
            counts = [int(fields[k]) for k in (b"p", b"c", b"o")]
        except (KeyError, ValueError, TypeError):
            return None
        if not all(0 <= n <= MAX_TOKENS for n in counts) or not 0 < arrival < 1e11:
            return None
        p, c, o = counts
        return TrafficRecord(arrival, p, min(c, p), o)

    def _time(self, r: TrafficRecord) -> float:
        return r.arrival
