"""The decode side of the engine loop: reservations carried out on the engine thread.

:meth:`EngineLoop.reserve <workers.engine_loop.EngineLoop.reserve>` posts a reserve;
on the engine thread it waits (in order) for free blocks, then holds blocks for the
prompt and registers them with the KV receiver (``kv_expect``), or runs the request
here when its uncached part is short. Each reserve has a
:class:`~workers.reservation.ReservationMachine`, which decides what the transfer's end,
the router's ``commit`` and aborts lead to; :class:`ReservationDriver` carries those
decisions out: cancel the transfer, arm the offer timeout, settle (commit into the
running batch, recompute, or free; blocks a failed transfer may still write into go
back to the pool only once it is quiesced).

A mixin of :class:`~workers.engine_loop.EngineLoop`: it uses the loop's engine, streams
and delivery, and runs only on the engine thread.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from common.sampling import InvalidRequestError

from .engine.params import local_limit
from .engine_commands import Reserve, TransferDone, request_error
from .reservation import Actions, Reservation, ReservationState

if TYPE_CHECKING:
    import queue

    from .engine.llm_engine import LLMEngine
    from .engine_commands import Add, KVExpect


class ReservationDriver:
    """The reservation half of the engine loop (engine thread only). It also calls the
    loop's ``_deliver``, ``_emit``, ``_fail_request`` and ``call_soon``."""

    engine: LLMEngine
    _commands: queue.Queue
    _streams: dict[str, Add]
    _remote: dict[str, Reserve]
    _pending: list[Reserve]
    _kv_expect: KVExpect | None
    _kv_address: str
    _commit_wait_s: float

    def _reserve_pending(self) -> None:
        """Reserves that waited for room, in arrival order, while they fit."""
        while self._pending:
            rec = self._pending.pop(0)  # out before its answer goes: a failed one aborts
            if not self._try_reserve(rec):
                self._pending.insert(0, rec)
                return

    def _try_reserve(self, rec: Reserve) -> bool:
        """Reserve now; False when there is no room yet (it stays QUEUED)."""
        add, machine, rid = rec.add, rec.machine, rec.add.request_id
        try:
            r = add.request
            kv = self.engine.reserve_request(rid, list(r.prompt_token_ids), r.sampling,
                                             r.cache_salt, r.n, r.prompt_logprobs)
        except Exception as e:  # noqa: BLE001 - the request's own: back to its caller
            machine.reject()
            self._deliver(add, request_error(rid, e))
            return True
        if kv is None:
            return False
        self._streams[rid] = add
        handle = None
        # Local below the threshold (conditional disaggregation), or with no receiver:
        # the role changed while this reserve was queued (workers/roles.py).
        expect = self._kv_expect
        if expect is not None and kv.uncached_tokens >= local_limit(
                add.local_threshold, kv.cached_tokens, self.engine.config.block_size):
            try:
                handle = expect(rid, list(kv.target_block_ids))
            except Exception:  # noqa: BLE001 - receiver closed: compute here
                handle = None
        if handle is None:
            machine.go_local()
            self.engine.recompute_request(rid, None)
            self._deliver(add, Reservation(True, kv.cached_tokens))
            return True
        machine.place()
        rec.handle = handle
        self._remote[rid] = rec
        handle.add_done_callback(lambda r: self._commands.put(TransferDone(add, r)))
        self._deliver(add, Reservation(False, kv.cached_tokens, self._kv_address,
                                       kv.skip_blocks, kv.target_block_ids))
        return True

    def _carry_out(self, rec: Reserve, actions: Actions) -> None:
        """Do what the machine decided for a placed reservation."""
        assert rec.handle is not None
        if actions.cancel_transfer is not None:
            rec.handle.cancel(actions.cancel_transfer)
        if actions.arm_offer_timeout:
            self._cancel_later(rec, "no KV offer came within the commit wait")
        if actions.settle:
            self._settle(rec)

    def _cancel_later(self, rec: Reserve, reason: str) -> None:
        """A committed reservation whose offer never arrives is given up (the prefill
        worker died after sampling). Only while PENDING: a receive in flight is bounded
        by the channel's data timeout and must not be cut off for being long."""
        assert rec.handle is not None
        timer = threading.Timer(self._commit_wait_s, rec.handle.cancel_pending, args=(reason,))
        timer.daemon = True
        timer.start()
        rec.timers.append(timer)

    def _settle(self, rec: Reserve) -> None:
        """The transfer ended and the machine settled: commit, recompute or free."""
        assert rec.handle is not None
        rid = rec.add.request_id
        del self._remote[rid]
        for timer in rec.timers:
            timer.cancel()
        if not rec.handle.quiesced:  # failed with receives still posted: not these blocks
            release = self.engine.quarantine_request(rid)
            rec.handle.add_quiesced_callback(lambda: self.call_soon(release))
        state, token = rec.machine.state, rec.machine.first_token
        if state is ReservationState.ABORTED:
            self.engine.abort_request(rid)
            return
        try:
            if state is ReservationState.RUNNING:
                assert token is not None
                finals = self.engine.commit_request(rid, token, rec.choice_tokens)
            else:
                finals = self.engine.recompute_request(
                    rid, token, rec.choice_tokens if token is not None else ())
        except InvalidRequestError as e:  # checked when the commit came; in case
            self._fail_request(rec.add, e)
            return
        for final in finals:
            self._emit(final)
