"""The steps workers served, in Redis: what the live planner refits its step model from
(:mod:`common.served_fit`).

A worker started with ``--publish-steps`` (``pdserve up --autoscale`` starts its workers
so) notes each engine step that ran work (:meth:`StepLog.note`, on the engine thread:
when it started, its seconds as the step trace counts them, the worker's threads and
role, and the step's :class:`~common.cost_model.StepSums`; never a token) and a periodic
task of the worker writes them (:meth:`StepLog.flush`, from a thread) to one capped
stream per model, ``<prefix>steps``, shared by every worker of the model. The autoscaler
(:mod:`cluster.autoscale`) reads a window of it back (:meth:`StepLog.recent`). The
stream's bounds and its trust in entries are :class:`common.stream_log.StreamLog`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from .cost_model import StepSums
from .stream_log import StreamLog

ROLES = ("prefill", "decode", "mixed")
MAXLEN = 100_000
"""Steps the stream holds, all workers together."""
MAX_STEP_S = 3600.0
"""No step takes longer; an entry that says so is not ours."""
MAX_COUNT = 1 << 24
"""No step has more tokens or sequences."""


@dataclass(frozen=True)
class ServedStep:
    start: float
    """Unix time (s) the step's time started (:mod:`workers.step_trace`)."""
    seconds: float
    threads: int
    role: str
    sums: StepSums


class StepLog(StreamLog[ServedStep]):
    """The workers' served steps (:class:`~common.stream_log.StreamLog`): noted on a
    worker's engine thread, flushed every second from its event loop. The stream holds
    the last :data:`MAXLEN` steps of all workers (~15 MB): a minute's window of a
    cluster serving more than ~1,600 steps a second (80 busy CPU workers) is cut to its
    latest part, which the fit needs no more of."""

    suffix = "steps"

    def __init__(self, client: redis.Redis, model: str, maxlen: int = MAXLEN) -> None:
        super().__init__(client, model, maxlen)

    def _fields(self, r: ServedStep) -> dict:
        s = r.sums
        return {"t": f"{r.start:.6f}", "s": f"{r.seconds:.6f}", "h": r.threads, "r": r.role,
                "k": s.tokens, "q": s.seqs, "d": f"{s.decode_pairs:g}",
                "f": f"{s.fresh_pairs:g}", "x": f"{s.prefix_pairs:g}"}

    def _parse(self, fields: dict) -> ServedStep | None:
        try:
            start, seconds = float(fields[b"t"]), float(fields[b"s"])
            threads, tokens, seqs = (int(fields[k]) for k in (b"h", b"k", b"q"))
            pairs = [float(fields[k]) for k in (b"d", b"f", b"x")]
            role = fields[b"r"].decode()
        except (KeyError, ValueError, TypeError, UnicodeDecodeError):
            return None
        if not (0 < start < 1e11 and 0 < seconds <= MAX_STEP_S and 1 <= threads <= 4096
                and role in ROLES and 1 <= seqs <= tokens <= MAX_COUNT
                and all(0 <= p <= float(MAX_COUNT) ** 2 for p in pairs)):
            return None
        return ServedStep(start, seconds, threads, role, StepSums(tokens, seqs, *pairs))

    def _time(self, r: ServedStep) -> float:
        return r.start
