"""Timing two or more ways of doing one thing on a machine whose speed drifts. Pure
(stdlib only)."""

from __future__ import annotations

import time
from collections.abc import Callable


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
