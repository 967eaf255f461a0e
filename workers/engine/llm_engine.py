"""The engine loop: requests in, token deltas out.

``add_request`` validates and tokenizes a request and queues it; each ``step`` asks the
scheduler for a batch, runs it through the model runner, feeds the sampled tokens back,
detokenizes them incrementally and reports one :class:`RequestOutput` per request that
produced a token (and one last one when it finishes). ``abort_request`` frees a
request's blocks at once. Not thread-safe: one thread drives an engine; servers wrap it.

Disaggregation uses two more doors. A prefill worker adds a request with
``on_prefilled``: right after the forward pass that computed the whole prompt, the
callback gets the block table and a ``release`` function; the request ends with reason
``remote`` and its first token, but its blocks stay held (read-only) until ``release()``
is called on the engine thread, so a transfer can read them in place. With
``on_prefilling`` too, that callback gets the block table right before the forward of
the step that computes the prompt's last chunk (the blocks the KV will be in), so a
transfer can be offered while the step runs, and may return a function the forward then
calls after each layer with how many layers of KV are in the blocks (a transfer may
send them while the rest computes); it is called at most once per request, and a raise
there is logged and changes nothing. A decode worker
calls ``reserve_request`` (blocks for the whole prompt, the cached prefix reused: a
:class:`KVReservation`), lets the transfer fill them, then ``commit_request`` with the
first token, or ``recompute_request`` when the KV will not come; ``quarantine_request``
keeps blocks a failed transfer may still write into away from the pool until released.

Choices. A request of ``n`` choices is one prompt and ``n`` sequences: choice 0 is the
request's own sequence and computes the prompt; choices 1..n-1 (ids
:func:`choice_id`) wait, in no queue, until the step whose chunk reaches the prompt's
end, are sampled from that same row of logits (each with its own seed,
:func:`~common.request.choice_sampling`) and then fork it (:meth:`Scheduler.fork`: the
full prompt blocks shared, the partial one copied). On a prefill worker they only take
their first token (ending ``remote`` like choice 0); on a decode worker they fork the
committed request with the first tokens the prefill worker sampled. Every output names
its request and its choice (:attr:`RequestOutput.index`); :attr:`RequestOutput.done`
marks the request's last. Aborting the request aborts every choice.

Blast radius. What one request carries can fail only that request: its input is checked
at the door (``add_request``/``reserve_request`` check the prompt against the vocabulary
and the context, the salt against its bound; ``commit_request``/``recompute_request``
check the first token), and inside ``step`` everything done per request after the
forward (export, recording tokens and hashing full blocks, detokenizing, stop strings)
runs under a guard: a request that raises there is aborted, its blocks freed, and its
last output carries the error (:attr:`RequestOutput.error`, an
:class:`InvalidRequestError`); the rest of the batch runs on. Only the batch's own work
(scheduling, the forward, sampling) may raise out of ``step``: an engine failure.

Servers see the engine through the value objects of :mod:`workers.engine.surface` only:
:meth:`LLMEngine.capacity` (:class:`KVCapacity`), :meth:`LLMEngine.load`
(:class:`EngineLoad`) and :meth:`LLMEngine.kv_view` (:class:`KVView`, the paged cache a
transfer reads and writes), never its scheduler, block manager or model runner.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Collection, Iterable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from transformers import AutoTokenizer, GenerationConfig

from common.cost_model import StepSums, step_sums
from common.request import MAX_CHOICES, check_cache_salt, choice_sampling
from common.sampling import check_prompt, check_sampling_vocab

from .block_manager import KVEventListener
from .detokenizer import IncrementalDetokenizer
from .model_runner import ModelRunner, model_context_len
from .params import EngineConfig, InvalidRequestError, SamplingParams, SchedulerConfig
from .sampler import TokenLogprobs
from .scheduler import ScheduledChunk, Scheduler
from .sequence import FinishReason, Sequence, SequenceStatus
from .structured import Grammars
from .surface import EngineLoad, KVCapacity, KVReservation, KVView

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """Cumulative state of one request after a step, plus what is new since the last.
    ``prompt_token_ids`` is the same list in every output of a request: read it only."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    delta_text: str
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    error: InvalidRequestError | None = None
    """Set on the last output of a request that failed on its own (see the module
    docstring): it was aborted and its blocks freed; hand this to its caller."""
    index: int = 0
    """Which choice of the request (0 .. n-1); ``finished`` and the rest are that
    choice's."""
    prompt_logprobs: list[TokenLogprobs] | None = None
    """Asked for: on the first output of choice 0 that follows the prompt's computation
    here, one entry per prompt token after the first."""
    done: bool = False
    """Every choice of the request has finished: its last output."""


def coalesce(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: ``later``'s state with both steps'
    new tokens and text (a consumer that fell behind sends one message, not two)."""
    return dataclasses.replace(later, new_token_ids=first.new_token_ids + later.new_token_ids,
                               delta_text=first.delta_text + later.delta_text,
                               prompt_logprobs=first.prompt_logprobs or later.prompt_logprobs)


OnPrefilled = Callable[[list[int], Callable[[], None]], None]
"""(block table, release) -> None; ``release`` must be called on the engine thread. A
callback that raises is taken to hold nothing: the engine releases the blocks itself and
fails that request."""

OnPrefilling = Callable[[list[int]], Callable[[int], None] | None]
"""(block table) -> None, or a function the forward then tells, after each layer ``k``
of that step, that layers ``[0, k)`` of the KV are in the blocks (CPU only)."""


@dataclass
class _Tracked:
    seq: Sequence
    detok: IncrementalDetokenizer
    arrival_time: float
    first_token_time: float | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    on_prefilled: OnPrefilled | None = None
    prompt_ids: list[int] | None = None  # copied once, shared by every output
    request_id: str = ""  # the request this choice belongs to ("": its own seq id)
    index: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None  # asked for: collected so far


def choice_id(request_id: str, index: int) -> str:
    """The sequence id of choice ``index`` of a request (choice 0: the request's id)."""
    return request_id if index == 0 else f"{request_id}/{index}"


def model_identity(model_path: Path, dtype: str, kv_cache_dtype: str = "auto",
                   kv_digest: int = 0, quantization: str | None = None) -> str:
    """Seeds the block-hash chain: KV from another model, dtype, weight quantization or
    KV cache format (and key transform) must never match (a quantized cache's blocks hash
    apart from the model-precision ones)."""
    digest = hashlib.sha256((model_path / "config.json").read_bytes()).hexdigest()[:16]
    kv = "" if kv_cache_dtype == "auto" else f":kv={kv_cache_dtype}:{kv_digest:04x}"
    weights = f":w={quantization}" if quantization else ""
    return f"{model_path.name}:{digest}:{dtype}{weights}{kv}"


class LLMEngine:
    def __init__(
        self, config: EngineConfig, kv_listeners: Iterable[KVEventListener] = ()
    ) -> None:
        # ``auto`` becomes a concrete dtype here, on the machine that runs the model (a
        # worker may sit on another node than its launcher); the hash root needs it.
        requested = config.dtype
        config, why = config.resolved()
        self.config = config
        self.dtype = config.dtype
        """The dtype the model and KV cache run in (never ``auto``)."""
        log.info("dtype %s (%s)", f"auto -> {self.dtype}" if requested == "auto"
                 else self.dtype, why)
        path = Path(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        context = model_context_len(path)
        max_len = min(config.max_model_len or context, context)
        self.eos_token_ids = _eos_token_ids(path, self.tokenizer)
        self.runner = ModelRunner(config, max_len, self.eos_token_ids, self.tokenizer)
        # A sequence must always fit in the whole cache, or it could never be scheduled.
        self.max_model_len = min(max_len, self.runner.num_blocks * config.block_size)
        self.model_id = model_identity(path, config.dtype, config.kv_cache_dtype,
                                       self.runner.kv_digest, config.quantization)
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=self.runner.num_blocks,
                block_size=config.block_size,
                max_num_batched_tokens=config.max_num_batched_tokens,
                prefill_tokens_while_decoding=config.prefill_tokens_while_decoding,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                model_id=self.model_id,
                enable_prefix_caching=config.enable_prefix_caching,
                watermark_blocks=min(self.runner.num_blocks // 100, self.runner.num_blocks - 1),
            ),
            kv_listeners,
        )
        self.grammars = Grammars(self.tokenizer, self.runner.vocab_size, self.eos_token_ids)
        """Structured output: compiled grammars and each constrained request's matcher."""
        self._capacity = KVCapacity(self.runner.num_blocks, config.block_size,
                                    self.max_model_len, self.model_id)
        self._requests: dict[str, _Tracked] = {}  # by sequence id (one per choice)
        self._choices: dict[str, list[str]] = {}  # n > 1: request id -> its sequence ids
        self._forks: dict[str, list[Sequence]] = {}  # choice 0's id -> choices to fork
        self._prefilling: dict[str, OnPrefilling] = {}  # seq id -> its hook, still due
        self._prompt_lps: dict[str, int] = {}  # seq id -> alternatives: prompt logprobs due
        self.last_step_empty = False
        """Whether the last ``step`` found nothing it could run (no free blocks yet)."""
        self.step_shapes: list[tuple[int, int]] | None = None
        """When a list (set it to ``[]``), each step appends (tokens run, rows sampled):
        benchmarks replay these shapes to time the GEMM floor."""
        self.trace_sums = False
        """When True, each step that ran work leaves its :class:`StepSums` in
        :attr:`last_sums` (a worker's step trace, :mod:`workers.step_trace`)."""
        self.last_sums: StepSums | None = None

    # -- what servers see ------------------------------------------------------------------

    def capacity(self) -> KVCapacity:
        """Fixed at construction: safe from any thread."""
        return self._capacity

    def kv_view(self) -> KVView:
        """Safe from any thread (the tensor's contents are not: see :class:`KVView`)."""
        return KVView(self.runner.kv_cache, self.config.block_size, self.config.kv_cache_dtype,
                      self.runner.kv_digest)

    def load(self) -> EngineLoad:
        """A snapshot, taken on the engine thread; the snapshot may go anywhere."""
        sched, bm = self.scheduler, self.scheduler.block_manager
        return EngineLoad(len(sched.running), len(sched.waiting), bm.num_free_blocks,
                          bm.num_blocks, len(sched.reserved) + len(sched.held))

    def set_prefill_cap(self, tokens: int) -> None:
        """From the next step on, prompts share at most ``tokens`` of a step while any
        request decodes (0: no cap; :attr:`SchedulerConfig.prefill_tokens_while_decoding`).
        Engine thread only."""
        self.scheduler.config = dataclasses.replace(
            self.scheduler.config, prefill_tokens_while_decoding=tokens)

    def has_runnable_requests(self) -> bool:
        """Whether ``step`` has anything to schedule (running or waiting requests;
        reserved and held ones wait for events, not steps). Engine thread only."""
        return bool(self.scheduler.running or self.scheduler.waiting)

    # -- requests ------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        return [int(t) for t in prompt]

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        on_prefilled: OnPrefilled | None = None,
        n: int = 1,
        prompt_logprobs: int | None = None,
        on_prefilling: OnPrefilling | None = None,
    ) -> None:
        """Validate and queue; raises :class:`InvalidRequestError` and changes nothing.

        With ``on_prefilled`` the request is prefill-only (see the module docstring);
        the callback is skipped when the first token ends every choice by itself;
        ``on_prefilling`` (only with it) is called before the last chunk's forward."""
        ids = self.tokenize(prompt)
        self._validate(request_id, ids, params, cache_salt, n)
        matchers = [self.grammars.start(choice_sampling(params, i), ids) for i in range(n)]
        seq = self.scheduler.add(request_id, ids, params, cache_salt, prompt_logprobs)
        self._track_request(seq, matchers, on_prefilled)
        if on_prefilled is not None and on_prefilling is not None:
            self._prefilling[seq.seq_id] = on_prefilling

    def _track_request(self, seq: Sequence, matchers: list,
                       on_prefilled: OnPrefilled | None = None) -> None:
        """Track a request the scheduler took (choice 0) with its grammar matchers, one
        per choice, and its choices 1..n-1, waiting to fork it."""
        self._track(seq, on_prefilled)
        self.grammars.bind(seq.seq_id, matchers[0])
        if len(matchers) == 1:
            return
        rid, kids = seq.seq_id, []
        for i in range(1, len(matchers)):
            kid = self.scheduler.new_sequence(choice_id(rid, i), seq.token_ids,
                                              choice_sampling(seq.params, i), seq.cache_salt)
            self._track(kid, request_id=rid, index=i)
            self.grammars.bind(kid.seq_id, matchers[i])
            kids.append(kid)
        self._forks[rid] = kids
        self._choices[rid] = [rid] + [k.seq_id for k in kids]

    def _track(self, seq: Sequence, on_prefilled: OnPrefilled | None = None,
               request_id: str = "", index: int = 0) -> None:
        try:
            detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids, seq.params.stop,
                                           seq.params.include_stop_str_in_output,
                                           seq.params.min_tokens)
        except Exception:  # an untracked sequence would fail the next step: none
            self.scheduler.abort(seq.seq_id)
            raise
        self._requests[seq.seq_id] = _Tracked(
            seq, detok, time.monotonic(), on_prefilled=on_prefilled,
            request_id=request_id or seq.seq_id, index=index,
            prompt_logprobs=[] if seq.prompt_logprobs is not None else None)
        if seq.prompt_logprobs is not None:
            self._prompt_lps[seq.seq_id] = seq.prompt_logprobs
        if seq.params.bad_words:
            self.runner.sampler.set_bad_words(seq.seq_id, self._bad_word_ids(seq.params.bad_words))

    def _bad_word_ids(self, words: tuple[str, ...]) -> list[tuple[int, ...]]:
        """Each bad word as tokens, as vLLM does: as written (leading spaces dropped),
        and after a space when that spells it with other tokens of the same count."""
        out = []
        for word in words:
            plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(),
                                                 add_special_tokens=False))
            out.append(plain)
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        return out

    def reserve_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        n: int = 1,
        prompt_logprobs: int | None = None,
    ) -> KVReservation | None:
        """Decode side: validate, then hold blocks for the whole prompt (the cached
        prefix reused: its tokens need no transfer, the rest lands in
        ``target_block_ids``). None when there is no room now (retry after a step);
        raises :class:`InvalidRequestError` like ``add_request``. The other choices
        (``n``) hold nothing until they fork the committed prompt."""
        ids = self.tokenize(prompt)
        self._validate(request_id, ids, params, cache_salt, n)
        matchers = [self.grammars.start(choice_sampling(params, i), ids) for i in range(n)]
        seq = self.scheduler.reserve(request_id, ids, params, cache_salt, prompt_logprobs)
        if seq is None:
            return None
        self._track_request(seq, matchers)
        return KVReservation(tuple(seq.block_table), seq.num_computed_tokens, seq.num_tokens,
                             self.config.block_size)

    def commit_request(self, request_id: str, first_token: int,
                       choice_tokens: Sequence_[int] = ()) -> list[RequestOutput]:
        """The reserved request's KV has landed: join the running batch with the first
        token the prefill worker sampled (its text was already streamed from there), and
        fork the other choices with theirs (``choice_tokens``, choices 1..n-1). Returns
        the final outputs of the choices those tokens end (or, with ``error`` set, that
        failed on their own). A token outside the vocabulary, or the wrong number of
        them, raises :class:`InvalidRequestError` and changes nothing (abort then)."""
        tracked = self._requests[request_id]
        kids = self._check_first_tokens(request_id, first_token, choice_tokens)
        finals = []
        for kid, token in zip(kids, choice_tokens, strict=True):  # before the commit may
            finals.append(self._fork_committed(tracked.seq, kid, token))  # free the prompt
        try:
            reason = self.scheduler.commit(tracked.seq, first_token, self.eos_token_ids)
            finals.append(self._after_first_token(tracked, first_token, reason))
        except Exception as e:  # noqa: BLE001 - this request's failure, not the engine's
            finals.append(self._fail(tracked, "committing its first token", e,
                                     time.monotonic()))
        return [f for f in finals if f is not None]

    def recompute_request(self, request_id: str, first_token: int | None,
                          choice_tokens: Sequence_[int] = ()) -> list[RequestOutput]:
        """The reserved request's KV will not come: compute its prompt here, after the
        first token when the prefill worker sampled one (greedy output is unchanged);
        the other choices then start from theirs (each computes the prompt again, most
        of it from the prefix cache), or without, fork the prompt computed here. Checks
        the tokens like :meth:`commit_request`; returns the final outputs likewise."""
        tracked = self._requests[request_id]
        if first_token is None:
            self.scheduler.recompute(tracked.seq, None, self.eos_token_ids)
            return []
        kids = self._check_first_tokens(request_id, first_token, choice_tokens)
        self._forks.pop(request_id, None)
        finals = [self._queue_from(tracked, first_token, self.scheduler.recompute)]
        finals += [self._queue_from(self._requests[kid.seq_id], token, self.scheduler.start)
                   for kid, token in zip(kids, choice_tokens, strict=True)]
        return [f for f in finals if f is not None]

    def _queue_from(self, t: _Tracked, token: int,
                    queue: Callable[[Sequence, int, frozenset[int]], FinishReason | None]
                    ) -> RequestOutput | None:
        """One choice waits to be computed here from its first token (``queue``: the
        scheduler's recompute of a reservation, or start of a choice in no queue)."""
        try:
            reason = queue(t.seq, token, self.eos_token_ids)
            return self._after_first_token(t, token, reason)
        except Exception as e:  # noqa: BLE001 - this choice's failure only
            return self._fail(t, "recording its first token", e, time.monotonic())

    def _check_first_tokens(self, request_id: str, first_token: int,
                            choice_tokens: Sequence_[int]) -> list[Sequence]:
        """The choices waiting to fork ``request_id``, after checking a first token for
        each of them (raises :class:`InvalidRequestError` naming ``first_token``)."""
        self.check_first_token(first_token)
        kids = self._forks.get(request_id, [])
        if len(choice_tokens) != len(kids):
            raise InvalidRequestError(
                "first_token", f"{len(choice_tokens)} first tokens for the other choices; "
                f"the request has {len(kids)}")
        for token in choice_tokens:
            self.check_first_token(token)
        return kids

    def _fork_committed(self, parent: Sequence, kid: Sequence, token: int
                        ) -> RequestOutput | None:
        """A choice forks a committed prompt with its first token (sampled elsewhere)."""
        self._forks.pop(parent.seq_id, None)
        t = self._requests[kid.seq_id]
        try:
            reason, copy = self.scheduler.fork(parent, kid, token, self.eos_token_ids)
            if copy is not None:
                self.runner.copy_blocks([copy])
            return self._after_first_token(t, token, reason)
        except Exception as e:  # noqa: BLE001 - this choice's failure only
            return self._fail(t, "forking the prompt", e, time.monotonic())

    def check_first_token(self, token: object) -> None:
        """Raises :class:`InvalidRequestError` unless ``token`` is a token id of this
        model: a first token from elsewhere enters the next forward's input."""
        vocab = self.runner.vocab_size
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise InvalidRequestError(
                "first_token", f"token id {token!r} is outside the vocabulary [0, {vocab})")

    def quarantine_request(self, request_id: str) -> Callable[[], None]:
        """Take a reserved request's blocks away from it, for a failed transfer may still
        write into them: the request holds none after (commit, recompute or abort it as
        usual) and the pool gets them back only when the returned ``release`` is called,
        on the engine thread (idempotent)."""
        held = self.scheduler.quarantine(self.scheduler.reserved[request_id])
        return partial(self.scheduler.release, held)

    def _after_first_token(self, tracked: _Tracked, token: int, reason: FinishReason | None
                           ) -> RequestOutput | None:
        """Bring the detokenizer to the prefill worker's state (its delta was sent from
        there); end the request if the token ended it."""
        now = time.monotonic()
        tracked.first_token_time = now
        tracked.detok.add(token)  # may raise: the callers fail this request alone
        seq = tracked.seq
        complete = self.grammars.advance(seq.seq_id, token)  # may raise, likewise
        self.runner.sampler.skip(seq.seq_id, seq.params, self.runner.vocab_size)
        if (tracked.detok.stopped_by is not None or complete) and reason is None:
            self.scheduler.finish(seq, FinishReason.STOP)
        if not seq.is_finished:
            return None
        del self._requests[seq.seq_id]
        self._release(seq.seq_id)
        return self._output(tracked, [], tracked.detok.flush(), now)

    def _validate(self, request_id: str, ids: list[int], params: SamplingParams,
                  cache_salt: str | None, n: int = 1) -> None:
        if not 1 <= n <= MAX_CHOICES:
            raise InvalidRequestError("n", f"must be from 1 to {MAX_CHOICES}, got {n}")
        for i in range(n):
            seq_id = choice_id(request_id, i)
            if seq_id in self._requests or seq_id in self.scheduler.held:
                raise InvalidRequestError("request_id", f"{seq_id!r} is already running")
        check_prompt(ids, self.max_model_len, self.runner.vocab_size)
        check_sampling_vocab(params, self.runner.vocab_size)
        check_cache_salt(cache_salt)  # it is hashed again each time a block fills

    def abort_request(self, request_id: str) -> bool:
        """Stop a request (every choice) now and free its blocks; False if it was not
        running."""
        self._forks.pop(request_id, None)
        aborted = False
        for seq_id in self._choices.pop(request_id, [request_id]):
            if self._requests.pop(seq_id, None) is None:
                continue
            self.scheduler.abort(seq_id)
            self._release(seq_id)
            aborted = True
        return aborted

    def _release(self, seq_id: str) -> None:
        """Forget a request's per-request sampling state (generator, grammar, prompt
        log-probabilities still due)."""
        self._prompt_lps.pop(seq_id, None)
        self.runner.sampler.release(seq_id)
        self.grammars.release(seq_id)

    def abort_all(self, keep: Collection[str] = ()) -> int:
        """Abort every request but those in ``keep`` (after an engine failure); returns
        how many were aborted."""
        doomed = {t.request_id for t in self._requests.values() if t.request_id not in keep}
        for rid in doomed:
            self.abort_request(rid)
        return len(doomed)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One batch: schedule, forward, then each request's own bookkeeping. Raises only
        when the batch's work fails (an engine failure); a request failing on its own is
        aborted and reported in its output (see the module docstring)."""
        out = self.scheduler.schedule()
        self.last_step_empty = out.is_empty
        if out.is_empty:
            return []
        layers = self._announce_prefilling(out.chunks) if self._prefilling else []
        result = self.runner.execute(out.chunks, self.grammars or None, self._forks or None,
                                     self._prompt_lps or None, _told(layers))
        self._collect_prompt_logprobs(result.prompt_logprobs)
        if self.step_shapes is not None:
            self.step_shapes.append((out.num_batched_tokens, len(result.seq_ids)))
        if self.trace_sums:
            self.last_sums = step_sums((c.num_tokens, c.start) for c in out.chunks)
        sampled = dict(zip(result.seq_ids, result.sample.token_ids, strict=True))
        failed: dict[str, tuple[str, Exception]] = {}
        self._export_prefilled(sampled, failed)
        self._fork_sampled(sampled, failed)
        recording = {seq_id: e for seq_id, (_, e) in failed.items()}
        self.scheduler.update(out, sampled, self.eos_token_ids, recording)
        for seq_id, e in recording.items():
            if seq_id not in failed:
                failed[seq_id] = ("recording its tokens", e)
        now = time.monotonic()
        outputs = []
        for seq_id, token, lp in zip(
            result.seq_ids, result.sample.token_ids, result.sample.logprobs, strict=True
        ):
            tracked = self._requests[seq_id]
            if seq_id not in failed:
                try:
                    outputs.append(self._advance(tracked, token, lp, now))
                    continue
                except Exception as e:  # noqa: BLE001 - this request's failure only
                    failed[seq_id] = ("turning its tokens into text", e)
            outputs.append(self._fail(tracked, *failed.pop(seq_id), now))
        for seq_id, (phase, e) in failed.items():  # failed in a chunk that did not sample
            outputs.append(self._fail(self._requests[seq_id], phase, e, now))
        return outputs

    def _announce_prefilling(self, chunks: list[ScheduledChunk]
                             ) -> list[Callable[[int], None]]:
        """``on_prefilling`` of each request whose prompt's last chunk runs this step
        (once; ids of requests gone meanwhile are dropped); what they return to be told
        of the layers."""
        told: list[Callable[[int], None]] = []
        last = {c.seq.seq_id: c.seq for c in chunks if c.samples}
        for seq_id, hook in list(self._prefilling.items()):
            seq = last.get(seq_id)
            if seq is None and seq_id in self._requests:
                continue  # its last chunk is still to come
            del self._prefilling[seq_id]
            if seq is None:
                continue  # gone meanwhile
            try:
                layers = hook(list(seq.block_table))
            except Exception:  # noqa: BLE001 - an early notice only; the export still runs
                log.exception("request %s: on_prefilling failed", seq_id)
                continue
            if layers is not None:
                told.append(layers)
        return told

    def _advance(self, tracked: _Tracked, token: int, lp: TokenLogprobs | None,
                 now: float) -> RequestOutput:
        """A request's sampled token, already recorded: text, stop strings, its end."""
        seq = tracked.seq
        if tracked.first_token_time is None:
            tracked.first_token_time = now
        if lp is not None:
            tracked.logprobs.append(lp)
        delta = tracked.detok.add(token)
        # A grammar that is complete ends the request like a stop string.
        if self.grammars.advance(seq.seq_id, token) or tracked.detok.stopped_by is not None:
            if seq.is_finished:  # the same token also hit a length limit or EOS
                seq.finish_reason = FinishReason.STOP
            else:
                self.scheduler.finish(seq, FinishReason.STOP)
        if tracked.on_prefilled is not None and not seq.is_finished:
            # Decoding goes on elsewhere, with this detokenizer state: no flush.
            self.scheduler.finish(seq, FinishReason.REMOTE)
        elif seq.is_finished and seq.finish_reason is not FinishReason.REMOTE:
            delta += tracked.detok.flush()
        if seq.is_finished:
            del self._requests[seq.seq_id]
            self._release(seq.seq_id)
        return self._output(tracked, [token], delta, now)

    def _fail(self, tracked: _Tracked, phase: str, error: Exception, now: float
              ) -> RequestOutput:
        """Abort one request that failed on its own; its last output carries the error.
        Blocks held for an export stay held until the transfer releases them."""
        seq = tracked.seq
        if isinstance(error, InvalidRequestError):
            log.warning("request %s refused while %s: %s", seq.seq_id, phase, error)
        else:
            log.error("request %s failed while %s; aborted, the rest of the batch runs on",
                      seq.seq_id, phase, exc_info=error)
            error = InvalidRequestError(
                "request", f"failed while {phase} ({type(error).__name__}: {error}); it was "
                "aborted, the other requests on this worker were not affected")
        self._requests.pop(seq.seq_id, None)
        waiting = self._forks.get(tracked.request_id)
        if waiting and seq in waiting:
            waiting.remove(seq)
        if self.scheduler.get(seq.seq_id) is seq:
            self.scheduler.finish(seq, FinishReason.ABORT)  # idempotent
        elif not seq.is_finished:  # a choice that never joined the queues: holds nothing
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
        self._release(seq.seq_id)
        out = self._output(tracked, [], "", now)
        out.error = error
        return out

    def _fork_sampled(self, sampled: dict[str, int],
                      failed: dict[str, tuple[str, Exception]]) -> None:
        """Choices sampled this step from their request's prompt: on a prefill worker
        they end ``remote`` with that token; elsewhere they fork the prompt's blocks
        (before the step's update, which may finish choice 0 and free them)."""
        copies = []
        for parent_id in [p for p in self._forks if p in sampled]:
            parent = self._requests[parent_id]
            for kid in self._forks.pop(parent_id):
                token = sampled[kid.seq_id]
                try:
                    if parent.on_prefilled is not None:
                        kid.append_token(token)
                        reason = self.scheduler.stop_reason(kid, token, self.eos_token_ids)
                        kid.status = SequenceStatus.FINISHED
                        kid.finish_reason = reason or FinishReason.REMOTE
                        continue
                    _, copy = self.scheduler.fork(parent.seq, kid, token, self.eos_token_ids)
                    if copy is not None:
                        copies.append(copy)
                except Exception as e:  # noqa: BLE001 - this choice's failure only
                    failed[kid.seq_id] = ("forking the prompt", e)
        self.runner.copy_blocks(copies)

    def _collect_prompt_logprobs(self, got: dict[str, list[tuple[int, TokenLogprobs]]]
                                 ) -> None:
        """Append each position's entry in order (a recomputed chunk repeats none)."""
        for seq_id, entries in got.items():
            t = self._requests.get(seq_id)
            if t is None or t.prompt_logprobs is None:
                continue
            for pos, entry in entries:
                if pos == len(t.prompt_logprobs):
                    t.prompt_logprobs.append(entry)
            if len(t.prompt_logprobs) >= t.seq.num_prompt_tokens - 1:
                self._prompt_lps.pop(seq_id, None)

    def _continues(self, seq: Sequence, token: int) -> bool:
        """Whether ``seq`` goes on after its first token ``token`` (not yet recorded)."""
        return (seq.num_output_tokens + 1 < seq.params.max_tokens
                and seq.num_tokens + 1 < self.max_model_len
                and self.scheduler.stop_reason(seq, token, self.eos_token_ids) is None)

    def _export_prefilled(self, sampled: dict[str, int],
                          failed: dict[str, tuple[str, Exception]]) -> None:
        """Hand prefill-only requests' blocks out while their KV is complete and held
        (unless every choice ends at its first token); a callback that raises fails its
        request (into ``failed``) and holds nothing."""
        for seq_id, token in sampled.items():
            tracked = self._requests[seq_id]
            if tracked.on_prefilled is None:
                continue
            seq = tracked.seq
            try:
                if (self._continues(seq, token) or any(
                        self._continues(kid, sampled[kid.seq_id])
                        for kid in self._forks.get(seq_id, ()))):
                    self.scheduler.hold(seq)
                    tracked.on_prefilled(list(seq.block_table),
                                         partial(self.scheduler.release, seq))
            except Exception as e:  # noqa: BLE001 - this request's failure only
                self.scheduler.release(seq)  # live: ends the hold, finish frees the blocks
                failed[seq_id] = ("handing its KV blocks out", e)

    def _output(
        self, t: _Tracked, new_ids: list[int], delta: str, now: float
    ) -> RequestOutput:
        seq = t.seq
        if t.prompt_ids is None:  # not per step: a long prompt would cost every token
            t.prompt_ids = seq.token_ids[: seq.num_prompt_tokens]
        prompt_lps = None
        if (t.prompt_logprobs is not None and seq.seq_id not in self._prompt_lps
                and new_ids):  # complete: with the first token that follows
            prompt_lps, t.prompt_logprobs = t.prompt_logprobs, None
        done = seq.is_finished
        siblings = self._choices.get(t.request_id)  # n > 1
        if done and siblings is not None:  # a finished choice has left _requests already
            done = not any(s in self._requests for s in siblings)
            if done:
                del self._choices[t.request_id]
        return RequestOutput(
            request_id=t.request_id,
            prompt_token_ids=t.prompt_ids,
            token_ids=seq.output_token_ids,
            new_token_ids=new_ids,
            text=t.detok.text,
            delta_text=delta,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=list(t.logprobs) if seq.params.logprobs is not None else None,
            arrival_time=t.arrival_time,
            first_token_time=t.first_token_time,
            finish_time=now if seq.is_finished else None,
            index=t.index,
            done=done,
            prompt_logprobs=prompt_lps,
        )


def _told(listeners: list[Callable[[int], None]]) -> Callable[[int], None] | None:
    """One ``after_layer`` for the forward that tells every listener (None: none); a
    listener that raises is logged and told no more, and the step goes on."""
    if not listeners:
        return None

    def after_layer(k: int) -> None:
        for f in list(listeners):
            try:
                f(k)
            except Exception:  # noqa: BLE001 - a progress note only
                log.exception("a KV layer listener failed; it is told no more this step")
                listeners.remove(f)

    return after_layer


def _eos_token_ids(path: Path, tokenizer: object) -> frozenset[int]:
    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = None
    for value in (eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(value)
    return frozenset(ids)
