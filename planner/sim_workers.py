"""Simulated workers: the real engine core on a virtual clock. No torch, no sleeping.

:class:`EventLoop` is the clock: a heap of ``(time, order, callback)``; :meth:`run`
pops them in time order (insertion order breaks ties) and sets :attr:`now`.

A :class:`SimWorker` is one engine loop: a role (``mixed``, ``prefill``, ``decode``),
a real :class:`~workers.engine.scheduler.Scheduler` sized from the profile exactly as
:class:`~workers.engine.llm_engine.LLMEngine` sizes its own (block pool, token budget,
batch size, context, the 1% watermark), the profile's step model for its threads, and a
busy/idle state. Its lifecycle mirrors :mod:`workers.engine_loop`:

1. Everything the router sends (add, reserve, commit, compute-here, abort, release) is
   a *command*. An idle worker applies it at once; a busy one at its next step
   boundary. A worker that became runnable starts its step only after every other event
   of the same instant (so simultaneous arrivals are drained together, as the engine
   loop drains its queue before it steps).
2. A step: ``schedule()``; its duration is ``step_model.seconds([(n, start), ...])`` of
   the scheduled chunks (times a factor drawn from the profile's spread of served steps,
   ``Profile.serving_jitter``, when it has one, narrowed for a step longer than those
   the spread was measured on: ``common.cost_model.spread_steps``; a seeded generator
   per worker, so a run is repeatable); at its end ``update()`` with one sampled token per sampling
   chunk (any ordinary id: requests run to ``max_tokens`` = their output length with
   ``ignore_eos``), then the host (the simulated router) hears of every token.
3. At the boundary, as the engine loop does: reservations that waited for blocks are
   retried in arrival order, then queued commands apply, then the next step starts
   (none when the scheduler has nothing runnable: the worker idles until a command).

Disaggregation, as the real workers do it:

- **prefill**: a request runs with its real ``max_tokens``; the step that samples its
  first token holds its blocks (``Scheduler.hold``, when decoding goes on elsewhere)
  and the request ends with reason ``remote``; :meth:`SimWorker.release` (a command,
  once the transfer ended) gives the blocks back;
- **decode**: :meth:`SimWorker.reserve` holds blocks for the whole prompt, its cached
  prefix reused (``Scheduler.reserve``); one that does not fit waits, first come first
  served, until a step frees blocks. Placed, an uncached part shorter than the
  threshold is computed here (``Scheduler.recompute``), otherwise the host sends it to a
  prefill worker. :meth:`SimWorker.commit` runs it with its first token once the KV
  landed. :attr:`SimWorker.link_free_at` is the receive link: one transfer at a time
  into one decode worker (the host serializes them on it). A prefill worker's
  :attr:`SimWorker.step_started` is when the step now ending began: the real worker's
  transfer starts then (an early offer, each layer sent as it is done).

**Fast-forward.** A large cluster's hour is millions of decode steps, and most of them
repeat the one before: the same batch, one more token each. When a step the scheduler
built is decode-only, covers every running request, nobody can be admitted (no one
waits, or the batch is full; a waiting reservation cannot fit either: such steps only
take blocks), none of the batch finishes within ``k`` steps and the free blocks cover
their growth (no preemption), the next ``k`` steps are that same step with one more
token of context each: their times are computed at once (linear in the step's index)
and applied at their end as ``update`` would have, step by step (blocks grown, tokens
appended, full blocks cached). A command arriving meanwhile cuts the run at the first
step boundary after it, where the engine loop would have seen it. The run is the same
as stepping one step at a time (a unit test compares them; with a spread of served
steps, a run draws its steps' factors at its start, so a cut run and single steps see
different draws of the same distribution), with one difference the router may see:
within a run, the blocks it takes (and the cached blocks that evicts) are taken at its
end rather than step by step, so the free-block count and the prefix index lag by at
most one run.
"""

from __future__ import annotations

import heapq
import itertools
import zlib
from collections import deque
from collections.abc import Callable
from typing import Protocol

import numpy as np

from common.cost_model import Profile, draw_jitter, spread_steps
from workers.engine.block_manager import KVEventListener
from workers.engine.params import SamplingParams, SchedulerConfig, local_limit
from workers.engine.scheduler import Scheduler, SchedulerOutput
from workers.engine.sequence import FinishReason, Sequence

TOKEN = 13
"""The token every simulated step samples (requests ignore EOS; any ordinary id)."""
NO_EOS: frozenset[int] = frozenset()
MAX_RUN = 4096
"""The most decode steps one fast-forward covers."""


class EventLoop:
    """The virtual clock. Not thread-safe; callbacks may schedule more events."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.events = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._order), fn))

    def run(self) -> None:
        heap, pop = self._heap, heapq.heappop
        while heap:
            self.now, _, fn = pop(heap)
            self.events += 1
            fn()


class Host(Protocol):
    """The simulated router: hears what a worker produced, at the virtual time."""

    def on_token(self, worker: SimWorker, seq: Sequence) -> None:
        """A mixed or decode worker sampled a token of ``seq`` (finished or not)."""

    def on_tokens(self, worker: SimWorker, seq: Sequence, times: list[float]) -> None:
        """A fast-forwarded run of decode steps sampled ``len(times)`` tokens of ``seq``
        (it did not finish), one at each of ``times``."""

    def on_prefilled(self, worker: SimWorker, seq: Sequence, held: bool) -> None:
        """A prefill worker sampled ``seq``'s first token; ``held``: its blocks stay
        held for a transfer (decoding goes on elsewhere) until :meth:`SimWorker.release`."""

    def on_reserved(self, worker: SimWorker, seq: Sequence, local: bool) -> None:
        """A decode worker placed a reservation; ``local``: it computes the prompt."""


def scheduler_config(profile: Profile, prefill_cap: int = 0) -> SchedulerConfig:
    """The engine's own sizing of its scheduler (``LLMEngine.__init__``); ``prefill_cap``:
    its ``--prefill-tokens-while-decoding``."""
    n = profile.num_blocks
    return SchedulerConfig(
        num_blocks=n, block_size=profile.block_size,
        max_num_batched_tokens=profile.max_num_batched_tokens,
        prefill_tokens_while_decoding=prefill_cap,
        max_num_seqs=profile.max_num_seqs,
        max_model_len=min(profile.max_model_len, n * profile.block_size),
        model_id=profile.model, watermark_blocks=min(n // 100, n - 1))


class SimWorker:
    def __init__(self, name: str, role: str, threads: int, profile: Profile,
                 loop: EventLoop, host: Host, local_prefill_threshold: int = 0,
                 listeners: tuple[KVEventListener, ...] = (), fast_forward: bool = True,
                 prefill_cap: int = 0) -> None:
        self.name, self.role, self.threads = name, role, threads
        self.sched = Scheduler(scheduler_config(profile, prefill_cap), listeners)
        self.max_model_len = self.sched.config.max_model_len
        steps = profile.for_role(role)  # its role's own served calibration, if fitted
        self.model = steps.step(threads)
        self._jitter = steps.serving_jitter.get(threads, ())
        self._jitter_step_s = steps.serving_jitter_step_s.get(threads)
        self._rng = np.random.default_rng(zlib.crc32(name.encode()))  # same run, same draws
        self.loop, self.host = loop, host
        self.local_prefill_threshold = local_prefill_threshold
        self.fast_forward = fast_forward
        self.busy = False
        self._kick_armed = False
        self._run: tuple[SchedulerOutput, np.ndarray, int, float] | None = None
        self._generation = 0
        self._commands: list[Callable[[], None]] = []
        self._pending: deque[tuple[str, list[int], SamplingParams]] = deque()
        self.link_free_at = 0.0
        """Decode: when its receive link is free (one transfer at a time)."""
        self.step_started = 0.0
        """When the running (or last) step or run began."""
        # Router-side accounting (router/pool.py's Worker fields), moved by the host.
        self.in_flight = 0
        self.queued_tokens = 0
        self.context_tokens = 0
        # Counters for the report.
        self.steps = 0
        self.busy_s = 0.0
        self.preemptions = 0

    # -- commands (the router's calls; applied at the next step boundary) -------------

    def post(self, fn: Callable[[], None]) -> None:
        if self.busy:
            self._commands.append(fn)
            if self._run is not None:
                self._cut_run()
        else:
            fn()
            self._arm()

    def add(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.post(lambda: self.sched.add(rid, prompt, params))

    def reserve(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        def reserve() -> None:
            self._pending.append((rid, prompt, params))
            self._reserve_pending()
        self.post(reserve)

    def commit(self, rid: str) -> None:
        """The KV landed and the first token came: run it (it may end right there)."""
        def commit() -> None:
            seq = self.sched.get(rid)
            assert seq is not None, f"commit of {rid}, which {self.name} does not hold"
            # Never the last token: the prefill side held it for export only if not.
            ended = self.sched.commit(seq, TOKEN, NO_EOS)
            assert ended is None, f"{rid} ended at its first token on {self.name}"
        self.post(commit)

    def compute_here(self, rid: str) -> None:
        """A placed reservation is computed on this worker after all (router's rule)."""
        def here() -> None:
            seq = self.sched.get(rid)
            assert seq is not None, f"{rid} is not reserved on {self.name}"
            self.sched.recompute(seq, None, NO_EOS)
        self.post(here)

    def abort(self, rid: str) -> None:
        def abort() -> None:
            if not self.sched.abort(rid):  # still waiting for room: drop it there
                self._pending = deque(p for p in self._pending if p[0] != rid)
        self.post(abort)

    def release(self, seq: Sequence) -> None:
        self.post(lambda: self.sched.release(seq))

    # -- the engine loop ---------------------------------------------------------------

    def _reserve_pending(self) -> None:
        while self._pending:
            rid, prompt, params = self._pending[0]
            seq = self.sched.reserve(rid, prompt, params)
            if seq is None:
                return
            self._pending.popleft()
            local = seq.num_tokens - seq.num_computed_tokens < local_limit(
                self.local_prefill_threshold, seq.num_computed_tokens, self.sched.config.block_size)
            if local:
                self.sched.recompute(seq, None, NO_EOS)
            self.host.on_reserved(self, seq, local)

    def _arm(self) -> None:
        """Start a step after the other events of this instant (see the docstring)."""
        if not self.busy and not self._kick_armed:
            self._kick_armed = True
            self.loop.at(self.loop.now, self._kick)

    def _kick(self) -> None:
        self._kick_armed = False
        if self.busy:
            return
        out = self.sched.schedule()
        if out.is_empty:
            return  # idle until a command
        self.busy = True
        self.step_started = self.loop.now
        self.preemptions += len(out.preempted)
        chunks = [(c.num_tokens, c.start) for c in out.chunks]
        k = self._run_length(out) if self.fast_forward else 1
        if k > 1:
            self._start_run(out, chunks, k)
            return
        dt = self.model.seconds(chunks)
        if self._jitter:
            dt = float(self._spread(np.array([dt]))[0])
        self.steps += 1
        self.busy_s += dt
        self.loop.at(self.loop.now + dt, lambda: self._step_end(out))

    def _step_end(self, out: SchedulerOutput) -> None:
        sampling = [c.seq for c in out.chunks if c.samples]
        sched = self.sched
        if self.role == "prefill":
            held = [self._hold_for_export(seq) for seq in sampling]
        sched.update(out, dict.fromkeys([s.seq_id for s in sampling], TOKEN), NO_EOS)
        if self.role == "prefill":
            for seq, h in zip(sampling, held, strict=True):
                if not seq.is_finished:
                    sched.finish(seq, FinishReason.REMOTE)
                self.host.on_prefilled(self, seq, h)
        else:
            for seq in sampling:
                self.host.on_token(self, seq)
        self._boundary()

    def _boundary(self) -> None:
        self.busy = False
        self._reserve_pending()
        commands, self._commands = self._commands, []
        for fn in commands:
            fn()
        self._arm()

    def _hold_for_export(self, seq: Sequence) -> bool:
        """``LLMEngine._export_prefilled``: hold the blocks when decoding goes on."""
        if (seq.num_output_tokens + 1 < seq.params.max_tokens
                and seq.num_tokens + 1 < self.max_model_len):
            self.sched.hold(seq)
            return True
        return False

    # -- fast-forward: runs of identical decode steps ------------------------------------

    def _spread(self, seconds: np.ndarray) -> np.ndarray:
        """Steps of ``seconds`` with a factor each drawn from the profile's spread of
        served steps, a long step's narrowed (:func:`~common.cost_model.spread_steps`;
        callers skip it, and its allocation on every step, when the profile has none)."""
        return spread_steps(seconds, draw_jitter(self._jitter, self._rng.random(len(seconds))),
                            self._jitter_step_s)

    def _run_length(self, out: SchedulerOutput) -> int:
        """How many steps, this one first, are decode-only steps of the same batch for
        sure: the batch is every running request, each decoding; nobody can be admitted
        (no one waits, or the batch is full); none of them finishes before the last one;
        the free blocks cover their growth (no preemption). 1: step normally."""
        s = self.sched
        if (self.role == "prefill" or out.preempted or self._commands
                or len(out.chunks) != len(s.running)
                or (s.waiting and len(s.running) < s.config.max_num_seqs)):
            return 1
        k = MAX_RUN
        for c in out.chunks:
            if c.num_tokens != 1:
                return 1
            seq = c.seq
            k = min(k, seq.params.max_tokens - seq.num_output_tokens,
                    self.max_model_len - seq.num_tokens)
        k -= 1  # the step where the first one finishes runs normally
        bs = s.config.block_size
        seqs = [c.seq for c in out.chunks]

        def need(k: int) -> int:
            return sum(max(0, -(-(q.num_computed_tokens + k) // bs) - len(q.block_table))
                       for q in seqs)

        free = s.block_manager.num_free_blocks
        if k >= 2 and need(k) > free:
            lo, hi = 1, k  # need(lo) <= free < need(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if need(mid) <= free else (lo, mid)
            k = lo
        return k if k >= 2 else 1

    def _start_run(self, out: SchedulerOutput, chunks: list[tuple[int, int]], k: int) -> None:
        """Step ``k`` times at once: every step adds one token of context to each of
        the batch's requests, so its time is linear in the step's index (floored, then
        the decode table's factor of the batch)."""
        coef = self.model.coef
        raw0 = sum(c * x for c, x in zip(coef, self.model.row(chunks), strict=True))
        raw1 = sum(c * x for c, x in zip(coef, self.model.row([(n, s + 1) for n, s in chunks]),
                                         strict=True))
        durations = np.maximum(self.model.floor_s, raw0 + (raw1 - raw0) * np.arange(k))
        durations *= self.model.decode_factor(len(chunks))  # every chunk one token
        if self._jitter:
            durations = self._spread(durations)
        ends = self.loop.now + np.cumsum(durations)
        self._generation += 1
        self._run = (out, ends, self._generation, self.loop.now)
        self._schedule_run_end()

    def _schedule_run_end(self) -> None:
        assert self._run is not None
        _, ends, gen, _ = self._run
        self.loop.at(float(ends[-1]), lambda: self._run_end(gen))

    def _cut_run(self) -> None:
        """A command came during a run: end it at the first step boundary from now."""
        assert self._run is not None
        out, ends, _, start = self._run
        j = int(np.searchsorted(ends, self.loop.now, side="left"))
        if j < len(ends) - 1:
            self._generation += 1
            self._run = (out, ends[:j + 1], self._generation, start)
            self._schedule_run_end()

    def _run_end(self, gen: int) -> None:
        """Apply the run's steps as ``update`` would have, step by step: each request's
        blocks grow, it gets one token a step, its newly full blocks are cached."""
        if self._run is None or self._run[2] != gen:
            return  # cut short: a later event ends it
        out, ends, _, start = self._run
        self._run = None
        n = len(ends)
        times = ends.tolist()
        bm = self.sched.block_manager
        for c in out.chunks:
            seq = c.seq
            ok = bm.allocate(seq, seq.num_computed_tokens + n)
            assert ok, "the run length checked the free blocks"
            append = seq.append_token
            for _ in range(n):
                append(TOKEN)
            seq.num_computed_tokens += n
            bm.cache_computed_blocks(seq)
            self.host.on_tokens(self, seq, times)
        self.steps += n
        self.busy_s += times[-1] - start
        self._boundary()

    # -- the end -----------------------------------------------------------------------

    def leaks(self) -> list[str]:
        """What this worker still holds (nothing, after a complete run)."""
        s, bm = self.sched, self.sched.block_manager
        out = []
        if s.num_unfinished or s.held or s.reserved or self._pending or self._commands:
            out.append(f"{self.name}: {s.num_unfinished} unfinished, {len(s.held)} held, "
                       f"{len(s.reserved)} reserved, {len(self._pending)} pending, "
                       f"{len(self._commands)} commands")
        if bm.num_free_blocks != bm.num_blocks:
            out.append(f"{self.name}: {bm.num_blocks - bm.num_free_blocks} of "
                       f"{bm.num_blocks} blocks not free")
        return out
