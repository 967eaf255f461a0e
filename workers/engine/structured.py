"""Grammar-constrained decoding (structured output) with llguidance.

Lifecycle of a request with ``SamplingParams.structured``: at the door
(:meth:`Grammars.start`) its spec is compiled, or taken from an LRU of compiled grammars
(a schema compiles once per worker; each request gets a cheap copy of the compiled
matcher), and advanced over the tokens already generated under it: a migrated request's
``prior_tokens``, then on a decode worker the first token the prefill worker sampled
(:meth:`Grammars.advance`, the same path). So the state is always re-derived from the
tokens, never shipped. Each step the sampler asks :meth:`Grammars.allowed` for the
rows under a grammar (one bitmask for all of them) and masks their logits; after
sampling, the engine feeds each row's token to :meth:`Grammars.advance`, which says
when the grammar is complete (the request then ends with ``stop``) and raises
:class:`InvalidRequestError` for that request alone when its matcher fails.
:meth:`Grammars.release` forgets a request. Engine thread only; not thread-safe.

llguidance (MIT, Rust core) computes each mask lazily over a token trie, so compiling
a schema costs about a millisecond on SmolLM2's 49k-token vocabulary (measured here) and
no per-schema precomputation competes with decoding for the same CPU cores.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import torch

from .params import InvalidRequestError
from .params import SamplingParams as _Params

# llguidance.numpy, not llguidance.torch: the latter's torch.compile decorator imports
# inductor, ~2 s of every worker's start (a supervised restart's included).

COMPILED_CACHE_SIZE = 128
"""Distinct specs kept compiled per worker; a hit costs a copy of the matcher."""

_SHIFTS = torch.arange(32, dtype=torch.int32)


def _grammar(kind: str, spec: str) -> str:
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "grammar":
        # Lark as is; anything else is read as GBNF and converted (llguidance's converter)
        return llguidance.grammar_from("grammar", spec)
    # choice: each string literally (JSON string syntax is Lark's too)
    lark = "start: " + " | ".join(json.dumps(c) for c in json.loads(spec))
    return llguidance.LLMatcher.grammar_from_lark(lark)


class Grammars:
    """Compiled grammars (cached) and each constrained request's matcher."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                 cache_size: int = COMPILED_CACHE_SIZE) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltok: Any = None  # built on first use (~0.3 s): most workers never need it
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self.compiles = 0
        """Grammars compiled so far (cache misses); tests read it."""

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def start(self, params: _Params, prompt: list[int]) -> llguidance.LLMatcher | None:
        """A matcher for a new request, advanced over its ``prior_tokens`` (the prompt's
        tail); None when unconstrained. Raises :class:`InvalidRequestError` naming
        ``structured`` when the spec does not compile or those tokens break it. Nothing
        is kept until :meth:`bind`."""
        s = params.structured
        if s is None:
            return None
        if s.prior_tokens >= len(prompt):
            raise InvalidRequestError(
                "structured", f"prior_tokens {s.prior_tokens} must be below the prompt's "
                f"{len(prompt)} tokens")
        matcher = self._template(s.kind, s.spec).deep_copy()
        if s.prior_tokens:
            _consume(matcher, prompt[len(prompt) - s.prior_tokens:])
        return matcher

    def bind(self, seq_id: str, matcher: llguidance.LLMatcher | None) -> None:
        if matcher is not None:
            self._matchers[seq_id] = matcher

    def advance(self, seq_id: str, token: int) -> bool:
        """Feed a sampled token; True when the grammar is complete (end the request).
        Raises :class:`InvalidRequestError` when the token breaks the grammar."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return False
        _consume(matcher, [token])
        return matcher.is_stopped()

    def release(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)

    def allowed(self, seq_ids: list[str]) -> tuple[list[int], torch.Tensor] | None:
        """The rows of ``seq_ids`` under a grammar and, for those rows, a bool tensor
        [rows, vocab] of the tokens each may sample; None when no row is constrained."""
        rows = [i for i, s in enumerate(seq_ids) if s in self._matchers]
        if not rows:
            return None
        words = llguidance.numpy.allocate_token_bitmask(len(rows), self.vocab_size)
        for r, i in enumerate(rows):
            llguidance.numpy.fill_next_token_bitmask(self._matchers[seq_ids[i]], words, r)
        bits = (torch.from_numpy(words).unsqueeze(-1) >> _SHIFTS) & 1
        return rows, bits.view(len(rows), -1)[:, : self.vocab_size].bool()

    def _template(self, kind: str, spec: str) -> llguidance.LLMatcher:
        key = (kind, spec)
        matcher = self._compiled.get(key)
        if matcher is not None:
            self._compiled.move_to_end(key)
            return matcher
        if self._lltok is None:
            self._lltok = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None)
        try:
            grammar = _grammar(kind, spec)
        except Exception as e:  # noqa: BLE001 - the library's words for a bad spec
            raise InvalidRequestError("structured", f"the {kind} spec does not compile: "
                                                    f"{e}") from None
        matcher = llguidance.LLMatcher(self._lltok, grammar, log_level=0)
        self.compiles += 1
        if matcher.is_error():
            raise InvalidRequestError(
                "structured", f"the {kind} spec does not compile: {matcher.get_error()}")
        self._compiled[key] = matcher
        if len(self._compiled) > self._cache_size:
            self._compiled.popitem(last=False)
        return matcher


def _consume(matcher: llguidance.LLMatcher, tokens: list[int]) -> None:
    for t in tokens:
        if not matcher.consume_token(t) or matcher.is_error():
            raise InvalidRequestError(
                "structured", f"token {t} does not continue the output's grammar: "
                f"{matcher.get_error().splitlines()[0] if matcher.get_error() else ''}")
