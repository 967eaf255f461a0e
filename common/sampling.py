"""Request sampling parameters: one validated type for the router and every worker.

Everything is checked once, at construction, and never mutated afterwards. A bad value
raises :class:`InvalidRequestError` naming the field, the value and the limit, so servers
hand it to clients as ``INVALID_ARGUMENT`` (HTTP 400) unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass


class InvalidRequestError(ValueError):
    """A request the engine refuses; ``field`` names the offending parameter."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


GREEDY_BELOW = 1e-5
"""Temperatures under this are greedy (as in vLLM), never a division that overflows."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request (OpenAI / vLLM semantics).

    ``temperature == 0`` (or below :data:`GREEDY_BELOW`) is greedy. ``top_k <= 0``
    disables top-k. Filters apply in the order temperature, top-k, top-p, min-p.
    ``seed`` makes a request's samples independent of whatever else shares its batch.
    ``logprobs=n`` returns the sampled token's log-probability and the ``n`` most likely
    ones (of the raw model distribution).
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

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so the object stays hashable/frozen.
        object.__setattr__(self, "stop", _as_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows to inf and softmax gives NaN.
        return self.temperature < GREEDY_BELOW


def _as_tuple(stop: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop)


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
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            "prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})"
        )
