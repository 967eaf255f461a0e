"""Per-tenant admission limits: concurrent requests and tokens per minute.

A request's life here (the router calls :meth:`TenantLimiter.admit` after validation,
before any worker is asked, and settles the lease however the request ends):

1. **admit**, before the router does any work on the request (tokenizing included):
   refused with RESOURCE_EXHAUSTED (:class:`RateLimited`, carrying a ``retry_after_s``)
   when the tenant already has ``max_concurrency`` requests in flight (retry after 1 s:
   there is no telling when one ends).
2. **reserve**, once the prompt is tokenized: refused the same way when the tenant's
   token bucket holds fewer tokens than the request *reserves*: ``prompt + max_tokens``
   (the most it can cost; the router caps ``max_tokens`` at what the context leaves).
   The reservation comes off the bucket at once, so a burst of concurrent requests
   cannot overdraw it by racing.
3. **settle**: at the end (finished, failed, cancelled), the lease gives back the part
   of the reservation the request did not use: ``reserved - (prompt + tokens generated)``.
   What is charged is what was processed, never more than was reserved.

The bucket holds at most ``tokens_per_minute`` tokens and refills at
``tokens_per_minute / 60`` per second (a token bucket: bursts up to a minute's budget,
a sustained rate of the budget per minute). A request reserving more than a whole
minute's budget is admitted when the bucket is full and drives it negative (it must be
able to run at all); the debt refills like any other. ``Retry-After`` is the time until
the bucket holds what the request needs, rounded up to whole seconds.

0 means unlimited, for either limit. Limits come from the router's defaults
(``--tenant-max-concurrency``, ``--tenant-tokens-per-minute``) unless the tenant's key
line overrides them (:mod:`router.auth`); a changed limit applies from the next
request. The clock is injected, so the logic is tested without sleeping. Everything
runs on the router's event loop; nothing here is thread-safe.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from .errors import RouterError

CONCURRENCY_RETRY_AFTER_S = 1
"""What a request refused for concurrency is told: there is no telling when one of the
tenant's requests ends, and a second is a polite pace for a retry loop."""


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits; 0 means unlimited."""

    max_concurrency: int = 0
    tokens_per_minute: int = 0

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "tokens_per_minute"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0: unlimited), "
                                 f"got {value!r}")


class RateLimited(RouterError):
    """A tenant over its limit: RESOURCE_EXHAUSTED with a retry-after."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message,
                         retry_after_s=max(1, retry_after_s))


@dataclass
class _Tenant:
    in_flight: int = 0
    tokens: float = 0.0  # the bucket's level; negative after an oversized request
    stamp: float = 0.0   # when ``tokens`` was last brought up to date
    full: bool = True    # the bucket has not been used since it was created


class Lease:
    """One admitted request's hold on its tenant's limits; :meth:`settle` exactly once
    (later calls do nothing)."""

    def __init__(self, limiter: TenantLimiter, tenant: str, limits: TenantLimits) -> None:
        self._limiter, self.tenant, self.limits = limiter, tenant, limits
        self.reserved = 0
        self._settled = False

    def reserve(self, tokens: int) -> None:
        """Take ``tokens`` from the tenant's bucket or raise :class:`RateLimited` (the
        lease then still holds its place: settle it)."""
        self._limiter._reserve(self.tenant, self.limits, tokens)
        self.reserved += tokens

    def settle(self, used_tokens: int) -> None:
        """The request ended having processed ``used_tokens`` (prompt + generated)."""
        if self._settled:
            return
        self._settled = True
        self._limiter._release(self.tenant, self.reserved, used_tokens)


class TenantLimiter:
    """The limits of every tenant (see the module docstring)."""

    def __init__(self, defaults: TenantLimits = TenantLimits(), *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.defaults = defaults
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}
        self._limits: dict[str, TenantLimits] = {}

    def in_flight(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return state.in_flight if state else 0

    def available_tokens(self, tenant: str) -> float:
        """The tenant's bucket now (for tests and status); inf when unlimited."""
        limits = self._limits.get(tenant, self.defaults)
        if not limits.tokens_per_minute:
            return math.inf
        return self._refill(self._state(tenant), limits.tokens_per_minute)

    def admit(self, tenant: str, limits: TenantLimits | None,
              reserve_tokens: int = 0) -> Lease:
        """Admit a request (and reserve ``reserve_tokens``, see :meth:`Lease.reserve`) or
        raise :class:`RateLimited`. ``limits`` None: the defaults. Mutates the tenant's
        state; never blocks."""
        limits = limits or self.defaults
        self._limits[tenant] = limits
        state = self._state(tenant)
        if limits.max_concurrency and state.in_flight >= limits.max_concurrency:
            raise RateLimited(f"{_who(tenant)} has {state.in_flight} requests in flight, its "
                              f"limit (max_concurrency={limits.max_concurrency}); retry when "
                              "one has finished", CONCURRENCY_RETRY_AFTER_S)
        state.in_flight += 1
        lease = Lease(self, tenant, limits)
        if reserve_tokens:
            try:
                lease.reserve(reserve_tokens)
            except RateLimited:
                lease.settle(0)
                raise
        return lease

    def _reserve(self, tenant: str, limits: TenantLimits, tokens: int) -> None:
        tpm = limits.tokens_per_minute
        if not tpm:
            return
        state = self._state(tenant)
        level = self._refill(state, tpm)
        need = min(tokens, tpm)
        if level < need:
            wait_s = (need - level) * 60.0 / tpm
            raise RateLimited(
                f"{_who(tenant)} is over its limit of {tpm} tokens per minute: this request "
                f"reserves {tokens} tokens (prompt + max_tokens) and {max(0, int(level))} "
                f"are available; retry in {math.ceil(wait_s)} s or ask for fewer max_tokens",
                math.ceil(wait_s))
        state.tokens = level - tokens

    def _state(self, tenant: str) -> _Tenant:
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant(stamp=self._clock())
        return state

    def _refill(self, state: _Tenant, tpm: int) -> float:
        now = self._clock()
        if state.full:
            state.tokens, state.full = float(tpm), False
        else:
            state.tokens = min(float(tpm), state.tokens + (now - state.stamp) * tpm / 60.0)
        state.stamp = now
        return state.tokens

    def _release(self, tenant: str, reserved: int, used: int) -> None:
        state = self._tenants[tenant]
        state.in_flight -= 1
        tpm = self._limits.get(tenant, self.defaults).tokens_per_minute
        if tpm and reserved and not state.full:
            level = self._refill(state, tpm)
            state.tokens = min(float(tpm), level + reserved - min(used, reserved))


def _who(tenant: str) -> str:
    return f"tenant {tenant!r}" if tenant else "this router's clients"
