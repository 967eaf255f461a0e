"""Routing policies: which worker of a pool computes a prompt. Pure logic, no I/O.

Every policy sees the same :class:`Candidate` list (workers that can take the request,
healthy ones first) and returns a :class:`Decision` that names the worker and the parts
of its score, for the response's usage and the metrics:

- ``round_robin``: in turn, ignoring load and cache;
- ``least_loaded``: fewest requests this router has in flight there;
- ``cache_aware`` (the rule of SGLang's cache-aware router): the worker holding the
  longest cached prefix of the prompt (from the shared index) gets it when that prefix
  is at least ``cache_threshold`` of the prompt; otherwise the least *estimated prefill
  work* wins: the tokens the worker would compute (past its cached prefix) plus those
  already queued there by this router. A load-imbalance guard falls back to
  least-loaded when in-flight counts drift apart by more than ``balance_abs`` requests
  *and* a factor ``balance_rel``, so one hot prefix cannot pile everything on one worker.
  Recomputing a long prefix elsewhere to dodge a queue wastes the pool's capacity, so
  only the guard, not a single request's wait, moves a prefix off its holder. (Copying a
  hot prefix to an idle worker while its holder is busy was tried and measured with
  ``pdserve chaos``: the copies, ~2% of requests, each took a full prompt's compute, 1-1.5
  s of TTFT against ~0.3 s, and became the p99; the prefill overflow of
  :mod:`router.dispatch` covers a lost holder instead.) Ties go
  in turn (equal holders, equal work): fed one prompt at a time, the first worker
  listed would otherwise win every new prefix and its peers stay cold, and when it
  stalls or dies a cold peer takes its whole load with nothing cached (SGLang sends a
  new prefix to the worker caching least for the same reason).

The shared index only learns a prefix once a worker has computed it; requests for the
same prefix arriving meanwhile would all miss. The router's prefix lookup
(:mod:`router.prefix_lookup`) also remembers, for a while, which worker it just sent each
prefix to (as SGLang's approximate router does) and credits the larger of the two.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


class Candidate(NamedTuple):
    """One worker as the policy sees it, for one decision. A named tuple rather than a
    frozen dataclass: the router builds one per serving worker on every request, and a
    tuple is built in less than half the time (0.25 vs 0.6 us)."""

    address: str
    in_flight: int = 0
    queued_tokens: int = 0  # uncached prompt tokens this router sent there, not yet done
    cached_tokens: int = 0  # of this prompt, from the prefix index
    healthy: bool = True


@dataclass(frozen=True)
class Decision:
    address: str
    policy: str
    reason: str  # "cache", "load", "balance", "turn", "unhealthy"
    cached_tokens: int
    estimated_tokens: int  # prefill work estimated for the chosen worker


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: list[Candidate], prompt_tokens: int) -> Decision:
        pool = _healthy(candidates)
        c = pool[next(self._turn) % len(pool)]
        return _decision(self.name, "turn", c, prompt_tokens)


class LeastLoaded:
    name = "least_loaded"

    def choose(self, candidates: list[Candidate], prompt_tokens: int) -> Decision:
        c = min(_healthy(candidates), key=lambda c: (c.in_flight, c.queued_tokens))
        return _decision(self.name, "load", c, prompt_tokens)


class CacheAware:
    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.5, balance_abs: int = 8,
                 balance_rel: float = 2.0) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self._turn = itertools.count()

    def choose(self, candidates: list[Candidate], prompt_tokens: int) -> Decision:
        pool = _healthy(candidates)
        loads = [c.in_flight for c in pool]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            c = min(pool, key=lambda c: (c.in_flight, c.queued_tokens))
            return _decision(self.name, "balance", c, prompt_tokens)
        top = max(c.cached_tokens for c in pool)
        if top and top >= self.cache_threshold * prompt_tokens:
            holder = self._in_turn(pool, lambda c: (-c.cached_tokens, c.in_flight))
            return _decision(self.name, "cache", holder, prompt_tokens)
        c = self._in_turn(pool, lambda c: (_work(c, prompt_tokens), c.in_flight))
        return _decision(self.name, "cache" if c.cached_tokens else "load", c, prompt_tokens)

    def _in_turn(self, pool: list[Candidate], key: Callable[[Candidate], tuple[int, int]]
                 ) -> Candidate:
        """The candidate with the least ``key``; equals take turns (the turn moves only
        on a tie, so no pattern of other decisions can keep handing it to one worker)."""
        best = min(key(c) for c in pool)
        tied = [c for c in pool if key(c) == best]
        return tied[0] if len(tied) == 1 else tied[next(self._turn) % len(tied)]


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "cache_aware": CacheAware}


def make_policy(name: str) -> RoundRobin | LeastLoaded | CacheAware:
    if name not in POLICIES:
        raise ValueError(f"routing policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]()


def _work(c: Candidate, prompt_tokens: int) -> int:
    return c.queued_tokens + max(prompt_tokens - c.cached_tokens, 0)


def _healthy(candidates: list[Candidate]) -> list[Candidate]:
    if not candidates:
        raise ValueError("no candidate worker")
    return [c for c in candidates if c.healthy] or candidates


def _decision(policy: str, reason: str, c: Candidate, prompt_tokens: int) -> Decision:
    if not c.healthy:
        reason = "unhealthy"
    return Decision(c.address, policy, reason, c.cached_tokens, _work(c, prompt_tokens))
