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

Bottom layer: plain data, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from .sampling import InvalidRequestError, SamplingParams


@dataclass(frozen=True)
class Request:
    """What an engine needs to run one request; frozen, checked at construction."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str | None = None
    """Prefix-cache namespace; None (or "") shares blocks with every unsalted request."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids",
                           tuple(int(t) for t in self.prompt_token_ids))
        object.__setattr__(self, "cache_salt", self.cache_salt or None)
        if not self.request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")

    def continued(self, generated: Sequence[int], request_id: str) -> Request:
        """This request resumed elsewhere after ``generated`` tokens (a migration): they
        continue the prompt and come off ``max_tokens``. Greedy output is unchanged."""
        if not generated:
            return replace(self, request_id=request_id)
        if len(generated) >= self.sampling.max_tokens:
            raise ValueError(f"request {self.request_id} already has its {len(generated)} "
                             f"tokens (max_tokens {self.sampling.max_tokens})")
        return Request(request_id, self.prompt_token_ids + tuple(generated),
                       replace(self.sampling, max_tokens=self.sampling.max_tokens
                               - len(generated)), self.cache_salt)
