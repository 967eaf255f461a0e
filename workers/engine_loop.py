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

Failures. A request failing on its own (bad input found late, a first token outside the
vocabulary, an error in its own bookkeeping inside the step, or in a command about it)
ends that request alone: its stream raises :class:`InvalidRequestError` (servers answer
``INVALID_ARGUMENT``) and its blocks are freed; the rest of the batch runs on. An engine
failure (``step`` raising: the forward, the sampler, a broken invariant) or the engine
thread itself failing fails every request with :class:`EngineUnavailableError` and the
loop stops serving for good: :attr:`EngineLoop.failure` says why, callbacks registered
with :meth:`EngineLoop.on_failure` run once (the worker turns its health NOT_SERVING and
leaves the registry), new requests are refused with the same error, and transfers still
in flight are waited for so their blocks come back.

Disaggregated decode (:meth:`EngineLoop.reserve`): the first item of the stream is a
:class:`~workers.reservation.Reservation`; :mod:`workers.engine_reservations` carries the
reservations out on the engine thread. The commands, counters and errors are in
:mod:`workers.engine_commands`.

Threads. Servers pass a function that builds the engine, run on the engine thread.
With GNU OpenMP (torch's CPU builds) every thread that runs a parallel op gets a team of
helper threads of its own, and once a process holds more of those than it has cores,
every team stops spinning at its barriers and sleeps on a futex instead: each of the
hundreds of ops of a step then pays a wake-up. Loading the model on the server's main
thread gave that thread a team for good. Measured on a 2-core Xeon (AMX), SmolLM2,
bf16, 8 concurrent requests of 256 -> 64 tokens through an EngineLoop: 160 tok/s with
the model loaded on the main thread, 282 with it loaded on the engine thread (the same
engine stepped on the main thread: 270-279); fp32: ~15% apart. Calling
``torch.set_num_threads(1)`` on the other threads did not help: it also took the
engine's bf16 GEMMs down to one thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

import torch

from common.cost_model import StepSums
from common.request import Request
from common.sampling import InvalidRequestError
from common.threads import ENGINE, name_native_thread

from .engine.llm_engine import LLMEngine, OnPrefilled, OnPrefilling, RequestOutput, coalesce
from .engine.model_runner import default_intra_op_threads
from .engine.surface import EngineLoad
from .engine_commands import (
    STOP,
    Abort,
    Add,
    Call,
    Commit,
    EngineCounters,
    EngineUnavailableError,
    KVExpect,
    Reserve,
    TransferDone,
    call_logged,
    request_error,
)
from .engine_reservations import ReservationDriver
from .reservation import Reservation, ReservationMachine
from .step_trace import StepTrace
from .transfer import TransferResult

__all__ = ["EngineCounters", "EngineLoop", "EngineUnavailableError", "KVExpect"]

log = logging.getLogger(__name__)


class EngineLoop(ReservationDriver):
    """``engine``: an engine, or (what servers pass) a function that builds one, which
    then runs on the engine thread: the model loads there, and that thread is the only
    one with an intra-op team (see the module docstring). The constructor returns once
    the engine is built, raising what building it raised. ``step_trace``: a file each
    step that ran work is appended to (:mod:`workers.step_trace`); ``step_listener``:
    called on the engine thread with each such step's start (unix seconds), seconds and
    sums (a worker's ``--publish-steps``, :class:`workers.step_trace.StepPublisher`);
    it must not block."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine],
                 kv_expect: KVExpect | None = None, kv_address: str = "",
                 commit_wait_s: float = 10.0, step_trace: str | None = None,
                 step_listener: Callable[[float, float, StepSums], None] | None = None
                 ) -> None:
        build = None if isinstance(engine, LLMEngine) else engine
        self._kv_expect, self._kv_address = kv_expect, kv_address
        self._commit_wait_s = commit_wait_s
        self._trace = StepTrace(step_trace) if step_trace else None
        """Each step's time and sums (:mod:`workers.step_trace`); a path that cannot be
        written fails the worker's start here, not its first step."""
        self._step_listener = step_listener
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, Add] = {}
        self._remote: dict[str, Reserve] = {}  # placed, not settled
        self._pending: list[Reserve] = []  # QUEUED: waiting for free blocks, in order
        self.counters = EngineCounters()
        self.failure: str | None = None
        """Why the loop stopped serving (see the module docstring); None while it serves.
        Set once, on the engine thread; safe to read anywhere."""
        self._failure_callbacks: list[Callable[[str], None]] = []
        built: queue.Queue[LLMEngine | BaseException] = queue.Queue()
        if build is None:
            self.engine = engine  # type: ignore[assignment]
            self._load = self._snapshot()
        self._thread = threading.Thread(target=self._run, args=(build, built), name="engine",
                                        daemon=True)
        self._thread.start()
        if build is not None:
            got = built.get()
            if isinstance(got, BaseException):
                if self._trace is not None:
                    self._trace.close()
                raise got

    def load(self) -> EngineLoad:
        return self._load

    @property
    def serving(self) -> bool:
        """Whether requests sent now can run here. Safe from any thread."""
        return self.failure is None and self._thread.is_alive()

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` when the loop stops serving, on the engine thread
        (at once, here, if it already has). It must not block, and must be idempotent:
        registered while the loop fails, it may run twice. Exceptions are logged."""
        self._failure_callbacks.append(callback)
        if self.failure is not None:
            call_logged(callback, self.failure)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread between steps (from any thread)."""
        self._commands.put(Call(fn))

    async def barrier(self) -> None:
        """Returns once the engine thread has taken every command queued before this
        call (a reserve queued earlier is placed, or waits for room, by then); at once
        when the loop no longer serves (its commands are dropped)."""
        if not self.serving:
            return
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def passed() -> None:
            if not done.done():  # the waiter may have given up
                done.set_result(None)

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the waiter's loop closed
                loop.call_soon_threadsafe(passed)

        self.call_soon(wake)
        await done

    def set_kv_receiver(self, kv_expect: KVExpect | None, kv_address: str = "") -> None:
        """A role change (:mod:`workers.roles`): reservations from now on register with
        ``kv_expect`` and name ``kv_address``; None: reservations are local. Swapped on
        the engine thread, in order with the commands: a reserve queued before runs with
        the old hooks, and is computed here if they fail."""
        def swap() -> None:
            self._kv_expect, self._kv_address = kv_expect, kv_address

        self.call_soon(swap)

    def set_prefill_cap(self, tokens: int) -> None:
        """The engine's stall-free cap from its next step on
        (:meth:`LLMEngine.set_prefill_cap`), in order with the commands."""
        self.call_soon(lambda: self.engine.set_prefill_cap(tokens))

    def close(self) -> None:
        self._commands.put(STOP)
        self._thread.join(timeout=10)

    async def generate(
        self, request: Request, on_prefilled: OnPrefilled | None = None,
        on_prefilling: OnPrefilling | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Run a request here; ``on_prefilled`` makes it prefill-only, ``on_prefilling``
        hears of its last chunk's step before the forward (see LLMEngine)."""
        add = Add(request, asyncio.get_running_loop(), asyncio.Queue(), on_prefilled,
                  on_prefilling)
        async for item in self._stream(add):
            yield item  # type: ignore[misc]

    def reserve(
        self, request: Request, local_threshold: int = 0
    ) -> tuple[Callable[..., None], AsyncIterator[Reservation | RequestOutput]]:
        """Decode side: returns ``commit`` and the stream, whose first item is the
        :class:`Reservation`. Call ``commit(first_token, choice_tokens=())`` once the
        prefill worker sampled it (and, n > 1, the other choices' first tokens; None:
        prefill failed, compute everything here); not needed when the reservation is
        local. Waits (in order) while the KV pool is full. With no KV receiver when it
        runs (the role changed after the servicer let the call in; a change to decode is
        swapped in before any reserve queued after it) the reservation is local."""
        add = Add(request, asyncio.get_running_loop(), asyncio.Queue(),
                   local_threshold=max(local_threshold, 0))

        def commit(token: int | None, choice_tokens: tuple[int, ...] = ()) -> None:
            self._commands.put(Commit(add, token, tuple(choice_tokens)))
        return commit, self._stream(add)

    async def _stream(self, add: Add) -> AsyncIterator[Reservation | RequestOutput]:
        self._commands.put(add)
        finished = False
        backlog: collections.deque = collections.deque()  # taken, not yet handed out
        try:
            while True:
                if not backlog:
                    backlog.extend(_piled_up(await add.out.get(), add.out))
                item = backlog.popleft()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = isinstance(item, RequestOutput) and item.done
                yield item  # finished is set first: the consumer may stop here
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(Abort(add))

    # -- engine thread -----------------------------------------------------------------

    def _snapshot(self) -> EngineLoad:
        load = self.engine.load()
        return dataclasses.replace(load, reserved=load.reserved + len(self._pending))

    def _run(self, build: Callable[[], LLMEngine] | None,
             built: queue.Queue[LLMEngine | BaseException]) -> None:
        name_native_thread(ENGINE)  # before the first forward: its helpers inherit it
        if build is not None:
            try:
                torch.set_num_threads(default_intra_op_threads())  # the config may say more
                self.engine = build()
                self._load = self._snapshot()
            except BaseException as e:  # noqa: BLE001 - the constructor raises it
                built.put(e)
                return
            built.put(self.engine)
        try:
            self.engine.trace_sums = self._records_steps()
            self._serve()
            return
        except Exception as e:  # noqa: BLE001 - the thread must not die silently
            log.exception("the engine thread failed")
            try:
                self._stop_serving(f"the engine thread failed: {e!r}")
            except Exception:  # noqa: BLE001
                log.exception("failing the requests left after the engine thread failed")
        finally:
            if self._trace is not None:
                self._trace.close()
        # Nothing here can be trusted now; answer every new request until close().
        while (cmd := self._commands.get()) is not STOP:
            if isinstance(cmd, Add):
                self._deliver(cmd, self._unavailable())

    def _runnable(self) -> bool:
        """Whether to step: requests that can run (reserved ones wait for events, not
        steps), and an engine that still serves."""
        return self.failure is None and self.engine.has_runnable_requests()

    def _serve(self) -> None:
        engine = self.engine
        cmd = None
        busy_since: float | None = None  # the last step's end, while the loop never waited
        while True:
            if cmd is None:
                runnable = self._runnable()
                if not runnable:
                    busy_since = None  # idle: the next step's time starts with it
                try:
                    cmd = self._commands.get(block=not runnable)
                except queue.Empty:
                    cmd = None
            while cmd is not None:
                if cmd is STOP:
                    self._fail_all(EngineUnavailableError("the worker is shutting down"))
                    return
                self._apply_guarded(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._runnable():
                started = time.perf_counter()
                try:
                    outputs = engine.step()
                except Exception as e:  # noqa: BLE001 - the batch's work, not one request's
                    log.exception("engine step failed")
                    self._stop_serving(f"engine step failed: {e!r}")
                    outputs = []
                # Published before the outputs: a consumer never sees a load older than
                # the step that produced what it holds.
                self._load = self._snapshot()
                for output in outputs:
                    self._emit(output)
                ended = time.perf_counter()
                if engine.last_sums is not None:
                    # The loop's time since the previous step ended (its commands and
                    # hand-offs included) when it never waited since: the gap between
                    # two tokens of a sequence in a busy batch.
                    began = started if busy_since is None else busy_since
                    self._record_step(time.time() - (ended - began), ended - began,
                                      engine.last_sums)
                    engine.last_sums = None
                busy_since = ended
                c = self.counters
                c.forward_s, c.forward_cpu_s = engine.runner.forward_s, engine.runner.forward_cpu_s
                c.thread_cpu_s = time.thread_time()
            self._reserve_pending()
            self._load = self._snapshot()
            if self._runnable() and engine.last_step_empty:
                # Waiting for blocks that only a command can free (a release, an abort,
                # a landed transfer): sleep until one comes, never spin.
                busy_since = None
                try:
                    cmd = self._commands.get(timeout=0.5)
                except queue.Empty:
                    cmd = None

    def _records_steps(self) -> bool:
        """Whether anything takes the steps' sums (the engine computes them only then)."""
        return self._trace is not None or self._step_listener is not None

    def _record_step(self, start: float, seconds: float, sums: StepSums) -> None:
        """One step into the trace and to the listener. A trace that cannot be written
        (a full disk) or a listener that raises is turned off, logged once: a
        diagnostic must not stop the serving."""
        if self._trace is not None:
            try:
                self._trace.write(start, seconds, sums)
            except OSError as e:
                log.warning("step trace %s turned off: %s", self._trace.path, e)
                with contextlib.suppress(OSError):
                    self._trace.close()
                self._trace = None
                self.engine.trace_sums = self._records_steps()
        if self._step_listener is not None:
            try:
                self._step_listener(start, seconds, sums)
            except Exception:  # noqa: BLE001 - the listener's fault, not the step's
                log.exception("step listener turned off")
                self._step_listener = None
                self.engine.trace_sums = self._records_steps()

    def _emit(self, output: RequestOutput) -> None:
        """Hand an output to its stream; a request that failed on its own (``error``)
        gets the error instead, and is already aborted."""
        self.counters.count(output)
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.error is not None and not output.done:
            # One choice failed: the request fails, and its other choices stop with it.
            self.engine.abort_request(output.request_id)
        if output.done or output.error is not None:
            del self._streams[output.request_id]
        self._deliver(stream, output if output.error is None else output.error)

    def _apply_guarded(self, cmd: Add | Abort | Commit | TransferDone | Call) -> None:
        """A command about one request that raises fails that request alone; any other
        (a ``Call``: a release, a probe) leaves the engine in doubt: stop serving."""
        try:
            self._apply(cmd)
            return
        except Exception as e:  # noqa: BLE001 - a bug: contain it, loudly
            log.exception("engine loop command %s failed", type(cmd).__name__)
            error = e
        add = cmd if isinstance(cmd, Add) else getattr(cmd, "add", None)
        if add is not None:
            try:
                self._fail_request(add, request_error(add.request_id, error))
                return
            except Exception:  # noqa: BLE001
                log.exception("aborting request %s after its command failed", add.request_id)
        self._stop_serving(f"engine command {type(cmd).__name__} failed: {error!r}")

    def _fail_request(self, add: Add, error: Exception) -> None:
        """End one request with ``error``: abort it (freeing its blocks, or once its
        transfer can no longer write into them) and raise ``error`` from its stream."""
        self._abort(add)
        self._deliver(add, error)

    def _unavailable(self) -> EngineUnavailableError:
        return EngineUnavailableError(f"this worker no longer serves ({self.failure}); "
                                      "send the request to another worker")

    def _stop_serving(self, reason: str) -> None:
        """An engine failure: stop serving for good (see the module docstring)."""
        first = self.failure is None
        if first:
            self.failure = reason
            log.error("the engine loop no longer serves: %s", reason)
            for callback in self._failure_callbacks:
                call_logged(callback, reason)
        self._fail_all(EngineUnavailableError(f"the engine failed ({reason}); send the "
                                              "request to another worker"))
        # Requests without a stream (none should be) must not keep the loop stepping.
        self.engine.abort_all(keep=self._remote.keys())
        self._load = self._snapshot()

    def _apply(self, cmd: Add | Abort | Commit | TransferDone | Call) -> None:
        if isinstance(cmd, Call):
            cmd.fn()
        elif isinstance(cmd, Abort):
            self._abort(cmd.add)
        elif isinstance(cmd, Commit):
            rec = self._remote.get(cmd.add.request_id)
            if rec is not None and rec.add is cmd.add and not rec.committed:
                rec.committed = True
                rec.choice_tokens = cmd.choice_tokens
                if cmd.first_token is not None:
                    try:  # it enters the next forward's input: checked before it counts
                        for token in (cmd.first_token, *cmd.choice_tokens):
                            self.engine.check_first_token(token)
                    except InvalidRequestError as e:
                        self._fail_request(rec.add, e)
                        return
                self._carry_out(rec, rec.machine.commit(cmd.first_token))
        elif isinstance(cmd, TransferDone):
            rec = self._remote.get(cmd.add.request_id)
            if rec is not None and rec.add is cmd.add:
                _log_failed_receive(cmd.result)
                self._carry_out(rec, rec.machine.transfer_ended(cmd.result.ok))
        elif self.failure is not None:
            self._deliver(cmd, self._unavailable())
        elif cmd.local_threshold is not None:
            rec = Reserve(cmd, ReservationMachine(cmd.request_id))
            if self._pending or not self._try_reserve(rec):
                self._pending.append(rec)
        else:
            try:
                r = cmd.request
                self.engine.add_request(r.request_id, list(r.prompt_token_ids), r.sampling,
                                        r.cache_salt, cmd.on_prefilled, r.n,
                                        r.prompt_logprobs, cmd.on_prefilling)
            except Exception as e:  # noqa: BLE001 - the request's own: back to its caller
                self._deliver(cmd, request_error(cmd.request_id, e))
                return
            self._streams[cmd.request_id] = cmd

    def _abort(self, add: Add) -> None:
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

    def _deliver(self, stream: Add, item: Reservation | RequestOutput | Exception) -> None:
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


def _log_failed_receive(result: TransferResult) -> None:
    if result.fault:  # the reservation computes the prompt here instead
        log.warning("KV receive of %s ended %s after %.1fs: %s", result.request_id,
                    result.state.value, result.seconds, result.reason)


def _piled_up(first: object, queue: asyncio.Queue) -> list:
    """``first`` and whatever else is already queued, the outputs that piled up while
    the consumer was busy merged into one per choice (:func:`coalesce`), in the order
    the choices first appear; the request's last output stays last, and anything else
    (a reservation, an error) ends the batch in its place."""
    items = [first]
    while isinstance(items[-1], RequestOutput) and not items[-1].done and not queue.empty():
        items.append(queue.get_nowait())
    tail = [] if isinstance(items[-1], RequestOutput) else [items.pop()]
    merged: dict[int, RequestOutput] = {}
    for out in items:
        before = merged.get(out.index)
        merged[out.index] = out if before is None else coalesce(before, out)
    outs = sorted(merged.values(), key=lambda o: o.done)  # stable: the last one last
    return [*outs, *tail]
