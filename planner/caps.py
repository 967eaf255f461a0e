"""The stall-free cap (``--prefill-tokens-while-decoding``) the live planner sets on the
running configuration, after its roles (:class:`planner.autoscale.Autoscaler`).

:func:`prefill_caps` names the caps worth trying on a machine (relative to its decode
step), :func:`with_caps` the configuration with each, :class:`PrefillCapChooser`
decides on a window's predictions, and :func:`best_cap_goodput` scores a configuration
at its best cap (the cap changes at no cost, so a role switch must beat that).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from common.cost_model import Profile
from common.traffic import TrafficRecord

from .config import PoolConfig
from .scores import Predict, Score

CAP_STEPS = (3.0, 6.0)
"""The stall-free caps the live planner tries, as the multiple of an unloaded one-request
decode step that a step computing that many prompt tokens takes (:func:`prefill_caps`).
Two decode steps' worth (64 tokens on a 2-core Xeon) was tried too: a headline run's
windows predicted it 10-25% less goodput than no cap wherever long prompts queued."""


def prefill_caps(profile: Profile, threads: int, steps: Sequence[float] = CAP_STEPS
                 ) -> tuple[int, ...]:
    """0 (no cap) and, per multiple ``k`` in ``steps``, the most prompt tokens (whole KV
    blocks, within the step budget) whose prefill takes at most ``k`` decode steps on
    ``profile``: relative to the machine (a GPU computes hundreds of prompt tokens in a
    decode step's time, two CPU cores a few dozen)."""
    step, block = profile.step(threads), profile.block_size
    caps = {0}
    for k in steps:
        n = 0
        while (n + block <= profile.max_num_batched_tokens
               and step.prefill_seconds(n + block) <= k * step.decode_seconds(1, n + block)):
            n += block
        if n:
            caps.add(n)
    return tuple(sorted(caps))


def with_caps(config: PoolConfig, caps: Sequence[int]) -> list[PoolConfig]:
    """``config`` with each of ``caps`` and the cap it carries, by cap."""
    return [replace(config, prefill_tokens_while_decoding=cap)
            for cap in sorted({config.prefill_tokens_while_decoding, *caps})]


@dataclass(frozen=True)
class CapDecision:
    at: float
    current: int
    """The cap in force (0: none)."""
    target: int | None
    """The cap to set; None: keep."""
    reason: str
    predicted: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Each cap's predicted (goodput, ITL p99 ms)."""


class PrefillCapChooser:
    """The stall-free cap (``--prefill-tokens-while-decoding``) for the configuration
    the workers have, decided after the roles (:class:`planner.autoscale.Autoscaler`) on
    the same window.

    A long prompt computed in one step makes every running decode wait through it: on
    a 2-core Xeon, 1,536 prompt tokens in a 0.5-1 s step where a decode step takes 40
    ms. Capping a step's prompt tokens while anyone decodes (Sarathi-Serve's stall-free
    batching) bounds that wait, and costs the prompt more steps: worth it under load,
    where many decodes wait through many prompts, and worse at a low one, where a rare
    long step is above the 99th percentile of the gaps and the cap's many medium steps
    are not. So the planner simulates the current configuration with each cap
    (:func:`prefill_caps`) on the traffic it is handed (the live loop hands it the last
    two windows: one window's p99 swings with whether a long prompt landed among many
    decodes in it) and takes, among the caps within ``tolerance`` of the best predicted
    goodput, the one with the lowest predicted ITL p99. It changes
    the cap when that one cuts ITL p99 by ``min_itl_gain`` or serves ``min_gain`` more,
    ``confirmations`` decisions in a row (a change costs nothing: the workers take it
    at their next step). Reasons: ``few_requests``, ``current_best``,
    ``below_threshold``, ``confirming``, ``switch``.

    Not yet seen by the router: its live placement rule (:mod:`router.adaptive`; also the
    simulator's ``adaptive`` candidate) estimates a prompt computed on a decode worker in
    chunks of that worker's spare step budget, not of its cap, so with a cap in force on
    a split it takes local prompts for faster, and their stall for longer, than they
    are. The simulated workers themselves run the cap, as the real ones do."""

    def __init__(self, caps: Sequence[int], predict: Predict, *, min_requests: int = 10,
                 tolerance: float = 0.05, min_itl_gain: float = 0.2, min_gain: float = 0.10,
                 confirmations: int = 2) -> None:
        if not caps:
            raise ValueError("the cap chooser needs at least one cap")
        self.caps, self.predict = tuple(caps), predict
        self.min_requests, self.tolerance = min_requests, tolerance
        self.min_itl_gain, self.min_gain = min_itl_gain, min_gain
        self.confirmations = confirmations
        self._leader: int | None = None
        self._wins = 0

    def reset(self) -> None:
        """Forget a leader (the roles changed: its window no longer applies)."""
        self._leader, self._wins = None, 0

    def decide(self, now: float, current: PoolConfig,
               records: Sequence[TrafficRecord]) -> CapDecision:
        have = current.prefill_tokens_while_decoding
        if len(records) < self.min_requests:
            self.reset()
            return CapDecision(now, have, None, "few_requests")
        predicted = {}
        for capped in with_caps(current, self.caps):
            m = self.predict(capped, records)
            predicted[capped.prefill_tokens_while_decoding] = (float(m["goodput"]),
                                                                float(m["itl_p99_ms"]))
        top = max(g for g, _ in predicted.values())
        eligible = [c for c, (g, _) in predicted.items() if g >= (1 - self.tolerance) * top]
        best = min(eligible, key=lambda c: (predicted[c][1], c != have))
        if best == have:
            self.reset()
            return CapDecision(now, have, None, "current_best", predicted)
        (g_best, itl_best), (g_have, itl_have) = predicted[best], predicted[have]
        faster = itl_best <= (1 - self.min_itl_gain) * itl_have
        more = g_best >= (1 + self.min_gain) * g_have if g_have > 0 else g_best > 0
        if not (faster or more):
            self.reset()
            return CapDecision(now, have, None, "below_threshold", predicted)
        self._wins = self._wins + 1 if best == self._leader else 1
        self._leader = best
        if self._wins < self.confirmations:
            return CapDecision(now, have, None, "confirming", predicted)
        self.reset()
        return CapDecision(now, have, best, "switch", predicted)


def best_cap_goodput(figures: Predict, caps: Sequence[int]) -> Score:
    """A configuration's score as the best predicted goodput it has with any of ``caps``
    (or the cap it carries). The cap changes at no cost, so a role switch must beat what
    the current roles would serve with their best cap, not only with the one in force:
    in a 2-core Xeon's headline run, two overloaded windows predicted two mixed workers
    1.12 and 1.35 req/s without a cap, 1.42 with one, and the split 1.67 and 2.03; scored
    without the cap, the planner split the pools there and served 0.79x colocated."""
    def score(config: PoolConfig, records: Sequence[TrafficRecord]) -> float:
        return max(float(figures(capped, records)["goodput"])
                   for capped in with_caps(config, caps))

    return score
