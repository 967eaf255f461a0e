"""Recent traffic's shapes, in Redis: what the live planner re-plans from.

Every router notes each request twice (:meth:`TrafficLog.note`: when it arrived, its
prompt, cached and output tokens, and the key of the earlier request whose prompt its
own begins with (:mod:`router.lineage`); never its tokens or text): once admitted, ``done``
False, with the output its ``max_tokens`` allows, and once it ends (finished, failed
or cancelled) with the output it had and, finished, its first and last token's
latencies (what the planner measures the running configuration's goodput from). The
reader keeps a request's ended record where there is one, else the admitted one
(:meth:`TrafficLog.recent`): a window holds the requests still in flight too. Noted
only when finished, a 15 s window of a 2-core Xeon's headline run held 38-89% of the
requests that had arrived in it (38% at 120% load, where e2e latency p50 was 9 s), so
the planner saw a fraction of the load it was sizing for. The records are kept in
memory, and a periodic task of the router writes them (:meth:`TrafficLog.flush`, one
pipelined round trip, from a thread) to one capped Redis stream per model,
``<prefix>traffic``, shared by every router of the model. The autoscaler (``pdserve up
--autoscale``, :mod:`cluster.autoscale`) reads a window of it back
(:meth:`TrafficLog.recent`).

The stream's bounds and its trust in entries are :class:`common.stream_log.StreamLog`'s.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

import redis

from .stream_log import StreamLog

MAX_TOKENS = 1 << 24
"""No request's count of tokens is above this; a larger value is not ours."""

MAX_KEY = 64
"""A record's ``key`` is at most this long; a longer one is not ours."""


@dataclass(frozen=True)
class TrafficRecord:
    arrival: float
    """Unix time (s) the router received the request."""
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    """Finished: the output it had; admitted: the most it may have (``max_tokens``)."""
    key: str = ""
    """The router's id of the request, the same in both of its records ("": a record
    that stands alone)."""
    done: bool = True
    """False: noted when admitted; a finished record of the same key replaces it."""
    ttft_s: float | None = None
    e2e_s: float | None = None
    """A finished request's first and last token, seconds after it arrived (None: not
    finished, or failed)."""
    parent: str = ""
    """The key of the earlier request of the same router whose prompt this one's begins
    with (:mod:`router.lineage`: a conversation's previous turn; "": none)."""


class TrafficLog(StreamLog[TrafficRecord]):
    """The routers' requests, admitted and ended (:class:`~common.stream_log.StreamLog`):
    noted on a router's event loop, flushed every second. Two entries a request: the
    stream holds the last ``maxlen / 2`` requests (50,000 by default)."""

    suffix = "traffic"

    def __init__(self, client: redis.Redis, model: str, maxlen: int = 100_000) -> None:
        super().__init__(client, model, maxlen)

    def _fields(self, r: TrafficRecord) -> dict:
        out = {"a": f"{r.arrival:.6f}", "p": r.prompt_tokens, "c": r.cached_tokens,
               "o": r.output_tokens, "k": r.key[:MAX_KEY], "d": int(r.done)}
        if r.ttft_s is not None and r.e2e_s is not None:
            out |= {"t": f"{r.ttft_s:.4f}", "e": f"{r.e2e_s:.4f}"}
        if r.parent:
            out["pa"] = r.parent[:MAX_KEY]
        return out

    def recent(self, since: float) -> list[TrafficRecord]:
        """The requests that arrived at ``since`` or later, oldest first: each finished
        one's finished record, each in flight's admitted one."""
        records = super().recent(since)
        finished = {r.key for r in records if r.done and r.key}
        return [r for r in records if r.done or r.key not in finished]

    def _parse(self, fields: dict) -> TrafficRecord | None:
        try:
            arrival = float(fields[b"a"])
            counts = [int(fields[k]) for k in (b"p", b"c", b"o")]
        except (KeyError, ValueError, TypeError):
            return None
        if not all(0 <= n <= MAX_TOKENS for n in counts) or not 0 < arrival < 1e11:
            return None
        p, c, o = counts
        key, parent = fields.get(b"k", b""), fields.get(b"pa", b"")
        done = fields.get(b"d", b"1")
        if (not all(isinstance(k, bytes) and len(k) <= MAX_KEY for k in (key, parent))
                or done not in (b"0", b"1")):
            return None
        ttft_s, e2e_s = _latencies(fields)
        return TrafficRecord(arrival, p, min(c, p), o, key.decode("ascii", "replace"),
                             done == b"1", ttft_s=ttft_s, e2e_s=e2e_s,
                             parent=parent.decode("ascii", "replace"))

    def _time(self, r: TrafficRecord) -> float:
        return r.arrival


MAX_LATENCY_S = 1e6
"""No request of ours took longer than this (a larger latency is not ours)."""


def _latencies(fields: dict) -> tuple[float | None, float | None]:
    """A finished record's ``(ttft_s, e2e_s)``; ``(None, None)`` when absent or not ours."""
    try:
        ttft, e2e = float(fields[b"t"]), float(fields[b"e"])
    except (KeyError, ValueError, TypeError):
        return None, None
    if not 0 <= ttft <= e2e <= MAX_LATENCY_S:
        return None, None
    return ttft, e2e


def expected_outputs(records: Sequence[TrafficRecord],
                     history: Sequence[TrafficRecord] = ()) -> list[TrafficRecord]:
    """``records`` with each request in flight's output taken as the median of the
    ended ones' in ``history`` and ``records`` (at most its ``max_tokens`` bound): a
    client that leaves ``max_tokens`` unset allows the whole context, which no chat
    reply comes near. The caller passes a longer span than the window as ``history``:
    within a window the requests that ended are the short ones. With none ended, the
    bound stands."""
    done = [r.output_tokens for r in (*history, *records) if r.done]
    if not done or all(r.done for r in records):
        return list(records)
    typical = int(statistics.median(done))
    return [r if r.done else replace(r, output_tokens=min(r.output_tokens, typical))
            for r in records]
