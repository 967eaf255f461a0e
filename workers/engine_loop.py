"""Runs one :class:`LLMEngine` on its own thread for asyncio servers.

Lifecycle of a request: :meth:`EngineLoop.generate` (on the event loop) posts an ``add``
command and returns an async iterator. The engine thread drains commands between steps,
steps the engine while any request is unfinished, and hands each
:class:`RequestOutput` back to the event loop with ``call_soon_threadsafe``. When the
consumer stops early (cancelled, disconnected, deadline) the iterator posts an ``abort``,
which frees the request's KV blocks before the next step. Errors from ``add_request``
(invalid input) are raised from the iterator before any output.

The engine is touched only by the engine thread; :meth:`load` reads counters that the
thread publishes after every step, so it is safe from any thread.

Disaggregated decode (:meth:`EngineLoop.reserve`): the first item of the stream is a
:class:`~workers.reservation.Reservation`. Unless the uncached part of the prompt is
under the local-prefill threshold (then the request simply runs here), the engine holds
blocks for the prompt and ``kv_expect`` registers them with the KV receiver. Each
reserve has a :class:`~workers.reservation.ReservationMachine`, which decides what the
transfer's end, the router's ``commit`` and aborts lead to (see
:mod:`workers.reservation`); this module carries its decisions out on the engine
thread: cancel the transfer, arm the offer timeout, settle (commit into the running
batch, recompute, or free; blocks a failed transfer may still write into go back to
the pool only once it is quiesced).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from common.request import Request

from .engine.llm_engine import LLMEngine, OnPrefilled, RequestOutput
from .engine.surface import EngineLoad
from .reservation import Actions, Reservation, ReservationMachine, ReservationState
from .transfer import TransferHandle, TransferResult

log = logging.getLogger(__name__)


@dataclass
class EngineCounters:
    """Totals since start, updated on the engine thread (read anywhere: plain ints)."""

    generation_tokens: int = 0
    prompt_tokens: int = 0  # of finished requests
    cached_prompt_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason

    def count(self, output: RequestOutput) -> None:
        self.generation_tokens += len(output.new_token_ids)
        if output.finished:
            self.prompt_tokens += len(output.prompt_token_ids)
            self.cached_prompt_tokens += output.num_cached_tokens
            reason = output.finish_reason or "unknown"
            self.finished[reason] = self.finished.get(reason, 0) + 1


KVExpect = Callable[[str, list[int]], TransferHandle]
"""(request id, target block ids) -> the receiver's handle for that reservation."""


@dataclass
class _Add:
    request: Request
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    on_prefilled: OnPrefilled | None = None
    local_threshold: int | None = None  # set: a reserve (decode side of disaggregation)

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class _Abort:
    add: _Add  # the very request to stop: a later request may reuse its id


@dataclass
class _Commit:
    add: _Add
    first_token: int | None


@dataclass
class _Call:
    fn: Callable[[], None]


@dataclass
class _TransferDone:
    add: _Add
    result: TransferResult


@dataclass
class _Reserve:
    """One reserve on the engine thread: its machine, and what carrying it out holds."""

    add: _Add
    machine: ReservationMachine
    handle: TransferHandle | None = None  # once placed
    committed: bool = False  # the machine takes one commit; a repeat is ignored
    timers: list[threading.Timer] = field(default_factory=list)


_STOP = object()


class EngineLoop:
    def __init__(self, engine: LLMEngine, kv_expect: KVExpect | None = None,
                 kv_address: str = "", commit_wait_s: float = 10.0) -> None:
        self.engine = engine
        self._kv_expect, self._kv_address = kv_expect, kv_address
        self._commit_wait_s = commit_wait_s
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Add] = {}
        self._remote: dict[str, _Reserve] = {}  # placed, not settled
        self._pending: list[_Reserve] = []  # QUEUED: waiting for free blocks, in order
        self._load = self._snapshot()
        self.counters = EngineCounters()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def load(self) -> EngineLoad:
        return self._load

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread between steps (from any thread)."""
        self._commands.put(_Call(fn))

    def close(self) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout=10)

    async def generate(
        self, request: Request, on_prefilled: OnPrefilled | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Run a request here; ``on_prefilled`` makes it prefill-only (see LLMEngine)."""
        add = _Add(request, asyncio.get_running_loop(), asyncio.Queue(), on_prefilled)
        async for item in self._stream(add):
            yield item  # type: ignore[misc]

    def reserve(
        self, request: Request, local_threshold: int = 0
    ) -> tuple[Callable[[int | None], None], AsyncIterator[Reservation | RequestOutput]]:
        """Decode side: returns ``commit`` and the stream, whose first item is the
        :class:`Reservation`. Call ``commit(first_token)`` once the prefill worker
        sampled it (None: prefill failed, compute everything here); not needed when
        the reservation is local. Waits (in order) while the KV pool is full."""
        if self._kv_expect is None:
            raise RuntimeError("this worker has no KV receiver (role is not decode)")
        add = _Add(request, asyncio.get_running_loop(), asyncio.Queue(),
                   local_threshold=max(local_threshold, 0))
        return (lambda token: self._commands.put(_Commit(add, token))), self._stream(add)

    async def _stream(self, add: _Add) -> AsyncIterator[Reservation | RequestOutput]:
        self._commands.put(add)
        finished = False
        try:
            while True:
                item = await add.out.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = isinstance(item, RequestOutput) and item.finished
                yield item  # finished is set first: the consumer may stop here
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(add))

    # -- engine thread -----------------------------------------------------------------

    def _snapshot(self) -> EngineLoad:
        load = self.engine.load()
        return dataclasses.replace(load, reserved=load.reserved + len(self._pending))

    def _run(self) -> None:
        engine = self.engine
        cmd = None
        while True:
            if cmd is None:
                busy = engine.has_runnable_requests()  # reserved ones wait for events
                try:
                    cmd = self._commands.get(block=not busy)
                except queue.Empty:
                    cmd = None
            while cmd is not None:
                if cmd is _STOP:
                    self._fail_all(RuntimeError("the worker is shutting down"))
                    return
                try:
                    self._apply(cmd)
                except Exception as e:  # a bug: fail loudly, keep the thread alive
                    log.exception("engine loop command %s failed", type(cmd).__name__)
                    self._fail_all(RuntimeError(f"engine command failed: {e!r}"))
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if engine.has_runnable_requests():
                try:
                    outputs = engine.step()
                except Exception as e:  # a bug, not bad input: fail every request loudly
                    self._fail_all(RuntimeError(f"engine step failed: {e!r}"))
                    continue
                # Published before the outputs: a consumer never sees a load older than
                # the step that produced what it holds.
                self._load = self._snapshot()
                for output in outputs:
                    self._emit(output)
            self._reserve_pending()
            self._load = self._snapshot()
            if engine.has_runnable_requests() and engine.last_step_empty:
                # Waiting for blocks that only a command can free (a release, an abort,
                # a landed transfer): sleep until one comes, never spin.
                try:
                    cmd = self._commands.get(timeout=0.5)
                except queue.Empty:
                    cmd = None

    def _reserve_pending(self) -> None:
        """Reserves that waited for room, in arrival order, while they fit."""
        while self._pending:
            rec = self._pending.pop(0)  # out before its answer goes: a failed one aborts
            if not self._try_reserve(rec):
                self._pending.insert(0, rec)
                return

    def _emit(self, output: RequestOutput) -> None:
        self.counters.count(output)
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            del self._streams[output.request_id]
        self._deliver(stream, output)

    def _apply(self, cmd: _Add | _Abort | _Commit | _TransferDone | _Call) -> None:
        if isinstance(cmd, _Call):
            cmd.fn()
        elif isinstance(cmd, _Abort):
            self._abort(cmd.add)
        elif isinstance(cmd, _Commit):
            rec = self._remote.get(cmd.add.request_id)
            if rec is not None and rec.add is cmd.add and not rec.committed:
                rec.committed = True
                self._carry_out(rec, rec.machine.commit(cmd.first_token))
        elif isinstance(cmd, _TransferDone):
            rec = self._remote.get(cmd.add.request_id)
            if rec is not None and rec.add is cmd.add:
                self._carry_out(rec, rec.machine.transfer_ended(cmd.result.ok))
        elif cmd.local_threshold is not None:
            rec = _Reserve(cmd, ReservationMachine(cmd.request_id))
            if self._pending or not self._try_reserve(rec):
                self._pending.append(rec)
        else:
            try:
                r = cmd.request
                self.engine.add_request(r.request_id, list(r.prompt_token_ids), r.sampling,
                                        r.cache_salt, cmd.on_prefilled)
            except Exception as e:  # InvalidRequestError and friends go back to the caller
                self._deliver(cmd, e)
                return
            self._streams[cmd.request_id] = cmd

    def _abort(self, add: _Add) -> None:
        rid, reason = add.request_id, "the request was cancelled"
        queued = next((rec for rec in self._pending if rec.add is add), None)
        if queued is not None:  # holds nothing yet
            self._pending.remove(queued)
            queued.machine.abort(reason)
            return
        if self._streams.get(rid) is not add:
            return
        del self._streams[rid]
        rec = self._remote.get(rid)
        if rec is None:
            self.engine.abort_request(rid)
        else:  # freed once the transfer can no longer write
            self._carry_out(rec, rec.machine.abort(reason))

    def _try_reserve(self, rec: _Reserve) -> bool:
        """Reserve now; False when there is no room yet (it stays QUEUED)."""
        add, machine, rid = rec.add, rec.machine, rec.add.request_id
        try:
            r = add.request
            kv = self.engine.reserve_request(rid, list(r.prompt_token_ids), r.sampling,
                                             r.cache_salt)
        except Exception as e:  # noqa: BLE001 - invalid input goes back to the caller
            machine.reject()
            self._deliver(add, e)
            return True
        if kv is None:
            return False
        self._streams[rid] = add
        handle = None
        if kv.uncached_tokens >= (add.local_threshold or 0):  # else: conditional disagg.
            assert self._kv_expect is not None
            try:
                handle = self._kv_expect(rid, list(kv.target_block_ids))
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
        handle.add_done_callback(lambda r: self._commands.put(_TransferDone(add, r)))
        self._deliver(add, Reservation(False, kv.cached_tokens, self._kv_address,
                                       kv.skip_blocks, kv.target_block_ids))
        return True

    def _carry_out(self, rec: _Reserve, actions: Actions) -> None:
        """Do what the machine decided for a placed reservation."""
        assert rec.handle is not None
        if actions.cancel_transfer is not None:
            rec.handle.cancel(actions.cancel_transfer)
        if actions.arm_offer_timeout:
            self._cancel_later(rec, "no KV offer came within the commit wait")
        if actions.settle:
            self._settle(rec)

    def _cancel_later(self, rec: _Reserve, reason: str) -> None:
        """A committed reservation whose offer never arrives is given up (the prefill
        worker died after sampling). Only while PENDING: a receive in flight is bounded
        by the channel's data timeout and must not be cut off for being long."""
        assert rec.handle is not None
        timer = threading.Timer(self._commit_wait_s, rec.handle.cancel_pending, args=(reason,))
        timer.daemon = True
        timer.start()
        rec.timers.append(timer)

    def _settle(self, rec: _Reserve) -> None:
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
        if state is ReservationState.RUNNING:
            assert token is not None
            final = self.engine.commit_request(rid, token)
        else:
            final = self.engine.recompute_request(rid, token)
        if final is not None:
            self._emit(final)

    def _deliver(self, stream: _Add, item: Reservation | RequestOutput | Exception) -> None:
        """Hand an item to the consumer's event loop; a closed loop aborts the request."""
        try:
            stream.loop.call_soon_threadsafe(stream.out.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is gone: nobody will read
            self._abort(stream)

    def _fail_all(self, error: Exception) -> None:
        streams, self._streams = self._streams, {}
        pending, self._pending = self._pending, []
        reason = "the worker is failing every request"
        for rid, stream in streams.items():
            rec = self._remote.get(rid)
            if rec is None:
                self.engine.abort_request(rid)
            else:  # blocks under a live transfer are freed when it ends
                self._carry_out(rec, rec.machine.abort(reason))
            self._deliver(stream, error)
        for rec in pending:
            rec.machine.abort(reason)
            self._deliver(rec.add, error)
