"""Request sampling parameters: one validated type for the router and every worker.

Everything is checked once, at construction, and never mutated afterwards. A bad value
raises :class:`InvalidRequestError` naming the field, the value and the limit, so servers
hand it to clients as ``INVALID_ARGUMENT`` (HTTP 400) unchanged.

Every field is bounded (the ``MAX_*`` / ``*_MIN`` constants below), so no client value
can fail later, inside an engine step shared with other requests: integers fit their
wire types (``common.proto``), floats are finite, lists and strings have a size a
per-step scan can afford.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class InvalidRequestError(ValueError):
    """A request the engine refuses; ``field`` names the offending parameter."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


GREEDY_BELOW = 1e-5
"""Temperatures under this are greedy (as in vLLM), never a division that overflows."""

MAX_TOKENS_LIMIT = 2**32 - 1
"""``max_tokens`` is a uint32 on the wire; the engine also ends a request at its
context length, so this only keeps the value representable everywhere."""

TOP_K_MIN, TOP_K_MAX = -1, 2**31 - 1
"""``top_k`` is an int32 on the wire; 0 and -1 (vLLM's spelling) disable it, values
above the vocabulary mean the whole vocabulary."""

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""``seed`` is an int64 on the wire (and fits ``torch.Generator.manual_seed``)."""

MAX_STOP_STRINGS = 16
"""OpenAI allows 4 stop sequences; 16 leaves room for chat templates' end markers. Each
step searches the new text for every stop string, so the count is per-step work."""

MAX_STOP_STRING_CHARS = 256
"""Longer than any end marker or delimiter in practice; the detokenizer holds back up
to this many characters of output while they could still begin a stop string."""

MAX_STOP_TOKEN_IDS = 64
"""Several times the end-of-turn ids of any chat model; checked on every sampled token.
Each id must fit the wire's uint32: ``[0, STOP_TOKEN_ID_MAX]``."""

STOP_TOKEN_ID_MAX = 2**32 - 1

MAX_LOGPROBS = 20
"""OpenAI's (and vLLM's default) limit on ``top_logprobs``."""

PENALTY_MIN, PENALTY_MAX = -2.0, 2.0
"""OpenAI's range for ``frequency_penalty`` and ``presence_penalty``."""

MAX_LOGIT_BIAS = 300
"""OpenAI's limit on ``logit_bias`` entries; each is written into the logits every step."""

LOGIT_BIAS_MIN, LOGIT_BIAS_MAX = -100.0, 100.0
"""OpenAI's range for one ``logit_bias`` value (-100 bans a token, 100 all but forces it)."""

MAX_ALLOWED_TOKEN_IDS = 2**16
"""``allowed_token_ids`` builds a vocabulary mask every step; 65536 ids is more than a
constrained-choice prompt needs and well under any 8 MiB message."""

MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 128, 256
"""``bad_words`` (vLLM): each word becomes one or two token sequences checked against
every step's history; 128 words of up to 256 characters keep that small."""

TOKEN_ID_MAX = 2**32 - 1
"""Token ids (``logit_bias`` keys, ``allowed_token_ids``) are uint32 on the wire; the
vocabulary bound is checked where it is known (:func:`check_sampling_vocab`)."""


STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
"""What a grammar may constrain output to: any JSON object, a JSON schema (OpenAI's
``json_schema``, vLLM's ``guided_json``), a regular expression, one of some strings, or
a context-free grammar (vLLM's ``guided_grammar``, and the router's tool-call grammars)
in llguidance's Lark dialect, GBNF being converted to it on the worker."""

MAX_STRUCTURED_SPEC_BYTES = 64 * 2**10
"""A schema, pattern or choice list is compiled into a grammar on the worker (once per
distinct spec, then cached); 64 KiB of UTF-8 covers real schemas and bounds that work."""

MAX_CHOICES = 1024
"""``choice`` strings; each is an alternative of the compiled grammar."""


@dataclass(frozen=True)
class StructuredOutput:
    """Output constrained by a grammar (the engine compiles ``spec`` on the worker, where
    the tokenizer is; a spec that does not compile fails the request, naming
    ``structured``). ``spec``: the schema's JSON text (``json_schema``), the pattern
    (``regex``), a JSON list of strings (``choice``), the grammar's text (``grammar``:
    llguidance's Lark dialect, or GBNF), empty (``json_object``).

    ``prior_tokens``: the last this many prompt tokens were generated under this grammar
    already (a request migrated after some output): the engine advances the grammar over
    them before sampling, so the state is re-derived from the tokens alone."""

    kind: str
    spec: str = ""
    prior_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(
                "structured", f"kind must be one of {', '.join(STRUCTURED_KINDS)}, got "
                f"{self.kind!r}")
        if not isinstance(self.spec, str):
            raise InvalidRequestError("structured", f"spec must be a string, got "
                                                    f"{type(self.spec).__name__}")
        size = len(self.spec.encode("utf-8", "surrogatepass"))
        if size > MAX_STRUCTURED_SPEC_BYTES:
            raise InvalidRequestError(
                "structured", f"the {self.kind} spec is {size} bytes; at most "
                f"{MAX_STRUCTURED_SPEC_BYTES} are accepted")
        _check_int("structured.prior_tokens", self.prior_tokens, 0, MAX_TOKENS_LIMIT)
        if self.kind == "json_object":
            if self.spec:
                raise InvalidRequestError("structured", "json_object takes no spec")
        elif self.kind == "regex":
            if not self.spec:
                raise InvalidRequestError("structured", "regex needs a non-empty pattern")
        elif self.kind == "grammar":
            if not self.spec.strip():
                raise InvalidRequestError("structured", "grammar needs a non-empty grammar "
                                                        "(llguidance Lark, or GBNF)")
        else:
            self._check_json()

    def _check_json(self) -> None:
        """Syntax here (the router refuses a malformed spec before any worker sees it);
        whether the schema compiles is the worker's to find out."""
        try:
            value = json.loads(self.spec)
        except (ValueError, RecursionError):
            raise InvalidRequestError(
                "structured", f"the {self.kind} spec is not valid JSON") from None
        if self.kind == "json_schema" and not isinstance(value, dict):
            raise InvalidRequestError("structured", "a JSON schema must be an object")
        if self.kind == "choice":
            if (not isinstance(value, list) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise InvalidRequestError(
                    "structured", "choice must be a non-empty list of non-empty strings")
            if len(value) > MAX_CHOICES:
                raise InvalidRequestError(
                    "structured", f"at most {MAX_CHOICES} choices, got {len(value)}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request (OpenAI / vLLM semantics).

    ``temperature == 0`` (or below :data:`GREEDY_BELOW`) is greedy. ``top_k`` 0 or -1
    disables top-k. Filters apply in the order temperature, top-k, top-p, min-p.
    ``seed`` makes a request's samples independent of whatever else shares its batch.
    ``logprobs=n`` returns the sampled token's log-probability and the ``n`` most likely
    ones (of the raw model distribution).

    Before any filter, the logits are changed in this order: ``repetition_penalty``
    (vLLM: > 0, 1 is off; a logit of a token seen in the prompt or the output is
    divided by it when positive, multiplied when not), ``frequency_penalty`` and
    ``presence_penalty`` (OpenAI: over output tokens only, ``logit -= frequency * count
    + presence * (count > 0)``), ``logit_bias`` (token id -> value added), then only
    ``allowed_token_ids`` may be sampled (when given), and EOS and ``stop_token_ids``
    cannot be sampled, nor end the request (nor can stop strings), before ``min_tokens``
    output tokens.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs sorted by id; a mapping is accepted and converted."""
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] = ()
    """Empty: every token may be sampled."""
    structured: StructuredOutput | None = None
    """None: unconstrained. Else only tokens its grammar allows may be sampled, and the
    request ends (``stop``) when the grammar is complete."""
    bad_words: tuple[str, ...] = ()
    """vLLM's: words never generated. The worker tokenizes each (as written and after
    a space); the last token of such a sequence cannot be sampled when the output so
    far ends with the rest of it (a one-token word: never)."""

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so the object stays hashable/frozen.
        object.__setattr__(self, "stop", _as_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT)
        # ``not x >= 0`` also rejects NaN; inf would make every logit 0 (or NaN).
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise InvalidRequestError(
                "temperature", f"must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:  # rejects NaN
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:  # rejects NaN
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        _check_int("top_k", self.top_k, TOP_K_MIN, TOP_K_MAX)
        if self.seed is not None:
            _check_int("seed", self.seed, SEED_MIN, SEED_MAX)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        self._check_stops()
        self._check_logits_processing()
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequestError("structured", "must be a StructuredOutput")

    def _check_logits_processing(self) -> None:
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        try:
            pairs = tuple(sorted((k, v) for k, v in pairs))
        except (TypeError, ValueError):
            raise InvalidRequestError(
                "logit_bias", "must map token ids to numbers") from None
        object.__setattr__(self, "logit_bias", pairs)
        object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", _as_tuple(self.bad_words))
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidRequestError(
                "bad_words", f"at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS:
                raise InvalidRequestError(
                    "bad_words", f"each bad word is a non-blank string of at most "
                    f"{MAX_BAD_WORD_CHARS} characters, got {str(w)[:40]!r}")
        # Finite and > 0; a tiny penalty may push a logit past float32, which the sampler
        # clamps, so any positive value is safe (vLLM's range).
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise InvalidRequestError(
                "repetition_penalty", f"must be finite and > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not PENALTY_MIN <= v <= PENALTY_MAX:  # rejects NaN
                raise InvalidRequestError(
                    name, f"must be in [{PENALTY_MIN}, {PENALTY_MAX}], got {v}")
        if len(pairs) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                "logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(pairs)}")
        for token, value in pairs:
            _check_int("logit_bias", token, 0, TOKEN_ID_MAX)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not LOGIT_BIAS_MIN <= value <= LOGIT_BIAS_MAX):
                raise InvalidRequestError(
                    "logit_bias", f"each bias must be in [{LOGIT_BIAS_MIN}, "
                    f"{LOGIT_BIAS_MAX}], got {value!r} for token {token}")
        if len(pairs) != len({t for t, _ in pairs}):
            raise InvalidRequestError("logit_bias", "a token id appears twice")
        object.__setattr__(self, "logit_bias", tuple((t, float(v)) for t, v in pairs))
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
            raise InvalidRequestError(
                "allowed_token_ids", f"at most {MAX_ALLOWED_TOKEN_IDS} ids, got "
                f"{len(self.allowed_token_ids)}")
        for t in self.allowed_token_ids:
            _check_int("allowed_token_ids", t, 0, TOKEN_ID_MAX)

    @property
    def penalized(self) -> bool:
        """Whether any penalty applies (the sampler then needs the token history)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler must change this request's logits before sampling."""
        return (self.penalized or bool(self.logit_bias) or bool(self.allowed_token_ids)
                or self.min_tokens > 0 or bool(self.bad_words))

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop", "stop strings must be non-empty strings")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    "stop", f"each stop string is at most {MAX_STOP_STRING_CHARS} "
                    f"characters, got one of {len(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got "
                f"{len(self.stop_token_ids)}")
        bad = next((t for t in self.stop_token_ids if not 0 <= t <= STOP_TOKEN_ID_MAX), None)
        if bad is not None:
            raise InvalidRequestError(
                "stop_token_ids", f"each id must be in [0, {STOP_TOKEN_ID_MAX}], got {bad}")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows to inf and softmax gives NaN.
        return self.temperature < GREEDY_BELOW


def _as_tuple(stop: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _check_int(field_name: str, value: object, low: int, high: int) -> None:
    """An integer (never a bool or a float) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(
            field_name, f"must be an integer >= {low} and <= {high}, got {value!r}")
    if not low <= value <= high:
        raise InvalidRequestError(field_name, f"must be >= {low} and <= {high}, got {value}")


def check_sampling_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Token ids in ``logit_bias`` and ``allowed_token_ids`` must be in the vocabulary;
    checked where it is known (the router, the engine). Raises
    :class:`InvalidRequestError` naming the field and the limit."""
    check_in_vocab("logit_bias", [t for t, _ in params.logit_bias], vocab_size)
    check_in_vocab("allowed_token_ids", params.allowed_token_ids, vocab_size)


def check_in_vocab(field_name: str, token_ids: Iterable[int], vocab_size: int) -> None:
    """Every id in ``[0, vocab_size)``, else :class:`InvalidRequestError` naming
    ``field_name``, the first id outside and the limit."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            field_name, f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_prompt(token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """The limits every prompt must meet, checked by the router and again by the engine.

    Raises :class:`InvalidRequestError` naming the field and the limit.
    """
    if not token_ids:
        raise InvalidRequestError("prompt", "must contain at least 1 token, got 0")
    if len(token_ids) >= max_model_len:
        raise InvalidRequestError(
            "prompt",
            f"{len(token_ids)} tokens leave no room to generate: the limit is "
            f"{max_model_len - 1} prompt tokens (max_model_len {max_model_len})",
        )
    check_in_vocab("prompt_token_ids", token_ids, vocab_size)
