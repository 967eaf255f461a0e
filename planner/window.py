"""A window of logged traffic (:mod:`common.traffic`), as the live planner measures it
and as its simulator replays it.

Measured: :func:`served_share` (the share of the requests the running configuration
served within the SLOs: the floor of its score) and :func:`tpot_bound` (whether its
misses were the decode's), both at once by :func:`served_measures`; :func:`window_slo`
(the SLOs a window's goodput counts against). Replayed: :func:`window_requests` (the
window as the simulator's workload: conversations' turns following one another) and
:func:`window_prompts` (token ids sharing what the routers logged as cached), read by
:func:`planner.scores.simulated`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from common.cost_model import StepModel
from common.traffic import TrafficRecord
from loadtest.metrics import SLO, tpot_s
from loadtest.workloads import DEFAULT_TOKEN_IDS, Request


def window_slo(step: StepModel, records: Sequence[TrafficRecord],
               slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> SLO:
    """The SLOs a window's goodput counts against (:func:`planner.scores.simulated`):
    those given, else 5x the unloaded prefill of its mean prompt and 2x an unloaded
    decode step there."""
    mean_prompt = sum(max(1, r.prompt_tokens) for r in records) // max(1, len(records))
    return SLO(slo_ttft_ms or 5000 * step.prefill_seconds(mean_prompt),
               slo_tpot_ms or 2000 * step.decode_seconds(1, mean_prompt))


def served_share(records: Sequence[TrafficRecord], slo: SLO) -> float:
    """The share of ``records`` (requests the running configuration served) that
    finished within ``slo``, by the latencies their router logged. A floor: a request
    still in flight, or one that failed, counts as a miss (the live loop measures a span
    that ended a few latencies ago, so that few are still in flight). A request of
    several choices is judged on their tokens together."""
    return served_measures(records, slo)[0]


def tpot_bound(records: Sequence[TrafficRecord], slo: SLO) -> bool:
    """Whether the misses among ``records`` (the span :func:`served_share` measured)
    were the decode's: every one that ended met the TTFT SLO, and more missed the TPOT
    SLO than missed in no way known (still in flight, failed, or past an end-to-end
    SLO alone: a request not ended may still wait for its first token). Then prompts
    computed beside running decodes failed them, which a split removes; where prompts
    queue for their prefill instead (TTFT misses), a split's fewer prefill threads
    queue them longer."""
    return served_measures(records, slo)[1]


def served_measures(records: Sequence[TrafficRecord], slo: SLO) -> tuple[float, bool]:
    """:func:`served_share` and :func:`tpot_bound` of ``records``, each request's miss
    classified once (the live loop reads both of one span every decision)."""
    misses = [_miss(r, slo) for r in records]
    share = misses.count(None) / len(records) if records else 0.0
    return share, "ttft" not in misses and misses.count("tpot") > misses.count("unknown")


def _miss(r: TrafficRecord, slo: SLO) -> str | None:
    """How ``r`` missed ``slo``: None (it met it), ``ttft``, ``tpot`` (first token in
    time, then too slow a token), or ``unknown`` (not ended, failed, or past an
    end-to-end SLO alone)."""
    if not r.done or r.ttft_s is None or r.e2e_s is None:
        return "unknown"
    if slo.ttft_ms is not None and r.ttft_s * 1e3 > slo.ttft_ms:
        return "ttft"
    per_token = tpot_s(r.ttft_s, r.e2e_s, r.output_tokens)
    if slo.met(r.ttft_s, per_token, r.e2e_s):
        return None
    if slo.tpot_ms is not None and per_token is not None and per_token * 1e3 > slo.tpot_ms:
        return "tpot"
    return "unknown"


def window_prompts(records: Sequence[TrafficRecord], rng: random.Random,
                   ids: Sequence[int] = DEFAULT_TOKEN_IDS) -> list[list[int]]:
    """Token ids for the window's prompts (``records`` in arrival order). A record whose
    ``parent`` (the earlier request its prompt begins with, :mod:`router.lineage`) is in
    the window begins with that prompt (at most all but one of its own tokens); any
    other's first ``cached_tokens`` (at most all but one) are copied from the latest
    earlier prompt at least that long; the rest are fresh.

    Without a parent, the shared prefix is a guess: the routers log how many of a
    prompt's tokens a worker had cached, not which ones, so it copies enough for the
    simulated prefix cache to hold that many tokens for some worker, where the
    candidate's routing may or may not find them (often another conversation's prompt,
    on a busy worker). With fresh prompts throughout, every candidate paid every prompt
    in full, where a chat's later turns compute only their new ~256 tokens: all
    latencies too high, and a split, whose one prefill worker computes every prompt, the
    more so."""
    prompts: list[list[int]] = []
    for i, (r, parent) in enumerate(zip(records, _parents(records), strict=True)):
        n = max(1, r.prompt_tokens)
        if parent < i:
            head = prompts[parent][:n - 1]
        else:
            cached = min(r.cached_tokens, n - 1)
            head = next((p[:cached] for p in reversed(prompts) if len(p) >= cached),
                        []) if cached > 0 else []
        prompts.append(head + [rng.choice(ids) for _ in range(n - len(head))])
    return prompts


LOG_SLACK_S = 0.001
"""How far before its parent's logged end a turn may have arrived and still be taken to
follow it: the log keeps latencies to 0.1 ms."""


def window_requests(records: Sequence[TrafficRecord], rng: random.Random,
                    ids: Sequence[int] = DEFAULT_TOKEN_IDS, load: float = 1.0
                    ) -> tuple[list[Request], list[float]]:
    """The window as the simulator's workload: requests grouped into sessions, and each
    session's start (seconds after the window's first arrival, divided by ``load``: at
    ``load`` 1.5 the sessions come 1.5 times as often, each turn's pause kept).

    A request that arrived after its parent (:func:`window_prompts`) had ended, in the
    window, is that session's next turn: the simulator sends it the same pause after
    the parent's simulated end as it came after the real one, as a multi-turn client
    does (one such turn per parent; a parent that ended with no logged latencies, or
    one still running when the request came, leaves it a session of its own). Every
    other request starts a session at its own arrival. Replayed each at its arrival
    instead, a 2-core EPYC's chat headline windows had a turn arrive in the simulation
    while its previous turn still decoded (whose simulated steps ran a little slower
    than the real ones) on the worker caching its prefix, and predicted two mixed
    workers an ITL p99 of 458 ms where they served 21 ms (25% load; closed-loop turns
    predicted 29 ms)."""
    records = sorted(records, key=lambda r: r.arrival)
    prompts = window_prompts(records, rng, ids)
    t0 = records[0].arrival if records else 0.0
    session: list[int] = []
    think: list[float | None] = []
    starts: list[float] = []
    followed: set[int] = set()
    for i, (r, p) in enumerate(zip(records, _parents(records), strict=True)):
        end = _ended_at(records[p]) if p < i and p not in followed else None
        if end is not None and r.arrival >= end - LOG_SLACK_S:
            followed.add(p)
            session.append(session[p])
            think.append(max(0.0, r.arrival - end))
        else:
            session.append(len(starts))
            think.append(None)
            starts.append((r.arrival - t0) / load)
    requests = [Request(prompt, max(1, r.output_tokens), conversation=s, think_s=w)
                for r, prompt, s, w in zip(records, prompts, session, think, strict=True)]
    return requests, starts


def _parents(records: Sequence[TrafficRecord]) -> list[int]:
    """Each record's parent's index in ``records`` (:mod:`router.lineage`), or its own
    where it has none there."""
    at = {r.key: i for i, r in enumerate(records) if r.key}
    return [at.get(r.parent, i) if r.parent else i for i, r in enumerate(records)]


def _ended_at(r: TrafficRecord) -> float | None:
    """When a finished request's last token came (None: not finished, or no latencies)."""
    return r.arrival + r.e2e_s if r.done and r.e2e_s is not None else None
