"""Timing two or more ways of doing one thing on a machine whose speed drifts. Pure
(stdlib only)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


def least_seconds(passes: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Each pass's least seconds over ``reps`` timed rounds after one untimed round, the
    passes alternated within each round (a drifting machine moves them all)."""
    best = dict.fromkeys(passes, float("inf"))
    for i in range(reps + 1):
        for name, once in passes.items():
            start = time.perf_counter()
            once()
            if i:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


@dataclass(frozen=True)
class Crossover:
    """What :func:`crossover` found: the last count the first way kept (None: it lost at
    the first), and per count probed the least seconds of each way."""

    kept: int | None
    probed: tuple[int, ...]
    first_s: tuple[float, ...]
    second_s: tuple[float, ...]


def crossover(timed: Callable[[int], tuple[float, float]], counts: Iterable[int],
              margin: float = 1.0) -> Crossover:
    """Up to which of ``counts`` (in order) a first way of doing a thing stays faster than
    a second: ``timed(count) -> (first s, second s)``; the first keeps a count where it
    takes under ``margin`` times the second. A loss is timed once more and the least of
    the two kept (one slow pass on a shared machine must not end it), and a second loss
    ends the walk."""
    kept, probed, first, second = None, [], [], []
    for m in counts:
        a, b = timed(m)
        if a >= margin * b:
            a2, b2 = timed(m)
            a, b = min(a, a2), min(b, b2)
        probed.append(m)
        first.append(a)
        second.append(b)
        if a >= margin * b:
            break
        kept = m
    return Crossover(kept, tuple(probed), tuple(first), tuple(second))
