"""A worker's step trace: one CSV line per engine step, for fitting the step model to
what a serving worker really did (``pdserve worker --step-trace PATH``; ``pdserve up
--step-trace-dir DIR`` gives each worker a file there).

Lifecycle: the engine loop opens it when it starts (append, line-buffered: a reader
sees every finished step while the worker runs, and a restarted worker adds to its
file) -> after each step that ran work, :meth:`StepTrace.write` adds the step's wall
start (``time.time()``, comparable across processes on one machine), its seconds and its
:class:`~common.cost_model.StepSums` -> :meth:`close` at the loop's end.

A step's seconds are the engine loop's busy time it closes: from the previous step's end
when the loop did not wait for work since (the commands it applied and the reservations
it placed in between, then the step, then handing its outputs to their streams), else
from the step's own start. In a busy batch that is the gap between two tokens of a
sequence, what the simulator's served step stands for.

:func:`read_step_trace` reads it back (``pdserve plan --validate`` compares each role's
steps with the step model that predicted them: :mod:`benchmarks.plan_validate`). A
worker that changes role in place keeps the file named for the role it started in.

A worker started with ``--publish-steps`` also hands each step to a
:class:`StepPublisher`, which notes it on the model's served-steps stream in Redis
(:mod:`common.served_steps`) for the live planner, with the worker's threads and current
role, and flushes every second.

The engine computes a step's sums only while a trace or a publisher is on (one pass over
the step's chunks); nothing else is recorded.
"""

from __future__ import annotations

import asyncio
import csv
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from common.cost_model import StepSums
from common.served_steps import ServedStep, StepLog

log = logging.getLogger(__name__)

HEADER = ("start_unix_s", "seconds", "tokens", "seqs", "decode_pairs", "fresh_pairs",
          "prefix_pairs")


@dataclass(frozen=True)
class TracedStep:
    start_unix_s: float
    seconds: float
    sums: StepSums


class StepTrace:
    """The writing end; engine thread only."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        size = os.path.getsize(path) if os.path.exists(path) else 0
        torn = False
        if size:  # a worker killed mid-line left no newline: end that line first
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        self.path = path
        self._f = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - a loop's life
        if torn:
            self._f.write("\n")
        if not size:
            self._f.write(",".join(HEADER) + "\n")

    def write(self, start_unix_s: float, seconds: float, s: StepSums) -> None:
        self._f.write(f"{start_unix_s:.6f},{seconds:.6f},{s.tokens},{s.seqs},"
                      f"{s.decode_pairs:g},{s.fresh_pairs:g},{s.prefix_pairs:g}\n")

    def close(self) -> None:
        self._f.close()


def read_step_trace(path: str, since: float = float("-inf"), until: float = float("inf")
                    ) -> list[TracedStep]:
    """The steps of ``path`` that started in ``[since, until]`` (unix seconds); a last
    line cut short (a worker killed mid-write: no newline after it) is skipped. Raises
    ValueError for a file that is not a step trace."""
    out = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    # The last piece follows the last newline: empty, or a line a worker was killed
    # while writing (its last number may be cut short yet still parse).
    rows = csv.reader(lines[:-1])
    header = next(rows, None)
    if header is not None and tuple(header) != HEADER:
        raise ValueError(f"{path} is not a step trace (header {header!r}, want "
                         f"{','.join(HEADER)})")
    for row in rows:
        if len(row) != len(HEADER):
            continue
        try:
            start, seconds = float(row[0]), float(row[1])
            sums = StepSums(int(row[2]), int(row[3]), float(row[4]), float(row[5]),
                            float(row[6]))
        except ValueError:
            continue
        if since <= start <= until:
            out.append(TracedStep(start, seconds, sums))
    return out


class StepPublisher:
    """Notes each step (the engine loop's ``step_listener``; engine thread) on ``steps``
    as one of ``threads``-thread worker whose role ``role()`` says, and writes what was
    noted every ``every_s`` (:meth:`run`, on the worker's event loop; the write from a
    thread). Redis being away loses those steps, logged once; serving goes on."""

    def __init__(self, steps: StepLog, threads: int, role: Callable[[], str]) -> None:
        self.steps, self.threads, self.role = steps, threads, role

    def __call__(self, start: float, seconds: float, sums: StepSums) -> None:
        self.steps.note(ServedStep(start, seconds, self.threads, self.role(), sums))

    async def run(self, stop: asyncio.Event, every_s: float = 1.0) -> None:
        """Flush every ``every_s`` until ``stop``, then once more unless the last flush
        failed; never raises (a worker's shutdown awaits it)."""
        warned = False
        while True:
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except asyncio.TimeoutError:  # not the builtin TimeoutError on 3.10
                pass
            last = stop.is_set()  # before the take: what was noted before stop goes in it
            batch = self.steps.take()
            if not batch or (last and warned):  # nothing, or Redis away (each try waits
                if last:                        # out redis-py's retries): not again
                    return
                continue
            try:
                await asyncio.to_thread(self.steps.flush, batch)
                warned = False
            except Exception as e:  # noqa: BLE001 - Redis's, or a bug: serving goes on
                if not warned:
                    log.warning("served steps not published (%d steps): %s", len(batch), e)
                warned = True
            if last:
                return
