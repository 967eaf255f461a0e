"""The live planner's decision: which pool configuration the running workers should
take next, from recent traffic, with hysteresis. Pure: it is handed the traffic and a
way to score a configuration on it; :mod:`cluster.autoscale` feeds it and carries out
its decisions (role changes, ``SetRole``).

Every ``interval_s`` the driver calls :meth:`Autoscaler.decide` with the requests that
arrived in the last ``window_s`` (:mod:`common.traffic`). Each candidate (the
configurations the workers can reach by changing roles, their threads fixed) is scored
by ``score(config, records)``, in production the simulator's predicted goodput
(:func:`planner.scores.simulated_goodput`); where one beats the current configuration by
``min_gain`` there, both are scored again with their best stall-free cap (``refine``,
:func:`planner.caps.best_cap_goodput`: the cap changes at no cost,
:class:`planner.caps.PrefillCapChooser`). The current configuration's score is at least
the goodput it measurably serves: the share of its recent requests that met the SLOs
(``served``, :func:`planner.window.served_share`, when the caller measured it) times the
window's arrival rate; a prediction is not trusted below a measurement. The current
configuration is left only when all of these hold, else the decision says which did not
(its ``reason``):

1. ``few_requests``: the window has at least ``min_requests`` requests;
2. ``current_best``: another candidate scores best; or (2b, with an ITL score) a
   candidate predicted within ``itl_tolerance`` of the best goodput, where the current
   one is too, has a predicted ITL p99 ``min_itl_gain`` below the current one's
   (``min_itl_gain_unproven`` unless both are proven): the lowest of those is the
   target, rule 4 asks only that the switch lose at most ``itl_tolerance`` of the
   goodput, and a switch says ``lower_itl``; or (2c, with a headroom score, where no
   candidate beats the current one by ``min_gain``) among those predicted at least
   ``1 - itl_tolerance`` of its goodput, one predicted to serve ``min_gain`` more
   (``min_gain_unproven`` unless both are proven) than the current one at ``1 +
   headroom`` times the window's load, and that rule 2b would not leave, is the
   target on 2b's terms, and a switch says ``headroom``; failing that (with a headroom
   ITL score), among those predicted at least ``1 - itl_tolerance`` of its goodput at
   that load too, the one of lowest predicted ITL p99 there, when that is
   ``min_itl_gain`` (unproven: ``min_itl_gain_unproven``) below the current one's
   there: rule 2b at the heavier load;
3. ``gain_below_threshold``: it beats the current one by at least ``min_gain``
   (relative; against a current goodput of 0, any positive one counts); ``unproven``:
   and by ``min_gain_unproven`` unless both it and the current one are among the
   ``proven`` configurations the caller names (those scored with a serving calibration
   fitted while they ran, see below); ``overloaded``: such an unproven comparison is
   not made at all while the current configuration is predicted to serve less than
   ``min_served_unproven`` of the window's requests within the SLOs, unless its
   measured misses were the decode's (``tpot_bound``,
   :func:`planner.window.tpot_bound`: see below). ``min_gain`` will do for
   ``min_gain_unproven`` (the guard stands; a switch then says ``seconded``) where rule
   2c's heavier load seconds it: there, on its own, the candidate is predicted
   ``min_gain_unproven`` more goodput, or (with a headroom ITL score) as much within
   ``itl_tolerance`` at ``min_itl_gain_unproven`` less ITL p99 (see below). Neither
   margin nor guard holds
   where the current configuration measurably serves less than ``max_served_rescue``
   of its requests within them (``served``): little is left to lose, a gain of
   ``min_gain`` will do, and the switch (reason ``rescue``) is made to be measured,
   at the first decision past the dwell time (6 does not apply: the simulator's
   prediction of an overloaded split swung 0.07-1.24 req/s between consecutive 15 s
   windows of one point on a 2-core EPYC, and two in a row rarely agreed). There, with
   an ITL score, where other candidates are predicted at most ``1 -
   min_itl_gain_unproven`` of the current one's ITL p99, only those are weighed, and
   the current one at what it measurably serves alone, its prediction not held above
   it (a switch then says ``stalled``, and the configuration left is scored at most at
   what it served then for ``memory_s``; see below); and no switch, by any rule, goes
   to a candidate predicted at least ``1 / (1 - min_itl_gain_unproven)`` times its ITL
   p99 (``stalling``: the mirror);
4. ``switch_cost``: it still does once the switch's role changes are paid for (below);
5. ``dwell``: the last change is at least ``min_dwell_s`` old;
6. ``confirming``: the same candidate won ``confirmations`` decisions in a row.

Then ``switch``. Under a steady load the scores are steady, so (2)-(6) keep a planner
from flapping: a candidate must win by a margin, twice, and not too soon after the
last change. Rules 2b and 3 leave a band between them: a configuration entered for its
ITL is left for goodput only when another serves ``min_gain`` more, and
``itl_tolerance`` is below that.

Why the served floor. On a 2-core Xeon's chat headline at 120% load, the split's own
calibration predicted it 1.27 req/s against two mixed workers' 3.14, while held
through the sweep it served 3.75: the goodput rule left it 23 s into the point, and the
point served 0.43x colocated (``loadtest/results/headline-xeon-1206-chat-itl2/``). What
the running configuration served is known; only the others' goodput must be predicted.

Why 2c. Two configurations that serve a window whole are tied on goodput however
close to its limit either runs. A 15 s window is too short to show the backlog a
multi-turn chat builds past that limit (each turn waits for the reply before it), and
the simulation starts with the window's first request, where the real workers were
already busy: on a 2-core EPYC's chat headline, two mixed workers were predicted to
serve the first windows of the 85% load point as well as the split, then served
65-38% of their requests within the SLOs while the planner waited for a calibration
of the split (``overloaded``), and split only at the rescue (85% load: 0.75x and
1.16x colocated's goodput; ``loadtest/results/headline-epyc-1206-chat-linked/``).
Replayed offline on the colocated cluster's steps, the windows of that run told the
two apart at twice the load at 50% load already (1.1-1.5 against 2.1-2.8 req/s on
one seed), and at 25% by at most 17%, under the 30% an unproven candidate needs. A
tie is broken toward the configuration with room to grow. Live, on the next run
(``-chat-headroom/``), it split one seed 27 s into the 25% point, which then served
1.50x colocated at 85%; the other seed's windows stayed tied at twice the load (the
simulation starts each window with idle workers, and a calibration fitted at one
load carries none of a heavier one's contention), and the rescue came at 85%.
Replayed offline, that seed's 50%-load windows at twice the load predicted the two
tied on goodput (2.00 and 1.33 req/s each) while two mixed workers' ITL p99 came to
276-522 ms and the split's to 37-50 ms: a prompt computed beside running decodes
stalls them, and at the real 85% load those stalls became the TPOT misses. The mixed
workload's windows (one prefill worker computing every 1,536-token prompt) showed no
such gap at equal goodput (164-186 ms against 178-224 where tied). So a tie at the
heavier load is broken on its ITL p99, as rule 2b breaks one at the window's.

Why ``seconded``. Where the split led at the window's load by more than ``min_gain`` but
less than ``min_gain_unproven`` (reason ``unproven``), rule 2c was not asked, since
the goodput rule's margin was past: a hole between them. On a 2-core EPYC's chat
headline runs, 10 of 13 such windows at 50-85% load (replayed offline on the runs'
own traffic and steps) predicted the split, at twice the load, 0.09-0.16x two mixed
workers' ITL p99 at 0.95x their goodput or more (9), or 1.4x their goodput (1); the one
such window of the mixed workload (85% load) predicted the split half their goodput
there (0.27 against 0.53 req/s); one at 120% load, 3x at twice it, would have been
seconded, where the split served 0.067 req/s against none. A lead seen at the
window's load (``min_gain``) and at the heavier one (by the margins an unproven
comparison asks for) is taken; confirmed twice, as any.

Why ``stalled``. The served floor keeps a prediction from being trusted below a
measurement; above one it was kept, since the simulator is as optimistic about the
others (each window starts on idle workers). Where the running configuration fails
the simulator's own ITL prediction tells why: on a 2-core EPYC's chat headline at
85% load (``loadtest/results/headline-epyc-1207-chat-interleaved/``, seed 1), two mixed
workers served 12-38% of their requests within the SLOs while predicted 0.67-0.8 req/s
(the split 0.53-0.6, so no rescue) and, on replay, an ITL p99 of 490-535 ms (they served
520) against the split's 40-48: the simulator saw every prompt stall the running
decodes, not what the stalls cost a request's TPOT. The point served 0.86x colocated,
and the planner split only 10 s into the 120% point (``lower_itl``). Where the split
fails at overload instead, two mixed workers are predicted the stalls (~500 ms against
40-50), so no such rescue leads back to them; nor, for the same reason, any switch
while the split measurably fails (``stalling``): on a seed of the same machine's chat
headline at 120% load (``-chat-stalled/``) the split served 7-32% of its requests, two
mixed workers were predicted 0.73 req/s against its 0.2 (and, 29 s before in the same
point, an ITL p99 of 264 ms against its 39), and the planner began moving back to them
34 s into the point (``rescue``), where the split served 1.76x colocated.

Why the decode's misses lift ``overloaded``. The guard keeps an unproven split out
where the simulator errs most, and on a 2-core EPYC it kept the chat mixed where a
split served more: at 85% load static 1P+1D served 1.09-2.4x colocated's goodput, and
the planner refused the split as ``overloaded`` on predictions of up to 2.1x two mixed
workers while they served 30-69% of their requests within the SLOs. The mixed
workload's refusals came at the same shares (31-58%) and predictions (1.3-1.4x), where
a split served 0.33-1.17x colocated: one prefill worker queues its 1,536-token prompts.
What told them apart was how the requests failed. In the served spans of the 47 chat
refusals of eight headline runs at 25-120% load (``loadtest/results/headline-epyc-*``,
rebuilt from their requests' latencies), no request missed its TTFT, and in 32 of the
33 with misses the TPOT misses (3-39) outnumbered those in flight (the other: one TPOT
miss, three in flight); in all 16 of the mixed workload's (ten runs, EPYC and Xeon),
some request missed its TTFT, or more were in flight than had missed TPOT. A request
that got its first token in time and then fell behind was stalled by prompts computed
beside its decode, which a split removes; one that waited for its first token queued
for prefill, which a split's fewer prefill threads make longer. So the guard stands
unless the measured misses were the decode's; the unproven margin and the
confirmations stand either way.

Why 2b. Goodput alone cannot tell two configurations that both serve the window within
the SLOs, and their inter-token latency can differ by 3x: on a 2-core Xeon's chat
headline, the split (1 prefill + 1 decode worker) served 0.98-1.04x two mixed workers'
goodput from 50% load up, at 0.34-0.41x their ITL p99 (a prompt computed beside running
decodes makes them all wait through it), and the goodput-only planner stayed mixed
(``loadtest/results/headline-xeon-1206-chat-isolated/``).

The switch's cost (4). Its role changes run one worker at a time, each taking the
seconds the caller says a worker leaving that role takes (``move_s``: the live loop
measures them); meanwhile the other workers serve, as
:func:`planner.moves.serving_while_moving`. The planner takes the window's traffic to go
on for ``AutoscaleConfig.horizon_s`` and compares what each choice serves over it::

    stay:   g(current) * H
    switch: g(while moving) * M + g(best) * (H - M)     M: the changes' seconds

A switch is worth it when it serves ``min_gain`` more (``Decision.net_gain``;
``min_gain_unproven`` where rule 3 asks for it). With
changes that cost nothing this is rule (3) again; changes that outlast the horizon
count only what the others serve meanwhile (worth it only where the current
configuration serves less than they would alone). On a 2-core Xeon a headline run's
decisions every 5 s on 15 s of traffic switched twice inside a 30 s point, each time on
a predicted gain of 14-46%, and served 0.44x colocated there.

Proven and unproven candidates. The live loop scores each configuration with a serving
calibration (the simulator's step times refitted from the workers' recorded steps).
Fitted on the steps of the configuration that ran, it predicts that configuration well
and another poorly: on a 2-core Xeon's headline run, each configuration's own steps
predicted its goodput within 7% at 5 of 6 points, while the split's steps predicted 2
mixed at 0.56 req/s where it served 1.08, and a 15 s window of mixed steps predicted the
split up to 1.22x mixed where it served 0.77-0.92x
(``loadtest/results/headline-xeon-1206-traced/``). So the loop remembers each
configuration's calibration from the last window it served whole (:class:`FitMemory`)
and scores it with that; a configuration that has not run lately is scored with the
current window's. A comparison in which either side is not scored on its own steps
(the target has not run lately, or the current one has not yet served a whole window
since the switch to it) must show the larger ``min_gain_unproven``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from common.traffic import TrafficRecord

from .config import PoolConfig
from .moves import moves, serving_while_moving
from .scores import Score


@dataclass(frozen=True)
class AutoscaleConfig:
    interval_s: float = 20.0
    window_s: float = 60.0
    min_requests: int = 10
    min_gain: float = 0.10
    min_gain_unproven: float = 0.30
    """The margin for a candidate scored without a calibration of its own steps: the
    largest error seen in a cross-configuration prediction (x1.22-1.33 on a 2-core
    Xeon), so that noise in that prediction alone does not move the workers."""
    min_served_unproven: float = 0.75
    """An unproven comparison (above) also needs the current configuration predicted to
    serve at least this share of the window's requests within the SLOs (requests/s of
    goodput over the window's arrivals/s): past it, the simulator's cross-configuration
    error is at its largest. In a 2-core Xeon's headline runs of 2026-12-06, the planner
    split the pools at 120% load four times on predictions of 1.3-2x two mixed workers
    (``loadtest/results/headline-xeon-1206-traced/``, ``-cap/``) and served 0.77-0.86x
    colocated there (0.90x once more on the chat workload). It does not hold where the
    current configuration's measured misses were the decode's
    (:func:`planner.window.tpot_bound`)."""
    max_served_rescue: float = 0.3
    """Neither margin (``min_gain_unproven``) nor guard (``min_served_unproven``) holds
    where the current configuration measurably serves less than this share of its
    requests within the SLOs (``Autoscaler.decide(served=...)``): a switch
    then needs ``min_gain`` (reason ``rescue``). On a 2-core AMD EPYC (prefill ~1.5 ms a
    token, a decode step ~12 ms) two mixed workers served 8-17% of the chat headline's
    requests at 120% load, and a split 2-7x their goodput, while ``overloaded`` held
    the planner mixed (``loadtest/results/headline-epyc-1206-chat/``). In sixteen Xeon
    runs of the mixed workload at 120% load, where the splits that ``overloaded``
    refuses served 0.77-0.86x colocated, colocated served 36-96%: the share is below
    that."""
    min_dwell_s: float = 60.0
    confirmations: int = 2
    payback_s: float | None = None
    """How long the window's traffic is taken to go on after a switch, for its cost;
    None: the longer of the window and the dwell time."""
    itl_tolerance: float = 0.05
    """With an ITL score (``Autoscaler(itl=...)``): candidates predicted within this
    share of the best goodput, the current one among them, are told apart by their
    predicted ITL p99 (rule 2b)."""
    min_itl_gain: float = 0.4
    """Rule 2b moves to the candidate of lowest predicted ITL p99 when it is at least this
    much below the current one's (relative)... On a 2-core Xeon's chat headline a split
    entered at 120% load on a predicted 0.64x, both configurations proven, served 0.47x
    colocated's goodput there at 0.94x its ITL p99 (30% was the margin then)."""
    min_itl_gain_unproven: float = 0.5
    """... and this much, where either side is scored without its own calibration."""
    headroom: float = 1.0
    """Rule 2c's extra load: near-tied candidates are told apart by their predicted
    goodput at ``1 + headroom`` times the window's (sessions that start so much more
    often: by default, would it serve twice the load?); 0: no rule 2c. The live loop
    scores it only where this is above 0."""
    remember_s: float | None = None
    """How long a configuration's own calibration is remembered (:class:`FitMemory`);
    None: ten windows. The machine's speed drifts (a VM's halved within an hour), so
    an old calibration is dropped rather than trusted."""

    @property
    def memory_s(self) -> float:
        return self.remember_s or 10 * self.window_s

    @property
    def itl_band(self) -> bool:
        """Whether ``itl_tolerance`` leaves a band below ``min_gain`` where neither rule
        2b nor the goodput rule moves: a candidate within the tolerance of the best can
        trail it by up to ``tol / (1 - tol)``, which must stay under ``min_gain`` (else
        the two rules can undo each other's moves)."""
        tol = self.itl_tolerance
        return tol == 0 or tol / (1 - tol) < self.min_gain

    @property
    def horizon_s(self) -> float:
        return self.payback_s or max(self.window_s, self.min_dwell_s)

    def __post_init__(self) -> None:
        checks = {"interval_s": self.interval_s > 0, "window_s": self.window_s > 0,
                  "min_requests": self.min_requests >= 1, "min_gain": self.min_gain >= 0,
                  "min_gain_unproven": self.min_gain_unproven >= self.min_gain,
                  "min_served_unproven": 0 <= self.min_served_unproven <= 1,
                  "max_served_rescue": 0 <= self.max_served_rescue <= 1,
                  "itl_tolerance": 0 <= self.itl_tolerance < 1,
                  "min_itl_gain": 0 < self.min_itl_gain < 1,
                  "headroom": self.headroom >= 0,
                  "min_itl_gain_unproven": (self.min_itl_gain <= self.min_itl_gain_unproven
                                            < 1),
                  "remember_s": self.remember_s is None or self.remember_s > 0,
                  "min_dwell_s": self.min_dwell_s >= 0, "confirmations": self.confirmations >= 1,
                  "payback_s": self.payback_s is None or self.payback_s > 0}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"AutoscaleConfig.{name} out of range: {getattr(self, name)}")


@dataclass(frozen=True)
class Decision:
    at: float
    current: PoolConfig
    target: PoolConfig | None
    """The configuration to move to; None: stay."""
    reason: str
    scores: dict[str, float] = field(default_factory=dict)
    """Every candidate's score, by its :attr:`~planner.config.PoolConfig.roles_label`."""
    switch_s: float = 0.0
    """The best candidate's role changes: estimated seconds (0: free, or none weighed)."""
    net_gain: float | None = None
    """The best candidate's gain over the horizon with its changes paid (None: not
    weighed: it was not better by ``min_gain`` to begin with)."""
    itl_p99_ms: dict[str, float] = field(default_factory=dict)
    """Predicted ITL p99 of the candidates rule 2b compared, by ``roles_label`` (empty:
    it did not apply)."""
    served: float | None = None
    """The share of the current configuration's recent requests that met the SLOs
    (None: not measured); its score is at least this share of the window's arrivals."""
    tpot_bound: bool = False
    """Whether those requests' misses were the decode's (:func:`planner.window.tpot_bound`): then
    ``overloaded`` does not hold."""
    headroom_goodput: dict[str, float] = field(default_factory=dict)
    """Predicted goodput at rule 2c's heavier load of the candidates it compared (or
    rule 3's second witness, ``seconded``: the current one and the best), by
    ``roles_label``, whether it moved or not (empty: it compared none)."""
    headroom_itl_p99_ms: dict[str, float] = field(default_factory=dict)
    """Predicted ITL p99 at that load of the candidates rule 2c (or the second witness)
    compared on it (those serving as much there), by ``roles_label`` (empty: it
    compared none)."""

    @property
    def action(self) -> str:
        return "switch" if self.target is not None else "stay"


@dataclass
class _Window:
    """One decision under way: what :meth:`Autoscaler.decide` was handed, whether the
    current configuration measurably fails (:meth:`Autoscaler._failing`), and rule 2c's
    (or the second witness's) figures as they are found, for the decision's record."""
    now: float
    current: PoolConfig
    records: Sequence[TrafficRecord]
    move_s: Mapping[str, float] | None
    proven: Collection[str] | None
    itl_records: Sequence[TrafficRecord]
    failing: bool
    tpot_bound: bool
    heavy: dict[str, float] = field(default_factory=dict)
    heavy_itl: dict[str, float] = field(default_factory=dict)


class Autoscaler:
    """Keeps the hysteresis state between decisions; one per cluster, one thread."""

    def __init__(self, candidates: Sequence[PoolConfig], score: Score,
                 config: AutoscaleConfig | None = None, refine: Score | None = None,
                 itl: Score | None = None, headroom: Score | None = None,
                 headroom_itl: Score | None = None) -> None:
        """``refine``: a costlier score (the live loop's: with the best stall-free cap,
        :func:`planner.caps.best_cap_goodput`) taken only where a candidate beats the current one by
        ``min_gain`` on ``score``, for those two, before the rules that follow (3-6).
        ``itl``: a configuration's predicted ITL p99 (ms) on the window, for rule 2b
        (None: goodput alone decides). ``headroom``: its predicted goodput at the
        heavier load of rule 2c (None: no rule 2c); ``headroom_itl``: its predicted ITL
        p99 there (None: 2c compares goodput alone)."""
        if not candidates:
            raise ValueError("the autoscaler needs at least one candidate configuration")
        self.candidates = list(candidates)
        self.score, self.refine, self.itl, self.headroom = score, refine, itl, headroom
        self.headroom_itl = headroom_itl
        self.config = config or AutoscaleConfig()
        if (itl is not None or headroom is not None) and not self.config.itl_band:
            raise ValueError(
                f"AutoscaleConfig.itl_tolerance {self.config.itl_tolerance} leaves no band "
                f"under min_gain {self.config.min_gain} (tolerance / (1 - tolerance) must "
                "be below it): the ITL or headroom rule and the goodput rule would undo "
                "each other")
        self.last_change: float | None = None
        self._leader: PoolConfig | None = None
        self._wins = 0
        self._left_stalled: dict[str, tuple[float, float]] = {}  # label: (when, served)

    def decide(self, now: float, current: PoolConfig, records: Sequence[TrafficRecord],
               move_s: Mapping[str, float] | None = None,
               proven: Collection[str] | None = None,
               itl_records: Sequence[TrafficRecord] | None = None,
               served: float | None = None, tpot_bound: bool = False) -> Decision:
        """``move_s``: seconds a worker leaving each role (``mixed``, ``prefill``,
        ``decode``) takes to change; a role not named: free. ``proven``: the
        ``roles_label`` s of the configurations scored with their own calibration (None:
        every one). ``itl_records``: the traffic rule 2b's ITL p99 is predicted on
        (default ``records``; the live loop hands it a longer span: one window's p99
        swings with whether a long prompt landed among many decodes in it). ``served``:
        the share of the current configuration's recent requests that met the SLOs
        (:func:`planner.window.served_share`; None: not measured): its score's floor is
        that share of the window's arrivals per second, and below ``max_served_rescue``
        a switch is a rescue. ``tpot_bound``: whether its misses there were the decode's
        (:func:`planner.window.tpot_bound`): no ``overloaded`` guard then."""
        w = _Window(now, current, records, move_s, proven, itl_records or records,
                    self._failing(served), tpot_bound)
        return replace(self._decide(w, served), served=served, tpot_bound=tpot_bound,
                       headroom_goodput=w.heavy, headroom_itl_p99_ms=w.heavy_itl)

    def _decide(self, w: _Window, served: float | None) -> Decision:
        """:meth:`decide`, its decision without ``served`` and the headroom figures."""
        c = self.config
        now, current, records = w.now, w.current, w.records
        if len(records) < c.min_requests:
            self._leader, self._wins = None, 0
            return Decision(now, current, None, "few_requests")
        pool = self.candidates if current in self.candidates else [current, *self.candidates]
        quick = [cand for cand in pool if cand != current
                 and self._quicker(current, cand, w.itl_records)] if w.failing else []
        stalled = bool(quick)  # then only those are weighed, the current one as served
        if stalled:
            pool = [current, *quick]
        arriving = len(records) / c.window_s
        floor = (served or 0.0) * arriving

        def bounded(cand: PoolConfig, predicted: float) -> float:
            """The current one: at least what it serves (stalled: just that); another
            left for its stalls: at most what it served then."""
            if cand == current:
                return floor if stalled else max(predicted, floor)
            return min(predicted, self._stalled_cap(cand, now))

        scores = {cand: bounded(cand, self.score(cand, records)) for cand in pool}
        labels = {cand.roles_label: s for cand, s in scores.items()}
        quicker, itl = self._lower_itl(w, pool, scores, labels)
        if quicker is not None:
            return quicker
        roomier = self._roomier(w, pool, scores, labels, itl)
        if roomier is not None:
            return roomier
        shown = {"itl_p99_ms": itl}  # compared, and no move for it
        best = max(pool, key=lambda cand: (scores[cand], cand == current))
        if best == current:
            self._leader, self._wins = None, 0
            return Decision(now, current, None, "current_best", labels, **shown)
        base = scores[current]
        gain = (scores[best] - base) / base if base > 0 else float("inf")
        if self.refine is not None and gain >= c.min_gain:
            for cand in (current, best):
                if cand == current and stalled:
                    continue  # scored as served: no simulation of it counts
                scores[cand] = labels[cand.roles_label] = bounded(
                    cand, self.refine(cand, records))
            base = scores[current]
            gain = (scores[best] - base) / base if base > 0 else float("inf")
        if gain < c.min_gain:
            self._leader, self._wins = None, 0
            return Decision(now, current, None, "gain_below_threshold", labels, **shown)
        both = _proven(w.proven, best, current)
        rescue = not both and served is not None and served < c.max_served_rescue
        bar = c.min_gain if both or rescue else c.min_gain_unproven
        why = "stalled" if stalled else "rescue" if rescue else "switch"
        overloaded = (not both and not rescue and not w.tpot_bound
                      and base < c.min_served_unproven * arriving)
        if gain < bar and not overloaded and self._seconded(w, best):
            bar, why = c.min_gain, "seconded"  # (its simulations spared where refused)
        if gain < bar:
            self._leader, self._wins = None, 0
            return Decision(now, current, None, "unproven", labels)
        if overloaded:
            self._leader, self._wins = None, 0
            return Decision(now, current, None, "overloaded", labels)
        busy, net = self._net(w, best, scores, self.refine or self.score)
        d = self._commit(w, best, labels, busy, net, net >= bar, why)
        if d.target is not None and why == "stalled":
            self._left_stalled[current.roles_label] = (now, floor)
        return d

    def _stalled_cap(self, cand: PoolConfig, now: float) -> float:
        """The most ``cand`` is scored: what it served when the planner left it as
        ``stalled``, for ``memory_s`` after (else no cap). The simulator's prediction of
        it is the one the stalled rescue set aside; without the cap the goodput rule
        could move back to it as soon as the configuration entered serves less than
        that prediction, and the two would take turns."""
        at, served = self._left_stalled.get(cand.roles_label, (-math.inf, math.inf))
        return served if now - at <= self.config.memory_s else math.inf

    def _failing(self, served: float | None) -> bool:
        """Whether the current configuration measurably serves less than
        ``max_served_rescue`` of its requests within the SLOs."""
        return served is not None and served < self.config.max_served_rescue

    def _quicker(self, slow: PoolConfig, quick: PoolConfig,
                 itl_records: Sequence[TrafficRecord]) -> bool:
        """Whether ``quick`` is predicted at most ``1 - min_itl_gain_unproven`` of
        ``slow``'s ITL p99 (False without an ITL score)."""
        if self.itl is None:
            return False
        its = self.itl(slow, itl_records)
        fast = self.itl(quick, itl_records) if its > 0 else 0.0
        # 0: no simulated request ended with two tokens (not a quick configuration)
        return 0 < fast <= (1 - self.config.min_itl_gain_unproven) * its

    def _seconded(self, w: _Window, best: PoolConfig) -> bool:
        """Rule 3's second witness (with a headroom score): an unproven gain between
        ``min_gain`` and ``min_gain_unproven`` is enough where, at rule 2c's heavier
        load, ``best`` is predicted on its own an unproven-sized lead over the current
        one: ``min_gain_unproven`` more goodput, or (with a headroom ITL score) at least
        ``1 - itl_tolerance`` of its goodput at ``min_itl_gain_unproven`` less ITL p99.
        The figures compared land in the decision (``headroom_goodput``,
        ``headroom_itl_p99_ms``)."""
        c, current = self.config, w.current
        if self.headroom is None:
            return False
        heavy = {cand: self.headroom(cand, w.records) for cand in (current, best)}
        w.heavy = {cand.roles_label: g for cand, g in heavy.items()}
        if heavy[best] <= 0:
            return False
        if heavy[best] >= (1 + c.min_gain_unproven) * heavy[current]:
            return True
        if self.headroom_itl is None or heavy[best] < (1 - c.itl_tolerance) * heavy[current]:
            return False
        its = {cand: self.headroom_itl(cand, w.records) for cand in (current, best)}
        w.heavy_itl = {cand.roles_label: ms for cand, ms in its.items()}
        return its[current] > 0 and its[best] <= (1 - c.min_itl_gain_unproven) * its[current]

    def _net(self, w: _Window, best: PoolConfig, scores: Mapping[PoolConfig, float],
             score: Score) -> tuple[float, float]:
        """The switch's role changes' seconds and its net gain over the horizon (rule 4),
        what serves while they run scored by ``score`` (as ``scores`` were)."""
        current = w.current
        base = scores[current]
        busy = sum((w.move_s or {}).get(role, 0.0) for role in moves(current, best))
        if busy <= 0:
            return 0.0, (scores[best] - base) / base if base > 0 else float("inf")
        h = self.config.horizon_s
        during = serving_while_moving(current, best)
        g_during = score(during, w.records) if during is not None else 0.0
        served = g_during * min(busy, h) + scores[best] * max(0.0, h - busy)
        return busy, (served / (base * h) - 1 if base > 0 else (
            float("inf") if served > 0 else -1.0))

    def _commit(self, w: _Window, best: PoolConfig, labels: dict[str, float], busy: float,
                net: float, paid: bool, why: str, itl: dict[str, float] | None = None
                ) -> Decision:
        """Rules 4-6 for a candidate that won on goodput (``why``: ``switch``, ``rescue``,
        ``stalled``, ``seconded``), on ITL (``lower_itl``) or on room (``headroom``); ``paid``: its
        net gain passed rule 4's bar."""
        c, now, current = self.config, w.now, w.current
        cost = {"switch_s": busy, "net_gain": net, "itl_p99_ms": itl or {}}
        if w.failing and self._quicker(best, current, w.itl_records):
            self._leader, self._wins = None, 0  # the stalled rescue's mirror, any rule
            return Decision(now, current, None, "stalling", labels, **cost)
        if not paid:
            self._leader, self._wins = None, 0
            return Decision(now, current, None, "switch_cost", labels, **cost)
        # By roles: the stall-free cap may change between two decisions of one leader.
        self._wins = (self._wins + 1 if self._leader is not None
                      and best.roles_label == self._leader.roles_label else 1)
        self._leader = best
        if self.last_change is not None and now - self.last_change < c.min_dwell_s:
            return Decision(now, current, None, "dwell", labels, **cost)
        if self._wins < c.confirmations and why not in ("rescue", "stalled"):
            return Decision(now, current, None, "confirming", labels, **cost)
        self.last_change, self._leader, self._wins = now, None, 0
        return Decision(now, current, best, why, labels, **cost)

    def _near(self, current: PoolConfig, pool: Sequence[PoolConfig],
              scores: Mapping[PoolConfig, float]) -> list[PoolConfig]:
        """The candidates within ``itl_tolerance`` of the best predicted goodput when the
        current one is among them and is not alone there (else none): rules 2b and 2c
        choose among these."""
        top = max(scores.values())
        if top <= 0:
            return []
        near = [cand for cand in pool if scores[cand] >= (1 - self.config.itl_tolerance) * top]
        return near if current in near and len(near) >= 2 else []

    def _roomier(self, w: _Window, pool: Sequence[PoolConfig],
                 scores: Mapping[PoolConfig, float], labels: dict[str, float],
                 itl: Mapping[str, float]) -> Decision | None:
        """Rule 2c: where no candidate beats the current one by ``min_gain`` (the
        goodput rule would not move), among those predicted at least ``1 -
        itl_tolerance`` of its goodput, the one of most predicted goodput at the heavier
        load (``headroom``), when that beats the current one's there by ``min_gain``
        (``min_gain_unproven`` unless both are proven) and rule 2b would not leave it
        (:meth:`_left_by_2b`); else (:meth:`_quicker_heavier`) the one quickest there,
        on 2b's terms, where 2b would not leave it either. Rules 4-6 follow as for 2b.
        None: the rule does not apply, and goodput decides. The goodput rule does not
        undo it: no candidate, the one left among them, is predicted ``min_gain`` more
        than the target (with three or more, one that is leaves the target out)."""
        c, current = self.config, w.current
        mine, top = scores[current], max(scores.values())
        if self.headroom is None or mine <= 0 or top >= (1 + c.min_gain) * mine:
            return None
        # (the current one is among these, by the line above)
        near = [cand for cand in pool if scores[cand] >= (1 - c.itl_tolerance) * mine
                and (1 + c.min_gain) * scores[cand] > top]  # the goodput rule stays there
        if len(near) < 2:
            return None
        heavy = {cand: self.headroom(cand, w.records) for cand in near}
        w.heavy = {cand.roles_label: g for cand, g in heavy.items()}
        roomy = max(near, key=lambda cand: (heavy[cand], cand == current))
        base = heavy[current]
        gain = (heavy[roomy] - base) / base if base > 0 else float("inf")
        if roomy == current or gain < (c.min_gain if _proven(w.proven, roomy, current)
                                       else c.min_gain_unproven) or self._left_by_2b(roomy, itl):
            roomy = self._quicker_heavier(w, near, heavy)
            if roomy is None or self._left_by_2b(roomy, itl):
                return None
        busy, net = self._net(w, roomy, scores, self.score)
        return self._commit(w, roomy, labels, busy, net, net >= -c.itl_tolerance,
                            "headroom", dict(itl))

    def _left_by_2b(self, target: PoolConfig, itl: Mapping[str, float]) -> bool:
        """Whether rule 2b would leave ``target`` for a quicker candidate: one's
        predicted ITL p99, where 2b compared them (``itl``), is ``min_itl_gain`` below
        its."""
        its = itl.get(target.roles_label)
        return its is not None and any(ms <= (1 - self.config.min_itl_gain) * its
                                       for ms in itl.values())

    def _quicker_heavier(self, w: _Window, near: Sequence[PoolConfig],
                         heavy: Mapping[PoolConfig, float]) -> PoolConfig | None:
        """Rule 2c on ITL: among ``near``, those predicted at least ``1 -
        itl_tolerance`` of the current one's goodput at the heavier load (``heavy``)
        and not ``min_gain`` less than any's there (else 2c's goodput branch would
        leave it: with three candidates, two paid switches), the one of lowest
        predicted ITL p99 there, when that is ``min_itl_gain``
        (``min_itl_gain_unproven`` unless both are proven) below the current one's
        there. None: no headroom ITL score, or none is enough quicker."""
        c, current = self.config, w.current
        if self.headroom_itl is None:
            return None
        top = max(heavy.values())
        able = [current] + [cand for cand in near if cand != current
                            and heavy[cand] >= (1 - c.itl_tolerance) * heavy[current]
                            and (1 + c.min_gain) * heavy[cand] > top]
        its = {cand: self.headroom_itl(cand, w.records) for cand in able}
        w.heavy_itl = {cand.roles_label: ms for cand, ms in its.items()}
        quick = min(able, key=lambda cand: (its[cand], cand != current))
        margin = (c.min_itl_gain if _proven(w.proven, quick, current)
                  else c.min_itl_gain_unproven)
        return quick if quick != current and its[quick] <= (1 - margin) * its[current] \
            else None

    def _lower_itl(self, w: _Window, pool: Sequence[PoolConfig],
                   scores: Mapping[PoolConfig, float], labels: dict[str, float]
                   ) -> tuple[Decision | None, dict[str, float]]:
        """Rule 2b: among the candidates within ``itl_tolerance`` of the best predicted
        goodput, the current one among them, the one of lowest predicted ITL p99, when
        that is ``min_itl_gain`` (unproven: ``min_itl_gain_unproven``) below the current
        one's. Not refused as ``overloaded`` (rule 3's guard against the large gains the
        simulator predicts across configurations at overload: here the gain asked for
        is none, and on a 2-core Xeon's mixed headline at 120% load the split this
        would have entered, predicted 0.1x the ITL p99 at equal goodput, served 0.94-1.09x
        colocated's goodput at 0.13x its ITL p99). Rules 4-6 follow, rule 4
        asking only that the switch lose at most ``itl_tolerance`` of the goodput over
        the horizon. No decision (None): the rule does not apply (no ITL score, no
        candidate serves anything, the current configuration is not among the
        near-best, or none is enough quicker), and goodput decides; beside it, the ITLs
        compared (empty: none)."""
        c, now, current = self.config, w.now, w.current
        near = self._near(current, pool, scores)
        if self.itl is None or not near:
            return None, {}
        itl = {cand: self.itl(cand, w.itl_records) for cand in near}
        shown = {cand.roles_label: ms for cand, ms in itl.items()}
        quick = min(near, key=lambda cand: (itl[cand], cand != current))
        if quick == current or not itl[quick] <= (1 - c.min_itl_gain) * itl[current]:
            return None, shown
        both = _proven(w.proven, quick, current)
        if not both and not itl[quick] <= (1 - c.min_itl_gain_unproven) * itl[current]:
            self._leader, self._wins = None, 0
            return Decision(now, current, None, "unproven", labels, itl_p99_ms=shown), shown
        busy, net = self._net(w, quick, scores, self.score)
        return self._commit(w, quick, labels, busy, net, net >= -c.itl_tolerance,
                            "lower_itl", shown), shown


def _proven(proven: Collection[str] | None, *configs: PoolConfig) -> bool:
    """Whether every one of ``configs`` is scored on its own calibration (``proven``
    None: every configuration is)."""
    return proven is None or {cand.roles_label for cand in configs} <= set(proven)


Fit = TypeVar("Fit")


class FitMemory(Generic[Fit]):
    """Each configuration's serving calibration as last fitted on a window it served
    whole (no role change inside it), by label (``PoolConfig.roles_label``: the fit is
    of step times, which a stall-free cap does not change), kept ``keep_s`` seconds. The
    live loop notes the current configuration's fit after each clean window and scores
    every candidate with :meth:`own`, falling back to the current window's fit."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._fits: dict[str, tuple[float, Fit]] = {}

    def note(self, label: str, fit: Fit, at: float) -> None:
        self._fits[label] = (at, fit)

    def own(self, label: str, now: float) -> Fit | None:
        """``label``'s own calibration, if fitted at most ``keep_s`` before ``now``."""
        at, fit = self._fits.get(label, (-float("inf"), None))
        return fit if 0 <= now - at <= self.keep_s else None

    def proven(self, now: float) -> set[str]:
        """The labels with an own calibration at ``now``."""
        return {label for label in self._fits if self.own(label, now) is not None}
