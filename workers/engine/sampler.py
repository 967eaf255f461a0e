"""Turn logits into tokens, one row per sampling sequence.

Greedy rows take the argmax. Random rows apply temperature, then top-k, top-p and min-p
filters, then draw with the exponential-race trick (``argmax(p / E)`` with ``E ~ Exp(1)``
is a draw from ``p``), which needs no sort and lets each seeded request draw its noise
from its own generator: a seeded request's tokens do not depend on its batch-mates.
Log-probabilities, when asked for, are of the raw model distribution (before any
temperature or filter), as in vLLM.

Before either, the rows of requests that ask for it are processed, batched over the
vocabulary (one index operation per kind, over all such rows): repetition, frequency
and presence penalties from each row's token history, ``logit_bias``, then the
``allowed_token_ids`` mask, the ``bad_words`` ban (one index operation over the
rows and their banned tokens), the grammar mask of structured-output rows (one bitmask for
all of them) and the ``min_tokens`` mask of EOS and stop token ids. Each
row's history is the sequence's own tokens, so a prefill worker (first token) and a
decode worker (the rest) penalize alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .params import SamplingParams


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first
    rank: int = 0  # 1 + tokens likelier than ``token_id`` (0: not computed)


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class TokenHistory(Protocol):
    """What the sampler reads of a sequence (the engine's ``Sequence`` is one): its
    tokens so far, prompt first. Read during :meth:`Sampler.sample` only, never kept."""

    token_ids: list[int]
    num_prompt_tokens: int


class TokenMasks(Protocol):
    """Which tokens constrained rows may sample (the engine's ``Grammars`` is one)."""

    def allowed(self, seq_ids: list[str]) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bool [len(rows), vocab] of allowed tokens), or None: no row is."""


class Sampler:
    """Keeps one generator per seeded request (and the prompt tokens of a request with
    a repetition penalty); call :meth:`release` when it ends."""

    def __init__(self, seed: int = 0, eos_token_ids: frozenset[int] = frozenset(),
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.argmax = argmax
        """``x.argmax(dim=-1)`` of float32 ``[rows, vocab]``, the same indices, faster
        (the native kernel's, :func:`workers.engine.kernels.argmax_rows`); None: torch's."""
        self._default = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._prompts: dict[str, torch.Tensor] = {}
        self._bad_words: dict[str, tuple[tuple[int, ...], ...]] = {}
        self.eos_token_ids = eos_token_ids
        """Masked (with ``stop_token_ids``) before a request's ``min_tokens``."""

    def release(self, seq_id: str) -> None:
        self._generators.pop(seq_id, None)
        self._prompts.pop(seq_id, None)
        self._bad_words.pop(seq_id, None)

    def set_bad_words(self, seq_id: str, sequences: Sequence[Sequence[int]]) -> None:
        """A request's ``bad_words`` as token sequences (the engine tokenizes them): the
        last token of each is banned whenever the tokens so far end with the rest."""
        self._bad_words[seq_id] = tuple(tuple(s) for s in sequences if s)

    def skip(self, seq_id: str, p: SamplingParams, vocab_size: int) -> None:
        """Advance a seeded request's generator past one draw made elsewhere (the first
        token, sampled on a prefill worker), so its later tokens match a local run."""
        if p.seed is not None and not p.greedy:
            torch.empty(vocab_size).exponential_(generator=self._generator(seq_id, p))

    def sample(
        self, logits: torch.Tensor, seq_ids: list[str], params: list[SamplingParams],
        histories: Sequence[TokenHistory] | None = None, masks: TokenMasks | None = None,
    ) -> SampleResult:
        """logits: fp32 [rows, vocab]. Does not modify ``logits``. ``histories`` (one per
        row) are needed when a row's params process its logits (penalties, min_tokens).
        ``masks`` (structured output) bans what each constrained row's grammar forbids."""
        processed = self._process(logits, seq_ids, params, histories,
                                  masks.allowed(seq_ids) if masks else None)
        tokens = self._argmax_of(processed)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            idx = torch.tensor(random_rows)
            drawn = self._draw(processed[idx], [seq_ids[i] for i in random_rows],
                               [params[i] for i in random_rows])
            tokens[idx] = drawn
        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            lp = torch.log_softmax(logits[wanted], dim=-1)
            for row, i in enumerate(wanted):
                n = min(params[i].logprobs or 0, lp.shape[-1])  # a vocabulary under 20
                top_v, top_i = lp[row].topk(n) if n else (torch.empty(0), torch.empty(0))
                logprobs[i] = TokenLogprobs(
                    token_list[i],
                    float(lp[row, token_list[i]]),
                    tuple(zip(top_i.tolist(), top_v.tolist(), strict=True)),
                )
        return SampleResult(token_list, logprobs)

    def _argmax_of(self, logits: torch.Tensor) -> torch.Tensor:
        if (self.argmax is not None and logits.dtype == torch.float32 and logits.dim() == 2
                and logits.shape[-1] > 0 and logits.stride(-1) == 1):
            return self.argmax(logits)
        return logits.argmax(dim=-1)

    def _process(
        self, logits: torch.Tensor, seq_ids: list[str], params: list[SamplingParams],
        histories: Sequence[TokenHistory] | None,
        grammar: tuple[list[int], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The logits sampling sees: ``logits`` itself when no row asks for processing,
        else a processed copy."""
        rows = [i for i, p in enumerate(params) if p.processes_logits]
        if not rows:
            if grammar is None:
                return logits
            return _keep_only(logits.clone(), grammar)
        if histories is None:
            raise ValueError("penalties and min_tokens need each row's token history")
        logits = logits.clone()
        penalized = [i for i in rows if params[i].penalized]
        if penalized:
            idx = torch.tensor(penalized)
            logits[idx] = self._penalize(logits[idx], [seq_ids[i] for i in penalized],
                                         [params[i] for i in penalized],
                                         [histories[i] for i in penalized])
        vocab = logits.shape[-1]
        bias_at: list[tuple[int, int]] = []
        bias: list[float] = []
        for i in rows:
            for token, value in params[i].logit_bias:
                bias_at.append((i, token))
                bias.append(value)
        if bias:
            logits.index_put_(_index(bias_at), torch.tensor(bias), accumulate=True)
        allowed_rows = [i for i in rows if params[i].allowed_token_ids]
        if allowed_rows:
            allowed = torch.zeros(len(allowed_rows), vocab, dtype=torch.bool)
            at = [(r, t) for r, i in enumerate(allowed_rows)
                  for t in params[i].allowed_token_ids]
            allowed.index_put_(_index(at), torch.tensor(True))
            _keep_only(logits, (allowed_rows, allowed))
        banned = [(i, seq[-1]) for i in rows if params[i].bad_words
                  for seq in self._bad_words.get(seq_ids[i], ())
                  if seq[-1] < vocab
                  and (len(seq) == 1 or _ends_with(histories[i].token_ids, seq[:-1]))]
        if banned:
            logits.index_put_(_index(banned), torch.tensor(float("-inf")))
        if grammar is not None:
            _keep_only(logits, grammar)
        early = [(i, t) for i in rows if _before_min_tokens(params[i], histories[i])
                 for t in self._stop_ids(params[i]) if t < vocab]
        if early:
            held = torch.tensor(sorted({i for i, _ in early}))
            before = logits[held]
            logits.index_put_(_index(early), torch.tensor(float("-inf")))
            # A row whose allowed tokens are all stop tokens would have nothing left to
            # sample: it keeps them (and ends) rather than sampling from no tokens.
            empty = torch.isneginf(logits[held]).all(dim=-1)
            if bool(empty.any()):
                logits[held[empty]] = before[empty]
        return logits

    def _stop_ids(self, p: SamplingParams) -> set[int]:
        return set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))

    def _penalize(
        self, logits: torch.Tensor, seq_ids: list[str], params: list[SamplingParams],
        histories: list[TokenHistory],
    ) -> torch.Tensor:
        """Repetition, frequency and presence penalties on ``logits`` [rows, vocab]: counts
        of each row's output tokens by one ``index_put_``, the prompt's tokens marked
        row by row (a tensor kept per request), then elementwise over the batch."""
        at = [(r, t) for r, h in enumerate(histories)
              for t in h.token_ids[h.num_prompt_tokens:]]
        counts = torch.zeros_like(logits)
        if at:
            counts.index_put_(_index(at), torch.ones(len(at)), accumulate=True)
        seen = counts > 0
        for r, (seq_id, p, h) in enumerate(zip(seq_ids, params, histories, strict=True)):
            if p.repetition_penalty != 1.0:
                seen[r, self._prompt(seq_id, h)] = True
        rep = torch.tensor([p.repetition_penalty for p in params]).unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        freq = torch.tensor([p.frequency_penalty for p in params]).unsqueeze(1)
        presence = torch.tensor([p.presence_penalty for p in params]).unsqueeze(1)
        logits = logits - freq * counts - presence * (counts > 0)
        # A tiny repetition penalty may overflow float32; softmax needs finite logits.
        info = torch.finfo(logits.dtype)
        return logits.clamp(info.min, info.max)

    def _prompt(self, seq_id: str, h: TokenHistory) -> torch.Tensor:
        prompt = self._prompts.get(seq_id)
        if prompt is None:  # built once: a long prompt is not re-read every step
            prompt = torch.tensor(sorted(set(h.token_ids[: h.num_prompt_tokens])),
                                  dtype=torch.long)
            self._prompts[seq_id] = prompt
        return prompt

    def _draw(
        self, logits: torch.Tensor, seq_ids: list[str], params: list[SamplingParams]
    ) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
        logits = logits / temps
        if any(p.top_k > 0 for p in params):
            vocab = logits.shape[-1]
            ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (ks - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # Drop a token when the tokens strictly more likely already cover top_p.
            drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
            # The most likely token always stays, even for a top_p that is 0 in float32.
            drop_sorted[:, 0] = False
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0)
        noise = torch.empty_like(probs)
        for row, (seq_id, p) in enumerate(zip(seq_ids, params, strict=True)):
            noise[row].exponential_(generator=self._generator(seq_id, p))
        return self._argmax_of(probs / noise)

    def _generator(self, seq_id: str, p: SamplingParams) -> torch.Generator:
        if p.seed is None:
            return self._default
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = self._generators[seq_id] = torch.Generator().manual_seed(p.seed)
        return gen


def _keep_only(logits: torch.Tensor, allowed_rows: tuple[list[int], torch.Tensor]
               ) -> torch.Tensor:
    """Ban, in place, every token the given rows may not sample: ``(rows, allowed)``
    with ``allowed`` a bool [len(rows), vocab] (one batched op; ``allowed_token_ids``
    and grammars alike)."""
    rows, allowed = allowed_rows
    idx = torch.tensor(rows)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return logits


def _index(at: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) pairs as the index tensors ``index_put_`` takes."""
    return tuple(torch.tensor(at, dtype=torch.long).T)  # type: ignore[return-value]


def _ends_with(tokens: list[int], prefix: tuple[int, ...]) -> bool:
    n = len(prefix)
    return len(tokens) >= n and tuple(tokens[-n:]) == prefix


def _before_min_tokens(p: SamplingParams, h: TokenHistory) -> bool:
    return p.min_tokens > 0 and len(h.token_ids) - h.num_prompt_tokens < p.min_tokens
