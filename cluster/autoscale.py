"""``pdserve up --autoscale``: the live planner driving a local cluster's worker roles.

Lifecycle: started once the cluster serves (:meth:`AutoscaleLoop.start`: a daemon
thread, reniced by :data:`PLANNER_NICE` so the workers' steps come first), it wakes
every ``autoscale_interval_s``, reads the last three intervals of traffic
the routers wrote to Redis (:mod:`common.traffic`: the requests in flight too,
each with the median output of those ended in the last :data:`HISTORY_WINDOWS`
windows, :func:`common.traffic.expected_outputs`),
and asks
:class:`planner.autoscale.Autoscaler` whether another configuration the workers can
reach by changing roles would serve it with more goodput, by simulating each on the
machine profile (:func:`planner.scores.simulated_goodput`). The profile's serving
calibration is refitted first from the steps the workers served in the same window
(they publish them, ``pdserve worker --publish-steps``: :mod:`common.served_steps`,
:func:`common.served_fit.fit_served_roles`: all roles' steps together, and each role's
own where they make a fit), so the simulator runs at the machine's speed of those
minutes. A window whose steps make no fit (too few, a quiet window; or factors no
machine's speed explains, which a few seconds of steps can give) keeps the last accepted
calibration while it is at most :data:`KEEP_FIT_WINDOWS` windows old, then the
profile's own. A window the current configuration served whole (no role change inside
it) is also remembered as that configuration's own calibration
(:class:`planner.autoscale.FitMemory`, ``AutoscaleConfig.remember_s``): each candidate is
scored with its own while it has one, else with the window's, and a candidate without
one must win by ``min_gain_unproven`` (the steps of one configuration misjudge another's
by up to 2x; :mod:`planner.autoscale`). A
``switch`` is carried out one worker at a time
(:meth:`cluster.local.LocalCluster.set_role`: the worker drains, swaps its KV channel end
and registers again, weights kept; the router follows through the registry and, while no
pair of pools can split, serves whole requests on any worker). A worker that cannot drain
in time keeps its role; the next decision starts from whatever roles the workers have.
Each change is timed, by the role it leaves, and a switch is weighed with its changes'
seconds (:meth:`AutoscaleLoop.move_estimates`; the cost rule of
:mod:`planner.autoscale`).

With ``--autoscale-prefill-cap``, a candidate that wins is scored again, with the
current one, each with its best stall-free cap (``--prefill-tokens-while-decoding``,
:func:`planner.caps.best_cap_goodput`), and when the roles stay, the cap is decided
next (:class:`planner.caps.PrefillCapChooser`, on the last :data:`CAP_WINDOWS`
windows of traffic) and, on a change, set on every worker (``SetRole`` keeping the
role: the worker takes it at its next step).

Every decision is logged (one line: action, reason, each candidate's predicted goodput)
and counted on the planner's own ``/metrics`` (``planner_decisions_total{action,reason}``,
``planner_predicted_goodput{config}``, ``planner_role_changes_total{role}``,
``planner_served_factor{term}`` and ``planner_served_steps``: the calibration it
simulated with, ``term`` one of memory, compute, per_seq_ms, decode_min, decode_max; 0
steps: the profile's; ``planner_move_seconds{role}``: a change leaving ``role`` measured,
``planner_switch_seconds``: the last weighed switch's changes; for the cap
``planner_prefill_cap``, ``planner_cap_decisions_total{action,reason}`` and
``planner_predicted_itl_p99_ms{cap}``; ``planner_served_share``: the share of recent
requests the running configuration served within the SLOs, ``planner_served_tpot_bound``:
whether their misses were the decode's), served
beside the router's when the cluster has a metrics port. :meth:`AutoscaleLoop.stop`
ends the thread between decisions.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import grpc
import redis

from common.cost_model import load_profile
from common.metrics import Metrics
from common.redis_url import connect as connect_redis
from common.registry import ROLES
from common.served_fit import ServedFitError, ServedFits, fit_served_roles
from common.served_steps import StepLog
from common.threads import lower_thread_priority
from common.traffic import TrafficLog, TrafficRecord, expected_outputs
from loadtest.metrics import percentile
from planner.autoscale import AutoscaleConfig, Autoscaler, Decision, FitMemory
from planner.caps import CapDecision, PrefillCapChooser, best_cap_goodput, prefill_caps
from planner.config import PoolConfig
from planner.moves import current_config, reachable, role_changes
from planner.scores import Predict, Score, goodput_of, itl_of, per_window, simulated
from planner.window import served_measures, window_slo
from workers.engine.params import resolve_block_size

from .local import LocalCluster, free_port

log = logging.getLogger(__name__)


KEEP_FIT_WINDOWS = 2
"""How many windows a refused window's decision may still use the last accepted fit."""

HISTORY_WINDOWS = 4
"""How many windows of ended requests give an in-flight one its expected output."""

CAP_WINDOWS = 2
"""How many windows of traffic ITL p99 is predicted on: the stall-free cap's, and rule
2b's (:mod:`planner.autoscale`). One 15 s window's
predicted ITL p99 without a cap swung between ~60 and 480-790 ms at 120% load in a
2-core Xeon's headline run; four (60 s) held steady but took ~460 ms of the planner's CPU
a decision there, and reacted 20-25 s into a 30 s point."""

PLANNER_NICE = 10
"""How much the planner's thread is reniced (:func:`common.threads.lower_thread_priority`).
Its simulations take ~0.1-0.5 s of CPU a decision on the cores the workers step on; at
the same priority a step that wakes beside one waited its turn, which raised the adaptive
cluster's ITL p99 to 1.2-1.3x colocated's at 25% load in a 2-core Xeon's headline while
it ran the very same configuration. At nice 10 a waking worker preempts it, and under
full load it still gets ~10% of a core, enough for a decision every few seconds. On a
2-core EPYC at 25% load it spent 0.00-0.14 s a decision (``planner_decision_cpu_seconds``)
and the ITL p99 at nice 10, at ``SCHED_IDLE`` and without a planner lay within 0.88-1.04x
of each other (``loadtest/results/planner-priority-ab-epyc-1206/``)."""

MOVE_WEIGHT = 0.5
"""A measured role change's weight in its role's estimate (the rest: the ones before)."""


class AutoscaleLoop:
    def __init__(self, cluster: LocalCluster, config: AutoscaleConfig | None = None,
                 metrics: Metrics | None = None) -> None:
        c = cluster.config
        assert c.profile, "DeploymentConfig.check_autoscale: --autoscale needs --profile"
        if cluster.redis_url is None:
            raise ValueError("--autoscale reads the routers' traffic from Redis: run with "
                             "the prefix index (no --no-redis)")
        self.cluster = cluster
        # Its simulated workers chunk prompts as the real ones do.
        profile = replace(load_profile(c.profile),
                          max_num_batched_tokens=c.max_num_batched_tokens)
        blocks = resolve_block_size(c.block_size, "cuda" if c.gpus_per_worker else "cpu")
        if blocks != profile.block_size:
            log.warning("autoscale: %s was measured with %d-token KV blocks and the workers "
                        "run %d: its prefix-cache hits and attention times are off; profile "
                        "again (`pdserve profile`) or run --block-size %d", c.profile,
                        profile.block_size, blocks, profile.block_size)
        interval = c.autoscale_interval_s
        self.config = config or AutoscaleConfig(
            interval_s=interval, window_s=3 * interval, min_dwell_s=3 * interval,
            headroom=c.autoscale_headroom)
        self._reachable = reachable(len(cluster.workers), cluster.threads,
                                    c.local_prefill_threshold, c.itl_budget_ms, c.kv_offer,
                                    c.slo_ttft_ms)  # the router's own (cluster.deployment)
        self.profile, self._slo = profile, (c.slo_ttft_ms, c.slo_tpot_ms)
        figures = self._figures(None, {})  # the profile's, until a window's fit
        self.caps = PrefillCapChooser(prefill_caps(profile, cluster.threads), figures,
                                      min_requests=self.config.min_requests,
                                      confirmations=self.config.confirmations)
        """The stall-free cap, decided after the roles, on the same calibration and the
        last :data:`CAP_WINDOWS` windows of traffic."""
        self.choose_cap = c.autoscale_prefill_cap
        """``--autoscale-prefill-cap``: decide the cap, and refine a winner at its best."""
        self.itl = c.autoscale_itl
        """``--autoscale-itl`` (opt-in): rule 2b of :mod:`planner.autoscale`, a move to a
        configuration of equal predicted goodput and much lower ITL p99."""
        self.autoscaler = Autoscaler(self._with_cap(c.prefill_tokens_while_decoding),
                                     goodput_of(figures), self.config, self._refine(figures),
                                     itl_of(figures) if self.itl else None,
                                     *self._headroom(None, {}))
        self._redis = connect_redis(cluster.redis_url, socket_timeout=5,
                                    socket_connect_timeout=5)
        self.traffic = TrafficLog(self._redis, Path(c.model).name)
        self.steps = StepLog(self._redis, Path(c.model).name)
        self.calibration: ServedFits | None = None
        """The window's served steps' calibration the last decision simulated with (None:
        the profile's own); a candidate with its own in :attr:`memory` took that."""
        self.memory: FitMemory[ServedFits] = FitMemory(self.config.memory_s)
        self._settled_at = -math.inf  # when the last switch's role changes ended
        self._cap_set_at = -math.inf  # when the stall-free cap last changed (the served
        # floor waits a window after it; a role's own calibration does not: a cap does not
        # change what a step of given sums takes)
        self._scored: tuple = (None, {})  # the window's fit and each own fit, by label:
        # what the autoscaler's score simulates with
        self._refused: tuple[str, bool] | None = None  # the last refusal's kind and if kept
        self._fitted_at = -math.inf  # when the calibration was fitted
        self.metrics = metrics or Metrics({"component": "planner"})
        self.metrics_cap(c.prefill_tokens_while_decoding)
        self.moves: dict[str, float] = {}
        """Measured seconds a worker leaving each role took to change (a moving
        average); a role not measured yet: :meth:`move_estimates`' prior."""
        self.decisions: list[Decision] = []
        self.cap_decisions: list[CapDecision | None] = []
        """Beside each decision, the cap's (None: the roles changed, or caps are not
        decided: no ``--autoscale-prefill-cap``)."""
        self.step_models: list[str] = []
        """Beside each decision, the serving calibration it simulated with."""
        self.cpu_seconds: list[float] = []
        """Beside each decision, the CPU seconds this thread spent on it (its
        simulations, on the cores the workers step on)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> AutoscaleLoop:
        self._thread = threading.Thread(target=self._run, name="pdserve-autoscale",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self._redis.close()

    def _run(self) -> None:
        nice = lower_thread_priority(PLANNER_NICE)
        log.info("autoscale: planning every %.0f s at nice %s", self.config.interval_s,
                 "unchanged (this platform renices no single thread)" if nice is None
                 else nice)
        while not self._stop.wait(self.config.interval_s):
            try:
                self.tick(time.time())
            except (redis.RedisError, grpc.RpcError, ValueError) as e:
                log.warning("autoscale: no decision this round: %s", e)

    def tick(self, now: float) -> Decision | None:
        """One decision and, on a switch, its role changes (blocking through drains).
        None while the workers' roles form no configuration (a change half done)."""
        began = time.monotonic()  # with ``now``: the caller's clock
        cpu = time.thread_time()
        roles = self._roles()
        current = current_config(roles, self.autoscaler.candidates)
        if current is None:
            return None
        since = now - self.config.window_s
        seen = self.traffic.recent(now - HISTORY_WINDOWS * self.config.window_s)
        window = [r for r in seen if r.arrival >= since]
        records = expected_outputs(window, [r for r in seen if r.arrival < since])
        # A p99 of one window's gaps swings with whether a long prompt landed among many
        # decodes in it: ITL (rule 2b, and the cap) is predicted on a longer span.
        span = [r for r in seen if r.arrival >= now - CAP_WINDOWS * self.config.window_s]
        longer = expected_outputs(span)
        self.recalibrate(now)
        proven = set(self._scored[1])  # the candidates the score runs on their own fit
        served, decode_misses = self.served(now, seen) or (None, False)
        d = self.autoscaler.decide(now, current, records, self.move_estimates(records),
                                   proven, longer, served, decode_misses)
        self.decisions.append(d)
        self.cpu_seconds.append(time.thread_time() - cpu)
        self.metrics.set("planner_decision_cpu_seconds", self.cpu_seconds[-1])
        self.step_models.append(self._describe(proven))
        self.metrics.inc("planner_decisions_total", action=d.action, reason=d.reason)
        for label, goodput in d.scores.items():
            self.metrics.set("planner_predicted_goodput", goodput, config=label)
        for label, itl in d.itl_p99_ms.items():
            self.metrics.set("planner_predicted_config_itl_p99_ms", itl, config=label)
        for label, goodput in d.headroom_goodput.items():
            self.metrics.set("planner_predicted_headroom_goodput", goodput, config=label)
        for label, itl in d.headroom_itl_p99_ms.items():
            self.metrics.set("planner_predicted_headroom_itl_p99_ms", itl, config=label)
        if d.served is not None:
            self.metrics.set("planner_served_share", d.served)
            self.metrics.set("planner_served_tpot_bound", float(d.tpot_bound))
        if d.net_gain is not None:
            self.metrics.set("planner_switch_seconds", d.switch_s)
        cost = (f"; switching takes ~{d.switch_s:.1f} s of role changes, net gain "
                f"{d.net_gain:+.0%}" if d.net_gain is not None and d.switch_s else "")
        itl = ("; predicted ITL p99 " + ", ".join(f"{k}: {v:.0f} ms"
                                                  for k, v in d.itl_p99_ms.items())
               if d.itl_p99_ms else "")
        served = (f" (served {d.served:.0%} within the SLOs"
                  + (", the misses TPOT's" if d.tpot_bound else "") + ")"
                  if d.served is not None else "")
        itl += (f"; at {1 + self.config.headroom:g}x the load: " + ", ".join(
            f"{k}: {v:.3f}/s" + (f", {d.headroom_itl_p99_ms[k]:.0f} ms"
                                 if k in d.headroom_itl_p99_ms else "")
            for k, v in d.headroom_goodput.items()) if d.headroom_goodput else "")
        log.info("autoscale: %s (%s) at %s with %d requests in the window; predicted goodput "
                 "%s%s%s%s; step model: %s; %.2f s of CPU", d.action, d.reason, current.label,
                 len(records), ", ".join(f"{k}: {v:.3f}/s" for k, v in d.scores.items())
                 or "-", served, itl, cost, self.step_models[-1], self.cpu_seconds[-1])
        if d.target is not None:
            self.caps.reset()
            self.cap_decisions.append(None)
            try:
                self._change_roles(roles, current, d)
            finally:
                self._settled_at = now + (time.monotonic() - began)
            return d
        if not self.choose_cap:
            self.cap_decisions.append(None)
            return d
        try:
            cd = self.caps.decide(now, current, longer)
        except BaseException:
            self.cap_decisions.append(None)  # still one beside each decision
            raise
        self.cap_decisions.append(cd)
        self.metrics.inc("planner_cap_decisions_total", action="set" if cd.target is not None
                         else "keep", reason=cd.reason)
        for cap, (_, itl) in cd.predicted.items():
            self.metrics.set("planner_predicted_itl_p99_ms", itl, cap=str(cap))
        if cd.predicted:
            log.info("autoscale: prompt tokens a step while decoding: %s (%s) at %s; "
                     "predicted goodput, ITL p99: %s", "set" if cd.target is not None
                     else "keep", cd.reason, cd.current or "no cap",
                     ", ".join(f"{cap or 'no cap'}: {g:.3f}/s, {itl:.0f} ms"
                               for cap, (g, itl) in cd.predicted.items()))
        if cd.target is not None:
            try:
                self._set_cap(roles, current, cd.target, cd.reason)
            finally:  # what it serves from now on is the new cap's (the served floor)
                self._cap_set_at = now + (time.monotonic() - began)
        return d

    def _refine(self, figures: Predict) -> Score | None:
        return best_cap_goodput(figures, self.caps.caps) if self.choose_cap else None

    def _with_cap(self, cap: int) -> list[PoolConfig]:
        return [replace(c, prefill_tokens_while_decoding=cap) for c in self._reachable]

    def metrics_cap(self, cap: int) -> None:
        self.metrics.set("planner_prefill_cap", cap)

    def _set_cap(self, roles: dict[str, str], current: PoolConfig, cap: int,
                 reason: str) -> None:
        """Every worker's stall-free cap (``SetRole`` keeping its role), then the
        candidates': the next decisions start from it. A worker that refuses (it is
        gone, or shutting down) keeps its own; the others still take it, and the first
        refusal is raised once all were asked (a restarted worker starts with the cap
        its cluster last recorded for it)."""
        why = (f"autoscale: {current.prefill_tokens_while_decoding or 'no cap'} -> "
               f"{cap or 'no cap'} prompt tokens a step while decoding ({reason})")
        refused: list[grpc.RpcError] = []
        for address in roles:
            try:
                self.cluster.set_role(address, "", reason=why, prefill_cap=cap)
            except grpc.RpcError as e:
                refused.append(e)
        self.autoscaler.candidates = self._with_cap(cap)
        self.metrics_cap(cap)
        log.info("%s: set on %d of %d workers", why, len(roles) - len(refused), len(roles))
        if refused:
            raise refused[0]

    def _roles(self) -> dict[str, str]:
        return dict(zip(self.cluster.worker_addresses,
                        (role for _, role in self.cluster.workers), strict=True))

    def _describe(self, proven: set[str]) -> str:
        """The calibrations a decision simulated with, for its log line."""
        window = self.calibration.describe() if self.calibration else "the profile's"
        own = ", ".join(sorted(proven))
        return window + (f" | own calibration: {own}" if own else "")

    def _change_roles(self, roles: dict[str, str], current: PoolConfig, d: Decision) -> None:
        """``d``'s switch, one worker at a time, each change timed by the role it left."""
        assert d.target is not None
        for address, role in role_changes(roles, d.target):
            why = f"autoscale: {current.label} -> {d.target.label} ({d.reason})"
            started = time.monotonic()
            try:
                self.cluster.set_role(address, role, reason=why)
            except grpc.RpcError as e:  # a drain that timed out took its time too
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self._moved(roles[address], time.monotonic() - started)
                raise
            self._moved(roles[address], time.monotonic() - started)
            self.metrics.inc("planner_role_changes_total", role=role)
            log.info("autoscale: %s is now %s", address, role)

    def served(self, now: float, seen: Sequence[TrafficRecord]) -> tuple[float, bool] | None:
        """The share of its requests the running configuration measurably served within
        the SLOs (:func:`planner.window.served_share`: its score's floor, and the
        rescue's test), and whether its misses were the decode's
        (:func:`planner.window.tpot_bound`): of one window of arrivals that ended a
        lag ago, the lag the 90th percentile of the ended requests' latency (at most a
        window), so that few of them are still in flight. None: no request has ended,
        the span holds fewer than ``min_requests``, or it began before the last switch
        (of roles, or of the stall-free cap) settled."""
        latencies = [r.e2e_s for r in seen if r.e2e_s is not None]
        if not latencies:
            return None
        w = self.config.window_s
        end = now - min(w, percentile(latencies, 90))
        if end - w < max(self._settled_at, self._cap_set_at):
            return None
        span = [r for r in seen if end - w <= r.arrival < end]
        if len(span) < self.config.min_requests:
            return None
        slo = window_slo(self.profile.step(self.cluster.threads), span, *self._slo)
        return served_measures(span, slo)

    def move_estimates(self, records: Sequence[TrafficRecord]) -> dict[str, float]:
        """Seconds a worker leaving each role takes to change, for the switch's cost:
        measured (:attr:`moves`), else a prior from what the role drains
        (:mod:`workers.roles`): nothing for mixed; for prefill and decode the drain's
        grace plus one prefill of the window's mean prompt on the profile (the prompts,
        or the KV of the reservations, placed there just before it left)."""
        prompt = int(sum(r.prompt_tokens for r in records) / max(1, len(records)))
        prior = (self.cluster.config.drain_grace_s
                 + self.profile.step(self.cluster.threads).prefill_seconds(prompt))
        return {role: self.moves.get(role, 0.0 if role == "mixed" else prior)
                for role in ROLES}

    def _moved(self, role: str, seconds: float) -> None:
        before = self.moves.get(role)
        self.moves[role] = seconds if before is None else (
            MOVE_WEIGHT * seconds + (1 - MOVE_WEIGHT) * before)
        self.metrics.set("planner_move_seconds", self.moves[role], role=role)


    def recalibrate(self, now: float) -> ServedFits | None:
        """Refit the simulator's serving calibration from the workers' steps of the
        window (:func:`common.served_fit.fit_served_roles`) and score with it. A refused fit
        (too few steps, factors no machine's speed explains, or the steps not readable:
        Redis away) keeps the last accepted one while it is at most
        :data:`KEEP_FIT_WINDOWS` windows old, else scores every candidate with the
        profile's own (remembered ones too: no fit of the machine's speed now): a
        2-core Xeon's 15 s windows of recorded steps fitted memory factors from x0.23 to
        x1.43 (they tell memory from compute poorly; below 0.2 is refused:
        ``loadtest/results/served-decode-table-xeon-1205/windows15.txt``), and in a
        headline run two refused windows put the planner back on the profile's
        calibration for the very decision that split the pools.

        An accepted fit of a window that began after the last switch's role changes
        ended is also noted as the current configuration's own (:attr:`memory`); the
        score takes each candidate's own while remembered, else this window's."""
        threads = self.cluster.threads
        fit: ServedFits | None = None
        try:
            steps = [(s.role, s.seconds, s.sums)
                     for s in self.steps.recent(now - self.config.window_s)
                     if s.threads == threads]
            fit = fit_served_roles(self.profile.steps[threads], threads, steps)
        except (ServedFitError, redis.RedisError) as e:
            reason = getattr(e, "reason", "redis")
            kept = (self.calibration is not None
                    and 0 <= now - self._fitted_at <= KEEP_FIT_WINDOWS * self.config.window_s)
            if (reason, kept) != self._refused:  # logged once a kind, and when the kept fit expires
                log.info("autoscale: simulating with %s: %s", f"the last accepted serving "
                         f"calibration ({now - self._fitted_at:.0f} s old)" if kept else
                         "the profile's serving calibration", e)
            self._refused = (reason, kept)
            if kept:
                fit = self.calibration
        else:
            self._refused = None
            self._fitted_at = now
            current = current_config(self._roles(), self.autoscaler.candidates)
            if current is not None and now - self.config.window_s >= self._settled_at:
                self.memory.note(current.roles_label, fit, now)  # a window it served whole
        # With no fit of the window's, everything on the profile: a remembered fit beside
        # the profile's calibration would compare two machines' speeds.
        owns = ({label: self.memory.own(label, now) for label in self.memory.proven(now)}
                if fit is not None else {})
        if (fit, owns) != self._scored:
            figures = self._figures(fit, owns)
            self.autoscaler.score = goodput_of(figures)
            self.autoscaler.itl = itl_of(figures) if self.itl else None
            self.autoscaler.refine = self._refine(figures)
            self.autoscaler.headroom, self.autoscaler.headroom_itl = self._headroom(fit, owns)
            self.caps.predict = figures
            self._scored = (fit, owns)
        self.calibration = fit
        pooled = fit.pooled if fit else None
        table = pooled.decode_factors if pooled else ()
        for term, value in (("memory", pooled.memory if pooled else 0.0),
                            ("compute", pooled.compute if pooled else 0.0),
                            ("per_seq_ms", pooled.per_seq_s * 1e3 if pooled else 0.0),
                            ("decode_min", min(table, default=0.0)),
                            ("decode_max", max(table, default=0.0))):
            self.metrics.set("planner_served_factor", value, term=term)
        self.metrics.set("planner_served_steps", pooled.steps if pooled else 0)
        return fit

    def _headroom(self, fit: ServedFits | None, owns: dict[str, ServedFits | None]
                  ) -> tuple[Score | None, Score | None]:
        """Rule 2c's scores at ``1 + headroom`` times the window's load, from one
        simulation each: goodput, and (with ``--autoscale-itl``) ITL p99. None: headroom
        0, no rule 2c (no ITL score: 2c compares goodput alone)."""
        h = self.config.headroom
        if h <= 0:
            return None, None
        heavy = self._figures(fit, owns, load=1 + h)
        return goodput_of(heavy), itl_of(heavy) if self.itl else None

    def _figures(self, fit: ServedFits | None, owns: dict[str, ServedFits | None],
                 load: float = 1.0) -> Predict:
        """The simulator's figures of a candidate on its own calibration (``owns``, by
        roles label) if it has one, else on the window's ``fit`` (None: the profile's),
        at ``load`` times the window's (:func:`planner.scores.simulated`)."""
        predicts: dict[int, Predict] = {}

        def on(f: ServedFits | None) -> Predict:
            if id(f) not in predicts:
                profile = self.profile if f is None else f.apply(self.profile)
                predicts[id(f)] = simulated(profile, self.cluster.threads, *self._slo,
                                            slo_profile=self.profile,
                                            window_s=self.config.window_s, load=load)
            return predicts[id(f)]

        def figures(config: PoolConfig, records: Sequence[TrafficRecord]) -> dict:
            return on(owns.get(config.roles_label) or fit)(config, records)

        return per_window(figures)


def start_autoscale(cluster: LocalCluster) -> AutoscaleLoop:
    """The loop ``pdserve up --autoscale`` runs, its metrics served on a free port of
    the cluster's host when the cluster serves metrics (printed)."""
    metrics = Metrics({"component": "planner"})
    if cluster.config.metrics_port is not None:
        port = metrics.serve(free_port(cluster.config.host), cluster.config.host)
        print(f"  planner: http://{cluster.config.host}:{port}/metrics", flush=True)
    return AutoscaleLoop(cluster, metrics=metrics).start()
