"""The transfer state machine, its handle, and the per-state counters a metrics wrapper reads.

Every transfer, on either end, moves through::

    PENDING ──▶ SENDING (sender: the receiver accepted the offer, payload on the wire)
       │    └─▶ RECEIVING (receiver: offer matched and accepted, payload landing)
       │              │
       └──────────────┴──▶ DONE | FAILED(reason) | TIMED_OUT(reason) | CANCELLED(reason)

PENDING is left by acceptance, refusal, cancellation or its deadline; SENDING and
RECEIVING by the last payload message or by a transport error or timeout (each payload
wait is bounded), RECEIVING also by cancellation while staged. The four terminal states
are left by the caller releasing the handle and freeing the blocks it holds: DONE means
the blocks are valid, the others mean they are not (retry on another pair or recompute,
never decode from them). CANCELLED is the owner's own decision (the request went away),
kept apart so that FAILED and TIMED_OUT count only real faults in metrics.

The first terminal transition wins; later attempts (a timeout racing a completion) are
no-ops that report False. Like SGLang's ``KVPoll``, :meth:`TransferHandle.poll` never
blocks, so an engine loop can poll every step.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


class TransferState(enum.Enum):
    PENDING = "pending"
    SENDING = "sending"
    RECEIVING = "receiving"
    DONE = "done"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({TransferState.DONE, TransferState.FAILED, TransferState.TIMED_OUT,
                       TransferState.CANCELLED})
_ALLOWED: dict[TransferState, frozenset[TransferState]] = {
    TransferState.PENDING: frozenset({TransferState.SENDING, TransferState.RECEIVING,
                                      TransferState.FAILED, TransferState.TIMED_OUT,
                                      TransferState.CANCELLED}),
    TransferState.SENDING: frozenset(_TERMINAL),
    TransferState.RECEIVING: frozenset(_TERMINAL),
}


@dataclass(frozen=True)
class ChannelStats:
    """A snapshot of one endpoint's counters. ``entered`` counts transitions into each
    state since start; ``current`` how many transfers are in each state now (terminal
    states count as soon as they are entered and never leave)."""

    entered: dict[str, int]
    current: dict[str, int]
    bytes_moved: int
    pairs_open: int
    busy_s: float = 0.0
    """Sum over done transfers of KV ready -> landed (the sender measures it)."""
    refused: dict[str, int] = field(default_factory=dict)
    """Control messages not acted on, by why: ``bad_mac``, ``stale``, ``replay``,
    ``unauthenticated``, ``pairs_full``, ``parked_full``, ... (see the receiver)."""
    checksum_failures: int = 0
    """Payloads that landed whole but whose checksum did not match the offer's (each
    also counts as a FAILED transfer; the receiver's end only)."""

    @property
    def in_flight(self) -> int:
        return sum(self.current[s.value] for s in TransferState if not s.terminal)


class StateCounters:
    """Thread-safe counters per state; one per endpoint (sender or receiver)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entered = dict.fromkeys(TransferState, 0)
        self._current = dict.fromkeys(TransferState, 0)
        self._bytes = 0
        self._busy = 0.0
        self._refused: dict[str, int] = {}
        self._checksum_failures = 0

    def record(self, old: TransferState | None, new: TransferState) -> None:
        with self._lock:
            if old is not None:
                self._current[old] -= 1
            self._current[new] += 1
            self._entered[new] += 1

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self._bytes += n

    def add_busy(self, seconds: float) -> None:
        with self._lock:
            self._busy += seconds

    def refuse(self, why: str) -> None:
        with self._lock:
            self._refused[why] = self._refused.get(why, 0) + 1

    def checksum_failure(self) -> None:
        with self._lock:
            self._checksum_failures += 1

    def snapshot(self, pairs_open: int) -> ChannelStats:
        with self._lock:
            return ChannelStats({s.value: n for s, n in self._entered.items()},
                                {s.value: n for s, n in self._current.items()},
                                self._bytes, pairs_open, self._busy, dict(self._refused),
                                self._checksum_failures)


@dataclass(frozen=True)
class TransferResult:
    """The outcome of one transfer, handed to callers instead of the handle's insides."""

    request_id: str
    state: TransferState
    reason: str | None
    nbytes: int
    seconds: float

    @property
    def ok(self) -> bool:
        return self.state is TransferState.DONE

    @property
    def fault(self) -> bool:
        """Ended by a fault (FAILED, TIMED_OUT), not done nor the owner's own cancel."""
        return self.state in (TransferState.FAILED, TransferState.TIMED_OUT)


class TransferHandle:
    """One transfer on one end. Safe to poll, wait on and cancel from any thread.

    The channel's threads advance it; callers read it. ``cancel`` is honoured while
    PENDING on both ends and while RECEIVING on the receiver (the rest of the payload is
    drained into channel-owned buffers, never into the destination); a sender's payload,
    once accepted, runs to its end under the per-message timeout.

    *Quiesced* is later than terminal when a transfer failed with payload messages still
    posted: gloo cannot take back a posted send or receive, so such a message may still
    read the source blocks or write the destination until it resolves (arrives, or its
    connection dies). Memory under a transfer goes back to its pool on
    ``add_quiesced_callback``, never on terminal alone.
    """

    def __init__(self, request_id: str, counters: StateCounters,
                 cancellable: frozenset[TransferState] = frozenset({TransferState.PENDING})):
        self.request_id = request_id
        self._counters = counters
        self._cancellable = cancellable
        self._cond = threading.Condition(threading.RLock())
        self._state = TransferState.PENDING
        self._reason: str | None = None
        self._nbytes = 0
        self._started = time.monotonic()
        self._seconds = 0.0
        self._callbacks: list[Callable[[TransferResult], None]] = []
        self._lingering = 0
        self._quiesce_callbacks: list[Callable[[], None]] = []
        counters.record(None, TransferState.PENDING)

    @property
    def state(self) -> TransferState:
        return self._state

    def poll(self) -> TransferState:
        """The current state. Never blocks."""
        return self._state

    def result(self) -> TransferResult:
        """The outcome so far (final once ``state.terminal``)."""
        with self._cond:
            seconds = self._seconds if self._state.terminal else (
                time.monotonic() - self._started)
            return TransferResult(self.request_id, self._state, self._reason, self._nbytes,
                                  seconds)

    def wait(self, timeout: float) -> TransferResult:
        """Block until terminal or ``timeout`` seconds pass; raise TimeoutError then.

        The timeout only bounds this wait; the transfer keeps its own deadlines.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._state.terminal:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"transfer of {self.request_id!r} still "
                                       f"{self._state.value} after {timeout:.3g}s")
                self._cond.wait(left)
            return self.result()

    def cancel(self, reason: str = "cancelled by caller") -> bool:
        """Move to CANCELLED if the current state allows it. Once this returns True the
        channel never writes into this transfer's destination again."""
        with self._cond:
            if self._state not in self._cancellable:
                return False
            return self.advance(TransferState.CANCELLED, reason)

    def cancel_pending(self, reason: str = "cancelled by caller") -> bool:
        """Like ``cancel``, but only while nothing has been accepted yet (PENDING)."""
        with self._cond:
            if self._state is not TransferState.PENDING:
                return False
            return self.cancel(reason)

    def add_done_callback(self, fn: Callable[[TransferResult], None]) -> None:
        """Call ``fn(result)`` once terminal, from the thread that ended the transfer (or
        now, if it already ended). Keep it short and non-blocking."""
        with self._cond:
            if not self._state.terminal:
                self._callbacks.append(fn)
                return
        fn(self.result())

    # --- used by the channel -------------------------------------------------------

    def seal(self) -> bool:
        """Refuse any later ``cancel``: the sender calls this just before posting its
        offer, after which the receiver may accept at any moment and the payload must
        follow. False when the transfer already ended."""
        with self._cond:
            if self._state.terminal:
                return False
            self._cancellable = frozenset()
            return True

    def advance(self, new: TransferState, reason: str | None = None, nbytes: int = 0) -> bool:
        """Move to ``new``. False when already terminal (another path won the race);
        raises on a transition the machine does not have (a bug)."""
        with self._cond:
            if self._state.terminal:
                return False
            callbacks = self._move(new, reason, nbytes)
        self._ended(callbacks)
        return True

    def abandon(self, reason: str, hold: bool = True) -> Callable[[], None] | None:
        """End the transfer now (FAILED), from outside the thread that moves its payload (its pair
        closed under it: that thread may wait on a posted message for a long while yet,
        and the request must not). Terminal at once; with ``hold``, quiesced only once
        the returned ``settle`` is called, by that thread when it is done with the
        memory. Nothing is held where nothing can write any more: without ``hold`` (the
        caller knows), or where ``cancel`` would be honoured now (a staged receive writes
        under :meth:`writing`, a pending one has posted nothing). None when the transfer
        had already ended (nothing to settle)."""
        with self._cond:
            if self._state.terminal:
                return None
            held = hold and self._state not in self._cancellable
            settle = self._linger_locked() if held else (lambda: None)
            callbacks = self._move(TransferState.FAILED, reason, 0)
        self._ended(callbacks)
        return settle

    def _move(self, new: TransferState, reason: str | None, nbytes: int
              ) -> list[Callable[[TransferResult], None]] | None:
        """The transition, under ``_cond``; the done callbacks to run once terminal."""
        old = self._state
        if new not in _ALLOWED[old]:
            raise AssertionError(f"illegal transfer transition {old.value} -> {new.value}")
        self._state, self._reason = new, reason
        self._nbytes += nbytes
        self._counters.record(old, new)
        if not new.terminal:
            return None
        self._seconds = time.monotonic() - self._started
        callbacks, self._callbacks = self._callbacks, []
        self._cond.notify_all()
        return callbacks

    def _ended(self, callbacks: list[Callable[[TransferResult], None]] | None) -> None:
        """After a terminal move, outside the lock: tell the callers, maybe quiesce. A
        callback that raises is logged: the others and the quiescence still happen."""
        if callbacks is None:
            return
        result = self.result()
        for fn in callbacks:
            try:
                fn(result)
            except Exception:  # noqa: BLE001 - one caller's bug must not strand the memory
                log.exception("transfer %r: a done callback failed", self.request_id)
        self._maybe_quiesce()

    @property
    def quiesced(self) -> bool:
        """Terminal, and no posted payload message can touch the memory any more."""
        with self._cond:
            return self._state.terminal and self._lingering == 0

    def add_quiesced_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once quiesced (now, if it is), from the thread that got there."""
        with self._cond:
            if not (self._state.terminal and self._lingering == 0):
                self._quiesce_callbacks.append(fn)
                return
        fn()

    def linger(self) -> Callable[[], None]:
        """Used by the channel before ending a transfer whose posted messages have not
        resolved: returns ``settle``, to call once they all have."""
        with self._cond:
            return self._linger_locked()

    def _linger_locked(self) -> Callable[[], None]:
        self._lingering += 1
        done = [False]

        def settle() -> None:  # once; a second call does nothing
            with self._cond:
                if done[0]:
                    return
                done[0] = True
                self._lingering -= 1
            self._maybe_quiesce()

        return settle

    def _maybe_quiesce(self) -> None:
        with self._cond:
            if not (self._state.terminal and self._lingering == 0):
                return
            callbacks, self._quiesce_callbacks = self._quiesce_callbacks, []
        for fn in callbacks:
            try:
                fn()
            except Exception:  # noqa: BLE001 - the others still get their memory back
                log.exception("transfer %r: a quiesced callback failed", self.request_id)

    @contextmanager
    def writing(self) -> Iterator[bool]:
        """Hold the handle while writing one payload message into the destination; yields
        whether the write may happen (the transfer is still RECEIVING). A concurrent
        ``cancel`` waits for the write in progress, then no further one happens."""
        with self._cond:
            yield self._state is TransferState.RECEIVING
