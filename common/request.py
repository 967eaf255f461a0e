"""One generation request, typed, from the router's edge to the engine.

Lifecycle. The router's edge (gRPC ``Generate`` or the OpenAI HTTP front, both ending in
``Router.validate``) checks the public request once and builds a :class:`Request`: the
prompt as token ids (tokenized, chat template applied), validated
:class:`~common.sampling.SamplingParams` and the cache salt. From there it is carried
typed: the router derives each worker call's request from it (a fresh id per call;
:meth:`Request.continued` after a migration), :mod:`common.wire` turns it into the
internal ``WorkerGenerateRequest`` and back on the worker, and the worker hands the same
object to its engine loop. Nothing on the way rebuilds the parameters by hand.

A worker rebuilding it from the wire re-runs the constructors' checks: the internal API
is a process boundary, and a request that would break the engine step must be refused
there too (it costs microseconds). There is no other validation of these values.

Bounds (besides :class:`~common.sampling.SamplingParams`'): ``cache_salt`` is at most
:data:`MAX_CACHE_SALT_BYTES` of UTF-8 and ``request_id`` at most
:data:`MAX_REQUEST_ID_CHARS` characters. The prompt's length and token ids are bounded by
the model (``check_prompt``), which this type does not know.

Bottom layer: plain data, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from .sampling import MAX_LOGPROBS, SEED_MAX, SEED_MIN, InvalidRequestError, SamplingParams

MAX_CACHE_SALT_BYTES = 256
"""A salt names a tenant (an id, or a 32-byte key as hex or base64: 44-64 bytes); it
enters the first block's hash, on the router and every worker. 256 bytes of UTF-8 is
room for any such name; more would only be a way to make every hash costly."""

MAX_REQUEST_ID_CHARS = 512
"""Request ids key the engine's tables and name threads and log lines. Clients may send
their own; the router derives each worker call's id by appending a suffix (under 64
characters), so its edge should hold a client's id to :data:`MAX_CLIENT_REQUEST_ID_CHARS`
for the derived ids to stay under this."""

MAX_CLIENT_REQUEST_ID_CHARS = MAX_REQUEST_ID_CHARS - 64

MAX_CHOICES = 16
"""Most choices (``n``) one request may ask for. Each choice is a sequence of its own
on the decode worker (its own blocks past the shared prompt, its own step rows), so
``n`` multiplies a request's cost; OpenAI's own limit is 128, vLLM has none."""


def check_cache_salt(cache_salt: str | None) -> None:
    """Raises :class:`InvalidRequestError` unless ``cache_salt`` is None or a string of at
    most :data:`MAX_CACHE_SALT_BYTES` bytes of UTF-8 (lone surrogates do not encode)."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str):
        raise InvalidRequestError("cache_salt", f"must be a string, got {type(cache_salt)}")
    if len(cache_salt) > MAX_CACHE_SALT_BYTES:  # cheap, before encoding a huge string
        raise InvalidRequestError("cache_salt", f"must be at most {MAX_CACHE_SALT_BYTES} "
                                  f"bytes of UTF-8, got {len(cache_salt)} characters")
    size = len(_check_utf8("cache_salt", cache_salt))
    if size > MAX_CACHE_SALT_BYTES:
        raise InvalidRequestError("cache_salt", f"must be at most {MAX_CACHE_SALT_BYTES} "
                                  f"bytes of UTF-8, got {size}")


def _check_utf8(field_name: str, text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(field_name, f"must be valid Unicode text: {e.reason} at "
                                  f"character {e.start}") from e


@dataclass(frozen=True)
class Request:
    """What an engine needs to run one request; frozen, checked at construction."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str | None = None
    """Prefix-cache namespace; None (or "") shares blocks with every unsalted request."""
    n: int = 1
    """Choices: the prompt is computed (and its KV moved) once, then each choice samples
    on its own, in blocks that share the prompt's (:meth:`choice_sampling`)."""
    prompt_logprobs: int | None = None
    """Log-probabilities of the prompt's tokens (each given those before it) with this
    many alternatives; the worker that computes the prompt computes them, and reuses no
    cached prefix for it (a cached block has no logits)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids",
                           tuple(int(t) for t in self.prompt_token_ids))
        object.__setattr__(self, "cache_salt", self.cache_salt or None)
        if not self.request_id or not isinstance(self.request_id, str):
            raise InvalidRequestError("request_id", "must be a non-empty string")
        if len(self.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} "
                                      f"characters, got {len(self.request_id)}")
        _check_utf8("request_id", self.request_id)  # it names the KV transfer (hashed)
        check_cache_salt(self.cache_salt)
        if (isinstance(self.n, bool) or not isinstance(self.n, int)
                or not 1 <= self.n <= MAX_CHOICES):
            raise InvalidRequestError("n", f"must be an integer from 1 to {MAX_CHOICES}, got "
                                      f"{self.n!r}")
        k = self.prompt_logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)
                              or not 0 <= k <= MAX_LOGPROBS):
            raise InvalidRequestError("prompt_logprobs", f"must be an integer from 0 to "
                                      f"{MAX_LOGPROBS}, got {k!r}")

    def choice_sampling(self, index: int) -> SamplingParams:
        """The sampling of choice ``index``: a seeded request's choice i draws with seed
        + i (as vLLM), so the choices differ and each is reproducible on its own."""
        return choice_sampling(self.sampling, index)

    def choice(self, index: int, request_id: str) -> Request:
        """Choice ``index`` as a request of its own (n = 1): how a choice moves after
        its worker failed (:meth:`continued` then applies)."""
        return Request(request_id, self.prompt_token_ids, self.choice_sampling(index),
                       self.cache_salt)

    def continued(self, generated: Sequence[int], request_id: str) -> Request:
        """This request resumed elsewhere after ``generated`` tokens (a migration): they
        continue the prompt and come off ``max_tokens`` (and ``min_tokens``). Greedy output
        is unchanged."""
        if not generated:
            return replace(self, request_id=request_id)
        if self.n != 1:
            raise ValueError("a request of several choices continues one choice at a time "
                             "(Request.choice)")
        if len(generated) >= self.sampling.max_tokens:
            raise ValueError(f"request {self.request_id} already has its {len(generated)} "
                             f"tokens (max_tokens {self.sampling.max_tokens})")
        sampling = replace(self.sampling, max_tokens=self.sampling.max_tokens - len(generated),
                           min_tokens=max(0, self.sampling.min_tokens - len(generated)))
        structured = self.sampling.structured
        if structured is not None:  # the next worker re-derives the grammar's state
            sampling = replace(sampling, structured=replace(
                structured, prior_tokens=structured.prior_tokens + len(generated)))
        return Request(request_id, self.prompt_token_ids + tuple(generated), sampling,
                       self.cache_salt, self.n)  # prompt log-probabilities came already


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """``sampling`` for choice ``index`` of a request (see :meth:`Request.choice_sampling`)."""
    if index == 0 or sampling.seed is None:
        return sampling
    seed = sampling.seed + index
    if seed > SEED_MAX:  # wraps within int64, like the seed itself on the wire
        seed -= SEED_MAX - SEED_MIN + 1
    return replace(sampling, seed=seed)
