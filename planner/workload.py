"""What the planner simulates: a workload it can sample for a slice of the cluster.

A :class:`Workload` answers :meth:`~Workload.sample` ``(fraction, window_s)`` with the
requests and session arrival times that a ``fraction`` of the workers would see (the
symmetric-slice approximation of :mod:`planner.search`) in the first ``window_s``
seconds (None: all of it), and :meth:`~Workload.window` says which window keeps a
slice's simulation within ``max_requests`` (None: no window; the whole workload):

- :class:`ExplicitWorkload`: a list of requests and arrival times (``pdserve bench``'s
  generators, a trace file, a recorded run). A slice keeps every session ``i`` where
  ``floor((i + 1) * fraction) > floor(i * fraction)``: an even, deterministic share,
  so every candidate of one slice size sees the very same requests. It is simulated
  over its whole span (it may not be stationary): it has no window.
- :class:`~planner.synthetic.SyntheticTrace` (adapted by :class:`SyntheticWorkload`):
  stationary Poisson arrivals; the slice's own arrivals are drawn directly, and when
  they would exceed ``max_requests`` only a window at the start of the trace is
  simulated (a time slice: a stationary hour looks the same in any window of it). The
  search gives every candidate the same window, so each is measured over the same time.

:func:`explicit` builds the ``pdserve bench`` workloads from the same shape, and
:func:`from_details` reads a recorded run (``pdserve bench --out FILE``).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from loadtest.runner import group_sessions
from loadtest.workloads import DEFAULT_TOKEN_IDS, KINDS, Request, WorkloadShape, arrival_times

from .synthetic import SyntheticTrace

WORKLOADS = KINDS


@dataclass(frozen=True)
class Sample:
    requests: list[Request]
    arrivals: list[float]
    """One per session (:func:`loadtest.runner.group_sessions` order)."""
    fraction: float
    window_s: float | None = None
    """Set when only the first ``window_s`` seconds of a longer trace are simulated."""


class Workload(Protocol):
    description: str

    def window(self, fraction: float, max_requests: int | None) -> float | None: ...

    def sample(self, fraction: float = 1.0, window_s: float | None = None) -> Sample: ...


class ExplicitWorkload:
    def __init__(self, requests: list[Request], arrivals: list[float],
                 description: str = "") -> None:
        self.sessions = group_sessions(requests)
        if len(self.sessions) != len(arrivals):
            raise ValueError(f"{len(self.sessions)} sessions but {len(arrivals)} arrival "
                             "times: give one arrival per session (a conversation's first "
                             "turn, or a lone request)")
        self.requests, self.arrivals = requests, list(arrivals)
        n = len(requests)
        self.description = description or f"{n} requests in {len(self.sessions)} sessions"

    def window(self, fraction: float, max_requests: int | None) -> float | None:
        return None

    def sample(self, fraction: float = 1.0, window_s: float | None = None) -> Sample:
        if window_s is not None:
            raise ValueError("an explicit workload is simulated whole: no window")
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if fraction == 1:
            return Sample(self.requests, self.arrivals, 1.0)
        keep = [i for i in range(len(self.sessions))
                if math.floor((i + 1) * fraction) > math.floor(i * fraction)]
        return Sample([r for i in keep for r in self.sessions[i]],
                      [self.arrivals[i] for i in keep], fraction)


class SyntheticWorkload:
    def __init__(self, trace: SyntheticTrace) -> None:
        self.trace = trace
        self.description = trace.description

    def window(self, fraction: float, max_requests: int | None) -> float | None:
        t = self.trace
        if max_requests is None or t.rate * fraction * t.duration_s <= max_requests:
            return None
        return max_requests / (t.rate * fraction)

    def sample(self, fraction: float = 1.0, window_s: float | None = None) -> Sample:
        t = self.trace
        if window_s is not None and window_s < t.duration_s:
            t = SyntheticTrace(**{**t.__dict__, "duration_s": window_s})
        else:
            window_s = None
        requests, arrivals = t.sample(fraction)
        return Sample(requests, arrivals, fraction, window_s)


def explicit(shape: WorkloadShape, request_rate: float = math.inf, burstiness: float = 1.0,
             seed: int = 0) -> ExplicitWorkload:
    """``pdserve bench``'s workload (the same :class:`~loadtest.workloads.WorkloadShape`
    and arrivals) over the default ids, as the planner simulates it."""
    reqs = shape.requests(seed, DEFAULT_TOKEN_IDS)
    sessions = len(group_sessions(reqs))
    times = arrival_times(sessions, request_rate, burstiness, seed)
    if reqs and all(r.at is not None for r in reqs):  # a trace keeps its own schedule
        times = [float(r.at) for r in reqs]  # type: ignore[arg-type]
    rate = "inf" if math.isinf(request_rate) else f"{request_rate:g}"
    return ExplicitWorkload(reqs, times, f"{shape.workload}: {len(reqs)} requests, rate "
                                         f"{rate} req/s, burstiness {burstiness:g}, seed {seed}")


def from_details(path: str | Path, input_len: int | None = None, seed: int = 0
                 ) -> tuple[ExplicitWorkload, list[str]]:
    """A recorded run (``pdserve bench --out FILE``) as a workload, and notes on what the
    file lacked. Its ``details`` give each completed request's send time (``sent``) and
    output length (``output_tokens``); per-request prompt lengths are taken from
    ``details.prompt_tokens`` when present, else every prompt gets ``input_len`` or,
    without it, the run's mean (``total_input_tokens / completed``). Prompts are random
    ids (a recording holds no prompt contents, so no prefix sharing is replayed), and
    conversations replay as independent requests at their recorded send times."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the recorded run {path}: {e}") from e
    d = data.get("details") if isinstance(data, dict) else None
    if not isinstance(d, dict):
        raise ValueError(f"{path} has no `details` section (write it with pdserve bench --out)")
    missing = [k for k in ("sent", "output_tokens") if not isinstance(d.get(k), list)]
    if missing:
        raise ValueError(f"{path}: details lack {', '.join(missing)} (per-request send times "
                         "and output lengths); cannot replay it")
    sent, outs = d["sent"], d["output_tokens"]
    if len(sent) != len(outs):
        raise ValueError(f"{path}: {len(sent)} send times but {len(outs)} output lengths")
    notes = ["prompt contents are not recorded: random prompts, no shared prefixes replayed"]
    prompts = d.get("prompt_tokens")
    if not (isinstance(prompts, list) and len(prompts) == len(sent)):
        if input_len is None:
            done = data.get("completed") or len(sent)
            if not data.get("total_input_tokens"):
                raise ValueError(f"{path}: no per-request prompt lengths (details.prompt_tokens)"
                                 " and no total_input_tokens: give --input-len")
            input_len = max(1, round(data["total_input_tokens"] / done))
            notes.append(f"details lack per-request prompt lengths (prompt_tokens): every "
                         f"prompt is the run's mean, {input_len} tokens")
        else:
            notes.append(f"details lack per-request prompt lengths (prompt_tokens): every "
                         f"prompt is --input-len {input_len} tokens")
        prompts = [input_len] * len(sent)
    start = min(sent, default=0.0)
    order = sorted(range(len(sent)), key=lambda i: sent[i])
    rng = random.Random(seed)
    ids = DEFAULT_TOKEN_IDS
    reqs = [Request([rng.choice(ids) for _ in range(max(1, int(prompts[i])))],
                    max(1, int(outs[i]))) for i in order]
    times = [float(sent[i]) - start for i in order]
    if data.get("failed"):
        notes.append(f"{data['failed']} failed requests of the run are not in its details: "
                     "not replayed")
    return ExplicitWorkload(reqs, times, f"recorded run {path}: {len(reqs)} requests"), notes
