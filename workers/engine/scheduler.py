"""Continuous batching with a token budget, chunked prefill and preemption. No torch.

Each :meth:`Scheduler.schedule` call builds one step:

1. Running sequences that are decoding get one token each, oldest first. When the block
   pool runs dry, the newest running sequence is preempted: its blocks are freed (the
   full ones stay in the prefix cache) and it goes back to the waiting queue to be
   recomputed later (prompt + what it generated so far).
2. Running sequences still in prefill get the next chunk of their prompt, as much as the
   remaining token budget allows (chunked prefill); while any sequence decodes, prompts
   share at most ``prefill_tokens_while_decoding`` tokens of the step, when set
   (stall-free batching: a decode never waits through a long prompt's whole step).
3. Waiting sequences are admitted strictly first come, first served: reuse their cached
   prefix, then take a chunk (within what is left of the budget, and of the stall-free
   cap while any sequence decodes). If the head of the queue does not fit, nobody behind
   it is admitted (no starvation of long prompts), and nothing is admitted in a step that
   had to preempt.

:meth:`Scheduler.update` applies the step's sampled tokens, caches newly full blocks and
finishes sequences that hit EOS, a stop token, ``max_tokens`` or the context limit.
Every path out of RUNNING goes through :meth:`Scheduler.finish` or a preemption, both
of which free the sequence's blocks.

Disaggregated decode adds a side door: :meth:`Scheduler.reserve` holds blocks for a
whole prompt (its cached prefix included) outside both queues, while a prefill worker
computes it; :meth:`Scheduler.commit` then makes it RUNNING with its first token, and
:meth:`Scheduler.recompute` sends it to the waiting queue (transfer failed). A reserved
sequence is never scheduled or preempted; :meth:`Scheduler.finish` frees it like any other.
A prefill worker's export uses :meth:`Scheduler.hold`: the sequence's blocks outlive its
finish (in ``held``) until :meth:`Scheduler.release`, while a transfer reads them.

A request of several choices (``n``) computes its prompt once, as one sequence; the
other choices join at the end of that prompt through :meth:`Scheduler.fork`: they share
its full blocks (reference-counted) and get a copy of its last, partial block (copy on
write: the first block the choices write differently), then run as sequences of their
own. A fork that finds no free block for that copy waits to be recomputed instead,
like a preempted sequence (the shared blocks come back from the prefix cache).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from .block_manager import BlockManager, KVEventListener
from .params import SamplingParams, SchedulerConfig
from .sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` starting at ``start`` run this step."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool
    """Whether the chunk reaches the end of the sequence (its last logits are sampled)."""

    @classmethod
    def next_for(cls, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return cls(seq, start, num_tokens, start + num_tokens == seq.num_tokens)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def _prompt_tokens(out: SchedulerOutput) -> int:
    """Tokens of ``out`` that compute prompts (every chunk but single decode tokens)."""
    return sum(c.num_tokens for c in out.chunks if c.num_tokens > 1 or not c.samples)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, listeners: Iterable[KVEventListener] = ()
    ) -> None:
        self.config = config
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, listeners
        )
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # sorted by arrival
        self.reserved: dict[str, Sequence] = {}  # waiting for KV from a prefill worker
        self.held: dict[str, Sequence] = {}  # finished, blocks still read by a transfer
        self._holding: set[str] = set()
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = 0

    # -- requests ----------------------------------------------------------------------

    def add(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        prompt_logprobs: int | None = None,
    ) -> Sequence:
        """Queue a validated request. Raises ``KeyError`` on a duplicate id."""
        seq = self._new(seq_id, prompt_token_ids, params, cache_salt, prompt_logprobs)
        self._seqs[seq_id] = seq
        self.waiting.append(seq)
        return seq

    def _new(self, seq_id: str, prompt_token_ids: list[int], params: SamplingParams,
             cache_salt: str | None, prompt_logprobs: int | None = None) -> Sequence:
        if seq_id in self._seqs:
            raise KeyError(f"request id {seq_id!r} is already in use")
        cfg = self.config
        seq = Sequence(
            seq_id, prompt_token_ids, params, self._arrivals, cfg.block_size, cfg.model_id,
            cache_salt,
        )
        self._arrivals += 1
        seq.prompt_logprobs = prompt_logprobs
        return seq

    def reserve(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        prompt_logprobs: int | None = None,
    ) -> Sequence | None:
        """Hold blocks for the whole prompt of a request whose KV comes from elsewhere.

        The cached prefix is taken first (``seq.num_computed_tokens`` says how many
        tokens need not be sent; always less than the prompt). None, and no change, when
        the pool cannot hold the rest now or ``max_num_seqs`` are already admitted: the
        caller retries after a step frees blocks. Raises ``KeyError`` on a duplicate id.
        """
        cfg, bm = self.config, self.block_manager
        if len(self.running) + len(self.reserved) >= cfg.max_num_seqs:
            return None
        seq = self._new(seq_id, prompt_token_ids, params, cache_salt, prompt_logprobs)
        match = bm.match_prefix(seq)
        need = -(-seq.num_tokens // cfg.block_size) - len(match.block_ids)
        reserve = cfg.watermark_blocks if self.running or self.reserved else 0
        if need > bm.num_free_blocks - match.num_free_reused - reserve:
            return None
        bm.take_prefix(seq, match)
        seq.num_cached_tokens = match.num_tokens
        ok = bm.allocate(seq, seq.num_tokens)
        assert ok, "reserve checked the free blocks"
        seq.status = SequenceStatus.RESERVED
        self._seqs[seq_id] = seq
        self.reserved[seq_id] = seq
        return seq

    def commit(self, seq: Sequence, first_token: int, eos_token_ids: frozenset[int]
               ) -> FinishReason | None:
        """The KV of ``seq``'s whole prompt has landed in its blocks: cache them, add the
        first token (sampled by the prefill worker) and run. Returns the finish reason
        when that token already ends the request (then it is finished and freed)."""
        assert seq.status is SequenceStatus.RESERVED, f"{seq} is not reserved"
        del self.reserved[seq.seq_id]
        seq.num_computed_tokens = seq.num_tokens
        self.block_manager.cache_computed_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival)
        return self._append(seq, first_token, eos_token_ids)

    def recompute(self, seq: Sequence, first_token: int | None,
                  eos_token_ids: frozenset[int]) -> FinishReason | None:
        """The KV will not come (transfer failed, prefill worker died): free the blocks
        (their content is garbage, none was cached) and queue ``seq`` to be computed
        here, with its first token when the prefill worker already sampled it."""
        assert seq.status is SequenceStatus.RESERVED, f"{seq} is not reserved"
        del self.reserved[seq.seq_id]
        self.block_manager.free(seq)
        return self._requeue(seq, first_token, eos_token_ids)

    def fork(self, parent: Sequence, child: Sequence, first_token: int,
             eos_token_ids: frozenset[int]) -> tuple[FinishReason | None, tuple[int, int] | None]:
        """``child`` (a new sequence with ``parent``'s prompt, in no queue yet) starts
        where ``parent``'s computed prompt ends, with its own first token: it shares
        ``parent``'s full prompt blocks and gets a new block for the partial last one.
        Returns (the finish reason when that token ends ``child``, the (source,
        destination) block whose KV the caller must copy before the next forward, or
        None). With no free block for the copy, ``child`` waits to be recomputed."""
        cfg, bm = self.config, self.block_manager
        prompt = child.num_tokens
        assert child.num_prompt_tokens == prompt == parent.num_prompt_tokens, \
            f"{child} is no fresh fork of {parent}"
        if child.seq_id in self._seqs:
            raise KeyError(f"request id {child.seq_id!r} is already in use")
        full, partial = divmod(prompt, cfg.block_size)
        assert len(parent.block_table) >= full + (partial > 0), f"{parent} lacks its prompt"
        copy = None
        bm.share(child, parent.block_table[:full])
        if partial and not bm.allocate(child, prompt):
            bm.free(child)  # no room: compute it again later, like a preempted sequence
            return self.start(child, first_token, eos_token_ids), None
        self._seqs[child.seq_id] = child
        if partial:
            copy = (parent.block_table[full], child.block_table[full])
        child.num_computed_tokens = prompt
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_hashed_blocks = min(parent.num_hashed_blocks, full)
        child.status = SequenceStatus.RUNNING
        bisect.insort(self.running, child, key=lambda s: s.arrival)
        reason = self._append(child, first_token, eos_token_ids)
        return reason, (copy if reason is None else None)

    def start(self, seq: Sequence, first_token: int | None, eos_token_ids: frozenset[int]
              ) -> FinishReason | None:
        """Queue a sequence made by :meth:`new_sequence` to be computed here, after its
        first token when one was sampled elsewhere (a choice whose prompt KV did not
        come). Returns the finish reason when that token ends it."""
        if seq.seq_id in self._seqs:
            raise KeyError(f"request id {seq.seq_id!r} is already in use")
        self._seqs[seq.seq_id] = seq
        return self._requeue(seq, first_token, eos_token_ids)

    def _requeue(self, seq: Sequence, first_token: int | None, eos: frozenset[int]
                 ) -> FinishReason | None:
        """``seq`` (holding no blocks) waits to be computed from its first token on."""
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)
        if first_token is None:
            return None
        return self._append(seq, first_token, eos)

    def new_sequence(self, seq_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     cache_salt: str | None = None) -> Sequence:
        """A sequence in no queue (a choice waiting to :meth:`fork`); raises
        ``KeyError`` on an id in use."""
        return self._new(seq_id, prompt_token_ids, params, cache_salt)

    def _append(self, seq: Sequence, token: int, eos: frozenset[int]) -> FinishReason | None:
        seq.append_token(token)
        reason = self.stop_reason(seq, token, eos)
        if reason is not None:
            self.finish(seq, reason)
        return reason

    def get(self, seq_id: str) -> Sequence | None:
        return self._seqs.get(seq_id)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take ``seq`` out of the queues and free its blocks (idempotent)."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.RESERVED:
            del self.reserved[seq.seq_id]
        else:
            self.waiting.remove(seq)
        if seq.seq_id in self._holding:
            self._holding.discard(seq.seq_id)
            self.held[seq.seq_id] = seq
        else:
            self.block_manager.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        del self._seqs[seq.seq_id]

    def hold(self, seq: Sequence) -> None:
        """Keep ``seq``'s blocks past its finish until :meth:`release` (read-only: they
        stay shareable through the prefix cache meanwhile)."""
        assert self._seqs.get(seq.seq_id) is seq, f"{seq} is not live"
        self._holding.add(seq.seq_id)

    def quarantine(self, seq: Sequence) -> Sequence:
        """Take ``seq``'s blocks away from it (it holds none after) into ``held``, under
        a new key, until :meth:`release` of the returned placeholder: for blocks a
        failed transfer may still write into. ``seq`` itself can then be recomputed or
        finished; the pool gets the blocks back only on release."""
        placeholder = Sequence(f"{seq.seq_id}/quarantined#{self._arrivals}", [], seq.params,
                               self._arrivals, self.config.block_size, self.config.model_id)
        self._arrivals += 1
        placeholder.block_table, seq.block_table = seq.block_table, []
        placeholder.status = SequenceStatus.FINISHED
        self.held[placeholder.seq_id] = placeholder
        return placeholder

    def release(self, seq: Sequence) -> None:
        """End a :meth:`hold`; frees the blocks if ``seq`` already finished. Idempotent."""
        if self.held.get(seq.seq_id) is seq:
            del self.held[seq.seq_id]
            self.block_manager.free(seq)
        elif self._seqs.get(seq.seq_id) is seq:
            self._holding.discard(seq.seq_id)

    def abort(self, seq_id: str) -> bool:
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        self.finish(seq, FinishReason.ABORT)
        return True

    @property
    def num_unfinished(self) -> int:
        return len(self._seqs)

    # -- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        limit = self.config.max_num_batched_tokens
        decoding = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        # Prompt tokens this step may compute: the whole budget, or the stall-free cap
        # while anyone decodes (a decode this step, or one the cap keeps waiting).
        cap = self.config.prefill_tokens_while_decoding
        allowed = cap if cap and decoding else limit
        room = allowed
        used = 0  # tokens in out.chunks, kept as we go (a sum per sequence is quadratic)
        for seq in decoding + prefilling:
            if used == limit:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier this step
                continue
            left = seq.num_tokens - seq.num_computed_tokens
            n = min(left, limit - used)
            if left > 1:
                n = min(n, room)
                if n == 0:
                    continue
            preempted = len(out.preempted)
            if self._grow_or_preempt(seq, n, out):
                out.chunks.append(ScheduledChunk.next_for(seq, n))
                if left > 1:
                    room -= n
            if len(out.preempted) != preempted:  # a victim's chunk gave its tokens back
                used = out.num_batched_tokens
                room = max(0, allowed - _prompt_tokens(out))
            else:
                used += n
        if not out.preempted:
            self._admit(min(limit - out.num_batched_tokens, room), out)
        return out

    def _grow_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Make room for ``n`` more tokens of ``seq``, preempting the newest others."""
        bm = self.block_manager
        while not bm.allocate(seq, seq.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)
        out.chunks = [c for c in out.chunks if c.seq is not seq]
        out.preempted.append(seq)

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        cfg, bm = self.config, self.block_manager
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            match = bm.match_prefix(seq)
            n = min(seq.num_tokens - match.num_tokens, budget)
            new_blocks = -(-(match.num_tokens + n) // cfg.block_size) - len(match.block_ids)
            available = bm.num_free_blocks - match.num_free_reused
            # The watermark keeps room for running sequences to grow, but never blocks
            # the only request in the system (it would wait forever).
            reserve = cfg.watermark_blocks if self.running else 0
            if new_blocks > available - reserve:
                break
            self.waiting.pop(0)
            bm.take_prefix(seq, match)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = match.num_tokens
            ok = bm.allocate(seq, match.num_tokens + n)
            assert ok, "admission checked the free blocks"
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            out.chunks.append(ScheduledChunk.next_for(seq, n))
            budget -= n

    # -- after the forward pass ----------------------------------------------------------

    def update(
        self, out: SchedulerOutput, sampled: dict[str, int], eos_token_ids: frozenset[int],
        failed: dict[str, Exception] | None = None,
    ) -> list[Sequence]:
        """Record computed chunks and sampled tokens; returns sequences that finished.

        ``sampled`` maps the id of every sampling chunk's sequence to its new token.
        With ``failed``, one sequence's bookkeeping raising (hashing the block its token
        fills, say) does not stop the others': the error goes into ``failed`` under its
        id, for the caller to finish that sequence; sequences already there are skipped.
        """
        finished = []
        for chunk in out.chunks:
            seq = chunk.seq
            if failed is not None and seq.seq_id in failed:
                continue
            try:
                if self._record(chunk, sampled, eos_token_ids):
                    finished.append(seq)
            except Exception as e:
                if failed is None:
                    raise
                failed[seq.seq_id] = e  # that sequence's failure only
        return finished

    def _record(self, chunk: ScheduledChunk, sampled: dict[str, int],
                eos_token_ids: frozenset[int]) -> bool:
        """One chunk's update; whether it finished its sequence."""
        seq = chunk.seq
        seq.num_computed_tokens += chunk.num_tokens
        self.block_manager.cache_computed_blocks(seq)
        if not chunk.samples:
            return False
        return self._append(seq, sampled[seq.seq_id], eos_token_ids) is not None

    def stop_reason(
        self, seq: Sequence, token: int, eos: frozenset[int]
    ) -> FinishReason | None:
        p = seq.params
        # Before min_tokens the sampler masks these; a token that got through anyway (the
        # first token from a prefill worker, say) still does not end the request early.
        stops = (token in eos and not p.ignore_eos) or token in p.stop_token_ids
        if stops and seq.num_output_tokens > p.min_tokens:
            return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None
