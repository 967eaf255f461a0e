"""What ``pdserve chaos`` concludes from the streams it saw: the token-exact oracle, the
recovery time and the per-scenario row. Pure: no processes, no sockets.

**The oracle.** Every request of a chaos run is greedy with ``ignore_eos`` and a fixed
``max_tokens``, on a prompt whose reference token ids the harness computed first, one
request at a time on the undisturbed cluster. A stream that completed is then:

- *exact*: the reference, token for token;
- *wrong*: some token differs from the reference at its position;
- *missing*: a prefix of the reference, shorter (tokens lost, the stream still "ended");
- *duplicated*: the reference with tokens repeated or added (longer, or a prefix then
  repeats).

A stream that failed is a *client-visible failure* (its status code is kept), unless the
harness cancelled it on purpose (the cancellation scenario): those count as
cancelled, never as failures, and only their tokens so far are checked (a prefix must
match). The control scenario (no fault) measures the oracle itself: it must see 0.

**Recovery.** TTFT by arrival time around a fault at ``t_fault``. The baseline is the
p99 TTFT of the requests served their first token before the faults of the scenario
(one still waiting when a fault struck measures the fault), pooled over
every fault (:func:`baseline_p99`: the last two thirds of each ``pre`` window; the first
third warms the load up). One fault's few seconds before it hold a dozen requests, whose
p99 is their max: a long run's control scenario, with no fault at all, "recovered" after
19 s against such a baseline, so the rule said nothing. Pooled over the scenario's
faults the baseline holds hundreds. Windows of ``window_s`` (the harness sizes them to
~10 arrivals) slide by ``step_s`` from ``t_fault``; recovery is the start of the first
window from which every window's p99 TTFT is within ``(1 + tolerance)`` of the baseline
(or ``slack_s`` above it: a few milliseconds of noise on two cores are not an outage),
minus ``t_fault``. A window with no arrival has nothing to say and is skipped; a window
whose requests failed counts their TTFT as infinite. ``None``: not recovered before the
load stopped. Without a pooled baseline :func:`recovery_s` falls back to the fault's
own pre window.

One fault's window holds ~10 requests, so its "p99" is their max, held against the p99
of hundreds: even with no fault at all about one window in ten lands above it (1 -
0.99^10), and a per-fault recovery says as much about that as about the fault. So the
scenario's recovery (:func:`pooled_recovery_s`, the figure the 10 s target holds) puts
every fault's requests on one clock, time since their fault, and judges only windows of
100 requests or more: a p99 of as many samples as the baseline's. The per-fault figures
stay in the report beside it.

**Restoration** is the other number: seconds from a kill until the killed component
runs again and every router lists every worker as serving (the harness polls for it
during the fault's load; :attr:`Row.restored_s`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadtest.metrics import percentile

VERDICTS = ("exact", "wrong", "missing", "duplicated")


@dataclass
class Outcome:
    """One request as the client saw it."""

    prompt: int  # index into the run's prompts (and references)
    arrival_s: float  # since the run's start
    tokens: list[int] = field(default_factory=list)
    ttft_s: float | None = None  # None: no token came
    error: str | None = None  # the gRPC status name of a failure
    cancelled: bool = False  # cancelled by the harness on purpose
    migrations: int = 0  # the router moved it to another worker
    route: str = ""  # where it ended: "prefill -> decode" (or the one worker), the reason


def verdict(tokens: Sequence[int], reference: Sequence[int]) -> str:
    """``exact``, ``wrong``, ``missing`` or ``duplicated`` (module docstring). A stream
    that departs from the reference by going on with the reference from an earlier
    position (tokens sent again) is duplicated; any other departure is wrong."""
    tokens, reference = list(tokens), list(reference)
    if tokens == reference:
        return "exact"
    n = min(len(tokens), len(reference))
    i = next((k for k in range(n) if tokens[k] != reference[k]), n)
    if i == n:
        return "missing" if len(tokens) < len(reference) else "duplicated"
    rest = tokens[i:]
    for j in range(i):
        m = min(len(rest), len(reference) - j)
        if rest[:m] == reference[j:j + m]:
            return "duplicated"
    return "wrong"


def check(outcome: Outcome, reference: Sequence[int]) -> str:
    """The outcome's class: a verdict, ``failed`` or ``cancelled`` (whose tokens so far
    must still be a prefix: else ``wrong``)."""
    if outcome.cancelled:
        n = len(outcome.tokens)
        return "cancelled" if list(outcome.tokens) == list(reference[:n]) else "wrong"
    if outcome.error is not None:
        return "failed"
    return verdict(outcome.tokens, reference)


def _ttft(o: Outcome) -> float:
    if o.error is not None and not o.cancelled:
        return math.inf
    return o.ttft_s if o.ttft_s is not None else math.inf


def _before(outcomes: Sequence[Outcome], t_fault: float, pre_s: float) -> list[float]:
    settled = t_fault - pre_s * 2 / 3  # the window's first third warms the load up
    # Only requests whose first token came before the fault: one still waiting when it
    # struck measures the fault, not the load.
    return [v for o in outcomes if settled <= o.arrival_s and not o.cancelled
            and math.isfinite(v := _ttft(o)) and o.arrival_s + v < t_fault]


def baseline_p99(cycles: Sequence[tuple[Sequence[Outcome], float]], pre_s: float
                 ) -> float | None:
    """The pre-fault TTFT p99 pooled over ``cycles`` (each: its outcomes and its fault's
    time); None when no request completed before any fault."""
    pooled = [v for outcomes, t_fault in cycles for v in _before(outcomes, t_fault, pre_s)]
    return percentile(pooled, 99) if pooled else None


def recovery_s(outcomes: Sequence[Outcome], t_fault: float, pre_s: float, *,
               window_s: float = 3.0, step_s: float = 0.5, tolerance: float = 0.2,
               slack_s: float = 0.05, baseline_s: float | None = None) -> float | None:
    """Seconds from the fault until TTFT p99 is back near ``baseline_s`` (the pooled
    pre-fault p99, :func:`baseline_p99`; by default this fault's own pre window: module
    docstring); 0.0 when the fault never raised it."""
    if baseline_s is None:
        baseline_s = baseline_p99([(outcomes, t_fault)], pre_s)
        if baseline_s is None:
            return None
    after = sorted((o.arrival_s - t_fault, _ttft(o)) for o in outcomes
                   if o.arrival_s >= t_fault and not o.cancelled)
    return _settled(after, _limit(baseline_s, tolerance, slack_s), window_s, step_s, 1)


def pooled_recovery_s(cycles: Sequence[tuple[Sequence[Outcome], float]], baseline_s: float,
                      *, window_s: float, step_s: float = 0.25, tolerance: float = 0.2,
                      slack_s: float = 0.05, min_samples: int = 100) -> float | None:
    """The scenario's recovery: every fault's requests on one clock (arrival minus its
    fault's time), so each window's p99 is the p99 of ``min_samples`` or more requests,
    as the pooled baseline's is (module docstring). Windows with fewer are not judged.
    None: the last judged window is still above the limit."""
    after = sorted((o.arrival_s - t_fault, _ttft(o)) for outcomes, t_fault in cycles
                   for o in outcomes if o.arrival_s >= t_fault and not o.cancelled)
    return _settled(after, _limit(baseline_s, tolerance, slack_s), window_s, step_s,
                    min_samples)


def _p99_above(vals: Sequence[float], limit: float, alpha: float = 0.01) -> bool:
    """Whether this window's p99 is above ``limit`` beyond chance: more than 1% of its
    requests slower than ``limit``, with a one-sided binomial test at ``alpha`` (a
    window's few requests cannot pin a p99; one slow request among ten is what a load
    whose p99 is within the limit shows one window in ten)."""
    n, k = len(vals), sum(1 for v in vals if v > limit)
    return _binomial_tail(k, n, 0.01) < alpha


def _binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p). Pure."""
    if k <= 0:
        return 1.0
    term = (1.0 - p) ** n  # P(X = 0)
    below = 0.0
    for i in range(k):  # P(X <= k - 1), term by term
        below += term
        term *= (n - i) / (i + 1) * p / (1.0 - p)
    return max(0.0, 1.0 - below)


def _limit(baseline_s: float, tolerance: float, slack_s: float) -> float:
    return max(baseline_s * (1 + tolerance), baseline_s + slack_s)


def _settled(after: Sequence[tuple[float, float]], limit: float, window_s: float,
             step_s: float, min_samples: int) -> float | None:
    """Over (seconds since the fault, TTFT) sorted by time: the start of the first
    window from which every judged window's p99 is within ``limit`` (a window with
    fewer than ``min_samples`` arrivals is not judged); None if the last judged one is
    not."""
    if not after:
        return None
    end, t = after[-1][0], 0.0
    recovered: float | None = None
    while t <= end:
        vals = [v for a, v in after if t <= a < t + window_s]
        if len(vals) >= min_samples:
            good = all(map(math.isfinite, vals)) and not _p99_above(vals, limit)
            if not good:
                recovered = None
            elif recovered is None:
                recovered = t
        t += step_s
    return None if recovered is None else round(recovered, 3)


@dataclass
class Row:
    """One scenario's line of the report."""

    scenario: str
    faults: int
    sent: int
    failures: int = 0
    wrong: int = 0
    missing: int = 0
    duplicated: int = 0
    cancelled: int = 0
    migrations: int = 0
    resumes: int = 0  # streams the client moved to the other router (its own count)
    recovery_s: list[float | None] = field(default_factory=list)
    restored_s: list[float | None] = field(default_factory=list)
    """Per kill, seconds until the component was back and listed (None: not within the
    harness's wait); empty for faults that kill nothing."""
    baseline_ttft_s: float | None = None  # the pooled pre-fault TTFT p99
    pooled_recovery_s: float | None = None
    """The scenario's recovery (:func:`pooled_recovery_s`); None: not back, or not
    measured (no baseline)."""
    leaked_blocks: int = 0
    restarts: int = 0
    failed_transfers: int = 0  # KV transfers decode workers refused or lost (recomputed)
    errors: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def bad_tokens(self) -> int:
        return self.wrong + self.missing + self.duplicated

    @property
    def worst_recovery_s(self) -> float | None:
        """The slowest recovery; None if any fault's TTFT never came back."""
        if any(r is None for r in self.recovery_s):
            return None
        return max((r for r in self.recovery_s if r is not None), default=0.0)

    @property
    def worst_restored_s(self) -> float | None:
        """The slowest restoration; None if one never came back (or nothing was killed)."""
        if not self.restored_s or any(r is None for r in self.restored_s):
            return None
        return max(r for r in self.restored_s if r is not None)

    def add(self, outcomes: Sequence[Outcome], references: Sequence[Sequence[int]]) -> None:
        for o in outcomes:
            self.sent += 1
            kind = check(o, references[o.prompt])
            if kind == "failed":
                self.failures += 1
                self.errors[o.error or "?"] = self.errors.get(o.error or "?", 0) + 1
            elif kind != "exact":
                setattr(self, kind, getattr(self, kind) + 1)
            self.migrations += o.migrations
