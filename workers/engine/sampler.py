"""Turn logits into tokens, one row per sampling sequence.

Greedy rows take the argmax. Random rows apply temperature, then top-k, top-p and min-p
filters, then draw with the exponential-race trick (``argmax(p / E)`` with ``E ~ Exp(1)``
is a draw from ``p``), which needs no sort and lets each seeded request draw its noise
from its own generator: a seeded request's tokens do not depend on its batch-mates.
Log-probabilities, when asked for, are of the raw model distribution (before any
temperature or filter), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .params import SamplingParams


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Keeps one generator per seeded request; call :meth:`release` when it ends."""

    def __init__(self, seed: int = 0) -> None:
        self._default = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def release(self, seq_id: str) -> None:
        self._generators.pop(seq_id, None)

    def skip(self, seq_id: str, p: SamplingParams, vocab_size: int) -> None:
        """Advance a seeded request's generator past one draw made elsewhere (the first
        token, sampled on a prefill worker), so its later tokens match a local run."""
        if p.seed is not None and not p.greedy:
            torch.empty(vocab_size).exponential_(generator=self._generator(seq_id, p))

    def sample(
        self, logits: torch.Tensor, seq_ids: list[str], params: list[SamplingParams]
    ) -> SampleResult:
        """logits: fp32 [rows, vocab]. Does not modify ``logits``."""
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            idx = torch.tensor(random_rows)
            drawn = self._draw(logits[idx], [seq_ids[i] for i in random_rows],
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
        return (probs / noise).argmax(dim=-1)

    def _generator(self, seq_id: str, p: SamplingParams) -> torch.Generator:
        if p.seed is None:
            return self._default
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = self._generators[seq_id] = torch.Generator().manual_seed(p.seed)
        return gen
