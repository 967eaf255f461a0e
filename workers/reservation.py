"""The decode side of a disaggregated request: its reservation, as a state machine.

One :class:`ReservationMachine` per ``EngineLoop.reserve``, driven on the engine thread
(so it takes no lock). The engine loop holds the blocks, the transfer handle and the
timers; this module decides, and knows no torch, gRPC or engine::

    QUEUED ──place──▶ AWAITING ──commit──────────▶ COMMITTED ──transfer_ended─┐
                         │  └──transfer_ended──▶ TRANSFERRED ──commit──────────┴▶ RUNNING
                         │                                                      or RECOMPUTING
                         └──abort──▶ CANCELLING ──transfer_ended──▶ ABORTED

The whole table (:data:`TRANSITIONS`), state: event ▶ next state::

    QUEUED       place ▶ AWAITING, local ▶ LOCAL, reject ▶ REJECTED, abort ▶ ABORTED
    AWAITING     commit ▶ COMMITTED, transfer_ended ▶ TRANSFERRED, abort ▶ CANCELLING
    COMMITTED    transfer_ended ▶ RUNNING | RECOMPUTING, abort ▶ CANCELLING
    TRANSFERRED  commit ▶ RUNNING | RECOMPUTING, abort ▶ ABORTED
    CANCELLING   transfer_ended ▶ ABORTED, commit ▶ CANCELLING (the abort won)

QUEUED waits, in arrival order, for room in the KV pool; it holds nothing. Leaving it,
the loop has either reserved blocks for the whole prompt and registered them with the
KV receiver (``place``), or prefills here from the start (``local``: the uncached part
is short, or the receiver is gone), or the request was invalid (``reject``).

From AWAITING two events meet, in either order: the transfer ending (``transfer_ended``,
landed or not) and the router's ``commit`` (the first token the prefill worker sampled,
or None when the prefill failed). Both present, the request *settles*: a landed
transfer and a first token go into the running batch (RUNNING); anything else computes
the prompt here (RECOMPUTING), after the first token when there is one.

Blocks a transfer may still write into are never freed before it is terminal: an
``abort`` (the caller went away, the worker fails everything) while the transfer runs
asks it to stop and waits in CANCELLING for its end. A commit with a first token while
no offer has come arms the offer timeout (the prefill worker died after sampling); the
loop's timer then cancels the transfer while still PENDING, which ends it, and the
request recomputes. A commit of None cancels the transfer at once.

RUNNING, RECOMPUTING, LOCAL, REJECTED and ABORTED are terminal here: the request is an
ordinary stream of the engine from then on (or gone), and no event reaches the machine.
An event its state does not take is a bug in the caller: :class:`IllegalTransition`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ReservationState(enum.Enum):
    QUEUED = "queued"
    """Waiting for room in the KV pool; holds nothing."""
    AWAITING = "awaiting"
    """Blocks reserved and expected by the receiver; no transfer end, no commit yet."""
    COMMITTED = "committed"
    """The router committed (``first_token``, maybe None); the transfer still runs."""
    TRANSFERRED = "transferred"
    """The transfer ended (``transfer_ok`` says how); no commit yet."""
    CANCELLING = "cancelling"
    """Aborted while the transfer may still write: freed once it ends."""
    RUNNING = "running"
    """Settled: the KV landed and the first token came; in the running batch."""
    RECOMPUTING = "recomputing"
    """Settled: the KV will not be used; the prompt is computed here."""
    LOCAL = "local"
    """Prefilled here from the start (conditional disaggregation, or no receiver)."""
    REJECTED = "rejected"
    """Invalid request; nothing was ever held."""
    ABORTED = "aborted"
    """Gone; its blocks are freed (no transfer can write into them any more)."""

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


class ReservationEvent(enum.Enum):
    PLACE = "place"
    LOCAL = "local"
    REJECT = "reject"
    COMMIT = "commit"
    TRANSFER_ENDED = "transfer_ended"
    ABORT = "abort"


_S, _E = ReservationState, ReservationEvent

_TERMINAL = frozenset({_S.RUNNING, _S.RECOMPUTING, _S.LOCAL, _S.REJECTED, _S.ABORTED})

TRANSITIONS: dict[tuple[ReservationState, ReservationEvent], frozenset[ReservationState]] = {
    (_S.QUEUED, _E.PLACE): frozenset({_S.AWAITING}),
    (_S.QUEUED, _E.LOCAL): frozenset({_S.LOCAL}),
    (_S.QUEUED, _E.REJECT): frozenset({_S.REJECTED}),
    (_S.QUEUED, _E.ABORT): frozenset({_S.ABORTED}),
    (_S.AWAITING, _E.COMMIT): frozenset({_S.COMMITTED}),
    (_S.AWAITING, _E.TRANSFER_ENDED): frozenset({_S.TRANSFERRED}),
    (_S.AWAITING, _E.ABORT): frozenset({_S.CANCELLING}),
    (_S.COMMITTED, _E.TRANSFER_ENDED): frozenset({_S.RUNNING, _S.RECOMPUTING}),
    (_S.COMMITTED, _E.ABORT): frozenset({_S.CANCELLING}),
    (_S.TRANSFERRED, _E.COMMIT): frozenset({_S.RUNNING, _S.RECOMPUTING}),
    (_S.TRANSFERRED, _E.ABORT): frozenset({_S.ABORTED}),
    (_S.CANCELLING, _E.TRANSFER_ENDED): frozenset({_S.ABORTED}),
    (_S.CANCELLING, _E.COMMIT): frozenset({_S.CANCELLING}),  # the abort won; changes nothing
}
"""(state, event) -> the states that event may lead to; a pair not here is illegal."""

PREFILL_FAILED = "the prefill failed; computing here instead"


class IllegalTransition(AssertionError):
    """An event the reservation's state does not take: a bug in whoever drives it."""


@dataclass(frozen=True)
class Reservation:
    """Decode side's answer to a reserve: prefill here (``local``), or send the KV of
    the prompt's blocks from ``skip_blocks`` on into ``block_ids`` at ``kv_address``."""

    local: bool
    cached_tokens: int
    kv_address: str = ""
    skip_blocks: int = 0
    block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Actions:
    """What the engine loop must do after an event, besides reading the new state."""

    cancel_transfer: str | None = None
    """Ask the transfer to stop, for this reason (it ends, then ``transfer_ended``)."""
    arm_offer_timeout: bool = False
    """Committed before any offer came: cancel the transfer if it is still PENDING
    after the offer timeout."""
    settle: bool = False
    """The transfer's part is over: disarm the timer, keep blocks that are not quiesced
    away from the pool, then commit (RUNNING), recompute (RECOMPUTING) or free
    (ABORTED) the request."""


class ReservationMachine:
    """One reservation's state. Not thread-safe: the engine thread alone drives it."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.state = ReservationState.QUEUED
        self.first_token: int | None = None
        """The router's commit: the prefill worker's first token (None: none came)."""
        self.transfer_ok = False
        """Whether the transfer ended with the KV landed (DONE)."""

    def __repr__(self) -> str:
        return f"ReservationMachine({self.request_id!r}, {self.state.value})"

    # -- leaving QUEUED ------------------------------------------------------------------

    def place(self) -> None:
        """Blocks are reserved and the receiver expects the KV."""
        self._move(_E.PLACE, _S.AWAITING)

    def go_local(self) -> None:
        """Blocks are reserved and the prompt is computed here from the start."""
        self._move(_E.LOCAL, _S.LOCAL)

    def reject(self) -> None:
        """The request is invalid; nothing was reserved."""
        self._move(_E.REJECT, _S.REJECTED)

    # -- the two events that meet, and abort -----------------------------------------------

    def commit(self, first_token: int | None) -> Actions:
        """The router's commit: the first token, or None when the prefill failed."""
        self._check(_E.COMMIT)
        if self.state is _S.CANCELLING:
            self._move(_E.COMMIT, _S.CANCELLING)
            return Actions()
        self.first_token = first_token
        if self.state is _S.TRANSFERRED:
            return self._settle(_E.COMMIT)
        self._move(_E.COMMIT, _S.COMMITTED)
        if first_token is None:
            return Actions(cancel_transfer=PREFILL_FAILED)
        return Actions(arm_offer_timeout=True)

    def transfer_ended(self, ok: bool) -> Actions:
        """The transfer is terminal: ``ok`` when the KV landed (DONE)."""
        self._check(_E.TRANSFER_ENDED)
        self.transfer_ok = ok
        if self.state is _S.AWAITING:
            self._move(_E.TRANSFER_ENDED, _S.TRANSFERRED)
            return Actions()
        if self.state is _S.CANCELLING:
            self._move(_E.TRANSFER_ENDED, _S.ABORTED)
            return Actions(settle=True)
        return self._settle(_E.TRANSFER_ENDED)

    def abort(self, reason: str) -> Actions:
        """The request goes away: freed now, or once the transfer ended."""
        self._check(_E.ABORT)
        if self.state is _S.QUEUED:
            self._move(_E.ABORT, _S.ABORTED)
            return Actions()
        if self.state is _S.TRANSFERRED:
            self._move(_E.ABORT, _S.ABORTED)
            return Actions(settle=True)
        self._move(_E.ABORT, _S.CANCELLING)
        return Actions(cancel_transfer=reason)

    # -- the table -----------------------------------------------------------------------

    def _settle(self, event: ReservationEvent) -> Actions:
        landed = self.transfer_ok and self.first_token is not None
        self._move(event, _S.RUNNING if landed else _S.RECOMPUTING)
        return Actions(settle=True)

    def _check(self, event: ReservationEvent) -> None:
        if (self.state, event) not in TRANSITIONS:
            raise IllegalTransition(f"reservation {self.request_id!r}: {event.value} is not "
                                    f"taken in state {self.state.value}")

    def _move(self, event: ReservationEvent, new: ReservationState) -> None:
        self._check(event)
        if new not in TRANSITIONS[self.state, event]:
            raise IllegalTransition(f"reservation {self.request_id!r}: {event.value} cannot "
                                    f"lead from {self.state.value} to {new.value}")
        self.state = new
