"""Which worker of a pool computes a prompt: the routing policy fed with what each holds.

For one request and one role (``prefill`` or ``mixed``): hash the prompt into blocks
(only for ``cache_aware``; with the first worker's block size and model id, which every
worker of one model shares; once per request, see :class:`PromptHashes`), ask the
prefix lookup how many leading blocks each worker holds, turn every serving worker into
a :class:`router.policies.Candidate` (its in-flight calls, queued prefill tokens, cached
tokens, and whether it is down), let the policy decide, count the decision
(``routing_decisions_total`` and :attr:`decisions`), and tell the prefix lookup where the
prompt went so the next request sharing it follows.

The policies themselves are pure and live in :mod:`router.policies`. Runs on the
router's event loop.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import grpc

from common.hashing import BlockHashChain
from common.metrics import Metrics
from protos.pdserve.v1 import worker_pb2

from .errors import RouterError
from .policies import CacheAware, Candidate, Decision, LeastLoaded, RoundRobin
from .pool import Worker, WorkerPool
from .prefix_lookup import PrefixLookup


class PromptHashes:
    """One request's block hashes across its attempts. The router core makes one per
    request and hands it to each attempt: the first hashes the prompt, one after a
    migration (the prompt continued by the tokens generated so far) hashes only the
    blocks those tokens filled. Keyed by what the hashes depend on (block size and model
    id of the pool, the request's salt), so a pool that changed meanwhile gets a fresh
    chain. Used from the event loop only."""

    def __init__(self) -> None:
        self._chain: BlockHashChain | None = None

    def of(self, wreq: worker_pb2.WorkerGenerateRequest, block_size: int,
           model_id: str) -> list[int]:
        salt = wreq.cache_salt or None
        chain = self._chain
        if chain is None or (chain.block_size, chain.model_id, chain.cache_salt) != (
                block_size, model_id, salt):
            chain = self._chain = BlockHashChain(block_size, model_id, salt)
        return chain.update(wreq.prompt_token_ids)


class Chooser:
    def __init__(self, pool: WorkerPool, policy: RoundRobin | LeastLoaded | CacheAware,
                 prefixes: PrefixLookup, metrics: Metrics) -> None:
        self.pool = pool
        self.policy = policy
        self.prefixes = prefixes
        self.metrics = metrics
        self.decisions: Counter[tuple[str, str]] = Counter()  # (policy, reason) -> count

    async def choose(self, role: str, wreq: worker_pb2.WorkerGenerateRequest,
                     hashes: PromptHashes | None = None,
                     among: Callable[[Worker], bool] | None = None) -> tuple[Worker, Decision]:
        """The policy's pick among the pool's workers (those ``among`` accepts), with
        their cached prefix of this prompt from the shared index (one round trip; none
        when Redis is down). ``hashes``: the request's, kept across its attempts (None:
        hash here)."""
        pool = [w for w in self.pool.serving(role) if among is None or among(w)]
        if not pool and role == "mixed":
            # Pools that cannot split (a role change under way left prefill workers or
            # decode workers alone): any worker runs a whole request (``Generate``).
            pool = [w for r in ("prefill", "decode") for w in self.pool.serving(r)]
        if not pool:
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              f"no {role} worker is serving right now; retry later")
        now = time.monotonic()
        cached: dict[str, int] = {}
        blocks: list[int] = []
        if self.policy.name == "cache_aware":
            w0 = pool[0]
            hashes = hashes if hashes is not None else PromptHashes()
            blocks = hashes.of(wreq, w0.block_size, w0.model_id)
            cached = await self.prefixes.lookup(blocks)
        cands = [Candidate(w.address, w.in_flight, w.queued_tokens,
                           cached.get(w.address, 0) * w.block_size, w.down_until <= now)
                 for w in pool]
        decision = self.policy.choose(cands, len(wreq.prompt_token_ids))
        self.decided(decision.policy, decision.reason)
        if blocks:
            self.prefixes.note_routed(blocks, decision.address)
        worker = next(w for w in pool if w.address == decision.address)
        return worker, decision

    def decided(self, policy: str, reason: str) -> None:
        self.decisions[(policy, reason)] += 1
        self.metrics.inc("routing_decisions_total", policy=policy, reason=reason)
