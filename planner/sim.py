"""The planner's discrete-event simulator: one pool configuration, one workload, on a
virtual clock, with the real scheduler, block manager, routing policies and prefix index.

Lifecycle of a run (:meth:`Simulation.run`): every session (a lone request, or a
conversation whose turns follow one another, as ``pdserve bench`` sends them:
:func:`loadtest.runner.group_sessions`) starts at its arrival time; the simulated router
handles each request as :mod:`router.dispatch` does, the workers
(:mod:`planner.sim_workers`) run their steps, and every token reaches the request's
:class:`~loadtest.metrics.RequestRecord` at the virtual time it was sampled (the network
and the router's own time are taken as zero). The run ends when the event heap is empty;
then every request must have finished and every worker must have every KV block free
again (free prefix-cached blocks count as free): anything else is a simulator bug and
raises.

The router, mirrored from :mod:`router.choice` and :mod:`router.dispatch`:

- **mixed**: the policy (:func:`router.policies.make_policy`) picks a mixed worker from
  :class:`~router.policies.Candidate` s built as :class:`router.choice.Chooser` builds
  them: ``in_flight`` and ``queued_tokens`` as the dispatcher counts them (queued
  uncached prompt tokens until the first token, in flight until the end) and, for
  ``cache_aware``, the cached tokens of the prompt from the prefix index. The index is
  the router's own :class:`~common.prefix_index.LayeredIndex` of the routed memory
  (30 s, on the virtual clock) over the shared index, here a
  :class:`~common.prefix_index.MemoryPrefixIndex` that every worker's block manager
  publishes to (stored and evicted blocks, at once: what Redis would hold).
- **disaggregated**: reserve on the least-loaded decode worker (fewest in flight, then
  most free blocks); once the reservation is placed, a short uncached part is computed
  there (the worker's ``local_prefill_threshold``; for ``adaptive`` also when the
  router's rule, :class:`router.adaptive.PrefillPlacement`, says so from the same live
  state the router counts). Otherwise the policy picks a prefill worker, which samples
  the first token (relayed at once: TTFT never waits for the transfer), holds the blocks
  and sends ``(prompt - tokens the decode worker caches) x kv_bytes_per_token`` over the
  decode worker's receive link (the profile's transfer model; one transfer at a time
  into one decode worker, later ones queue). As a prefill worker sends by default
  (``--kv-offer layers``: each layer's KV while the next computes), the bytes start
  moving when the step began, cannot all be there before it ends, and the model's fixed
  latency follows: ``max(step end, start + bytes / rate) + latency``, ``start`` the
  later of the step's start and the link's being free; under ``kv_offer`` ``step`` or
  ``after`` they start at the later of the step's end and the link's being free
  (:meth:`~common.cost_model.TransferModel.landed_s` from ``start``, the rule the
  placement rule estimates a transfer by). When it has
  landed, the prefill worker releases its blocks and the decode worker commits the
  request at its next step boundary, then decodes it. A request of one output token
  ends at the prefill worker and its reservation is aborted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from common.cost_model import Profile
from common.hashing import block_hashes
from common.prefix_index import LayeredIndex, MemoryPrefixIndex
from loadtest.metrics import RequestRecord
from loadtest.runner import group_sessions
from loadtest.workloads import Request
from router.policies import Candidate, make_policy
from router.prefix_lookup import ROUTED_TTL_S
from workers.engine.params import SamplingParams
from workers.engine.sequence import Sequence

from .config import PoolConfig
from .sim_workers import EventLoop, SimWorker

Placement = Callable[..., bool]
"""The router's per-request placement hook for a placed, non-local reservation: called
with ``uncached_tokens``, ``cached_tokens``, ``decode_running``,
``decode_context_tokens``, ``prefill_queued_tokens`` (the fields of
:class:`router.adaptive.PlacementInputs`); True: compute the prompt on the decode
worker. None: the decode workers' static threshold alone decides."""


class SimulationError(AssertionError):
    """The simulator broke an invariant (a request never finished, a block leaked)."""


class _IndexListener:
    """A worker's block events into the shared index (its KV publisher's job)."""

    def __init__(self, index: MemoryPrefixIndex, worker: str) -> None:
        self.index, self.worker = index, worker

    def on_blocks_stored(self, block_hashes: list[int]) -> None:
        self.index.publish(self.worker, stored=block_hashes)

    def on_blocks_evicted(self, block_hashes: list[int]) -> None:
        self.index.publish(self.worker, evicted=block_hashes)


@dataclass
class _Flight:
    """One request in the simulated router."""

    rid: str
    request: Request
    record: RequestRecord
    turns: list[Request]
    turn: int
    hashes: list[int] = field(default_factory=list)
    worker: SimWorker | None = None  # mixed or decode
    prefill: SimWorker | None = None
    queued: int = 0  # counted in the mixed / prefill worker's queued_tokens
    decode_cached: int = 0  # prompt tokens the decode worker already holds
    context: int = 0  # counted in the decode worker's context_tokens
    local: bool = False


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration_s: float
    workers: list[SimWorker]
    local_prefills: int
    remote_prefills: int
    events: int

    @property
    def preemptions(self) -> int:
        return sum(w.preemptions for w in self.workers)


class Simulation:
    """One configuration on one workload; :meth:`run` once."""

    def __init__(self, profile: Profile, config: PoolConfig, *, think_time_s: float = 0.0,
                 placement: Placement | None = None, fast_forward: bool = True) -> None:
        if config.kind == "adaptive" and placement is None:
            raise ValueError("an adaptive configuration needs its placement rule")
        self.profile, self.config = profile, config
        self.think_time_s = think_time_s
        self.placement = placement
        self.loop = EventLoop()
        self.policy = make_policy(config.policy)
        self.cache_aware = self.policy.name == "cache_aware"
        shared = MemoryPrefixIndex(ttl_s=None,
                                   max_blocks=profile.num_blocks * config.workers + 1)
        routed = MemoryPrefixIndex(ttl_s=ROUTED_TTL_S, clock=lambda: self.loop.now)
        self.index = LayeredIndex(routed, shared)

        def pool(role: str, n: int, threads: int, threshold: int = 0) -> list[SimWorker]:
            return [SimWorker(f"{role}-{i}", role, threads, profile, self.loop, self,
                              threshold, ((_IndexListener(shared, f"{role}-{i}"),)
                                          if self.cache_aware and role != "decode" else ()),
                              fast_forward, config.prefill_tokens_while_decoding)
                    for i in range(n)]

        c = config
        self.mixed = pool("mixed", c.mixed_workers, c.mixed_threads)
        self.prefill = pool("prefill", c.prefill_workers, c.prefill_threads)
        self.decode = pool("decode", c.decode_workers, c.decode_threads,
                           c.local_prefill_threshold)
        self.workers = self.mixed + self.prefill + self.decode
        self.max_model_len = self.workers[0].max_model_len
        self._flights: dict[str, _Flight] = {}
        self._params: dict[int, SamplingParams] = {}
        self._records: list[RequestRecord] = []
        self._count = 0
        self.local_prefills = self.remote_prefills = 0

    # -- the run ------------------------------------------------------------------------

    def run(self, requests: list[Request], arrivals: list[float]) -> SimResult:
        """Send ``requests`` (sessions start at ``arrivals``, one per session in
        :func:`~loadtest.runner.group_sessions` order) and run to the end."""
        sessions = group_sessions(requests)
        if len(sessions) != len(arrivals):
            raise ValueError(f"{len(sessions)} sessions but {len(arrivals)} arrival times")
        for turns, at in zip(sessions, arrivals, strict=True):
            self.loop.at(at, lambda turns=turns: self._send(turns, 0))
        self.loop.run()
        problems = [f"{len(self._flights)} requests never finished "
                    f"(first: {next(iter(self._flights))})"] if self._flights else []
        for w in self.workers:
            problems += w.leaks()
        if problems:
            raise SimulationError("simulator bug: " + "; ".join(problems))
        end = max((r.token_times[-1] for r in self._records if r.token_times), default=0.0)
        return SimResult(self._records, max(end, 1e-9), self.workers, self.local_prefills,
                         self.remote_prefills, self.loop.events)

    def _send(self, turns: list[Request], turn: int) -> None:
        req = turns[turn]
        now = self.loop.now
        rec = RequestRecord(sent=now, prompt_tokens=len(req.prompt))
        self._records.append(rec)
        if not 0 < len(req.prompt) < self.max_model_len or req.output_len < 1:
            rec.error = (f"prompt of {len(req.prompt)} tokens, output {req.output_len}: "
                         f"max_model_len is {self.max_model_len}")
            self._next_turn(turns, turn)
            return
        self._count += 1
        f = _Flight(f"r{self._count}", req, rec, turns, turn)
        self._flights[f.rid] = f
        if self.cache_aware:
            f.hashes = block_hashes(req.prompt, self.profile.block_size, self.profile.model)
        if self.config.disaggregated:
            self._reserve(f)
        else:
            w = self._choose(self.mixed, f)
            w.in_flight += 1
            w.add(f.rid, req.prompt, self._params_of(req))
            f.worker = w

    def _next_turn(self, turns: list[Request], turn: int) -> None:
        if turn + 1 < len(turns):
            think = turns[turn + 1].think_s
            self.loop.at(self.loop.now + (self.think_time_s if think is None else think),
                         lambda: self._send(turns, turn + 1))

    def _params_of(self, req: Request) -> SamplingParams:
        p = self._params.get(req.output_len)
        if p is None:
            p = self._params[req.output_len] = SamplingParams(
                max_tokens=req.output_len, ignore_eos=True)
        return p

    # -- routing ------------------------------------------------------------------------

    def _choose(self, pool: list[SimWorker], f: _Flight) -> SimWorker:
        """:meth:`router.choice.Chooser.choose`, and the dispatcher's queued tokens."""
        cached: dict[str, int] = self.index.lookup(f.hashes) if f.hashes else {}
        bs = self.profile.block_size
        cands = [Candidate(w.name, w.in_flight, w.queued_tokens, cached.get(w.name, 0) * bs)
                 for w in pool]
        d = self.policy.choose(cands, len(f.request.prompt))
        if f.hashes:
            self.index.publish(d.address, stored=f.hashes)  # note_routed
        w = next(w for w in pool if w.name == d.address)
        f.queued = d.estimated_tokens - w.queued_tokens
        w.queued_tokens += f.queued
        return w

    def _reserve(self, f: _Flight) -> None:
        d = min(self.decode, key=lambda w: (w.in_flight, -w.sched.block_manager.num_free_blocks))
        d.in_flight += 1
        f.worker, f.context = d, len(f.request.prompt)
        d.context_tokens += f.context
        d.reserve(f.rid, f.request.prompt, self._params_of(f.request))

    # -- what the workers report --------------------------------------------------------

    def on_reserved(self, worker: SimWorker, seq: Sequence, local: bool) -> None:
        f = self._flights[seq.seq_id]
        cached = f.decode_cached = seq.num_cached_tokens
        uncached = len(f.request.prompt) - cached
        if not local and self.placement is not None:
            local = self.placement(
                uncached_tokens=uncached, cached_tokens=cached,
                decode_running=worker.in_flight - 1,
                decode_context_tokens=worker.context_tokens - len(f.request.prompt),
                prefill_queued_tokens=min(w.queued_tokens for w in self.prefill))
            if local:
                worker.compute_here(f.rid)
        f.local = local
        if local:
            self.local_prefills += 1
            return
        self.remote_prefills += 1
        p = self._choose(self.prefill, f)
        p.in_flight += 1
        f.prefill = p
        p.add(f.rid, f.request.prompt, self._params_of(f.request))

    def on_prefilled(self, worker: SimWorker, seq: Sequence, held: bool) -> None:
        f = self._flights[seq.seq_id]
        now = self.loop.now
        worker.in_flight -= 1
        worker.queued_tokens -= f.queued
        f.queued = 0
        f.record.token_times.append(now)
        f.record.cached_tokens = seq.num_cached_tokens
        d = f.worker
        assert d is not None
        if not held:  # the first token was the last: cancel the reservation
            d.abort(f.rid)
            self._finish(f, seq.num_output_tokens)
            return
        nbytes = (len(f.request.prompt) - f.decode_cached) * self.profile.kv_bytes_per_token
        # From the later of the step's start and the link's being free, the part of the
        # step still to run is what the KV waits for (see the module docstring).
        start = max(worker.step_started, d.link_free_at)
        d.link_free_at = end = start + self.profile.transfer.landed_s(
            nbytes, max(now - start, 0.0), self.config.kv_offer)

        def landed() -> None:
            worker.release(seq)
            d.commit(f.rid)

        self.loop.at(end, landed)

    def on_token(self, worker: SimWorker, seq: Sequence) -> None:
        f = self._flights[seq.seq_id]
        rec = f.record
        rec.token_times.append(self.loop.now)
        if f.queued:  # the first token of a mixed request: its prefill is done
            worker.queued_tokens -= f.queued
            f.queued = 0
        if worker.role == "decode":
            if f.local and len(rec.token_times) == 1:
                rec.cached_tokens = seq.num_cached_tokens
            worker.context_tokens += 1
            f.context += 1
        elif len(rec.token_times) == 1:
            rec.cached_tokens = seq.num_cached_tokens
        if seq.is_finished:
            self._finish(f, seq.num_output_tokens)

    def on_tokens(self, worker: SimWorker, seq: Sequence, times: list[float]) -> None:
        f = self._flights[seq.seq_id]
        f.record.token_times.extend(times)
        if worker.role == "decode":
            worker.context_tokens += len(times)
            f.context += len(times)

    def _finish(self, f: _Flight, output_tokens: int) -> None:
        w = f.worker
        assert w is not None
        w.in_flight -= 1
        w.context_tokens -= f.context
        f.record.output_tokens = output_tokens
        del self._flights[f.rid]
        self._next_turn(f.turns, f.turn)
