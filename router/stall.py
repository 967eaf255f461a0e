"""Stragglers: a worker that stops answering while it holds calls.

A worker can stall without failing: its process stopped (SIGSTOP, a VM paused, swapped
out), its node silent before the channel's keepalive gives up. Its prefill calls then
wait for as long as the stall lasts, and every prompt the policy keeps sending it (its
cached prefixes draw them) waits too. The KV-cache-aware policy cannot tell a stalled
worker from a busy one; a busy one still answers, so the router asks.

Three kinds of wait are watched: a prefill worker's ``Prefill``, a decode worker's
reservation (the first answer of ``Decode``), and each next message of a stream that
generates (``Decode`` after the reservation, a mixed worker's ``Generate``). Lifecycle
of one under :class:`StallWatch`:

1. the call runs; if it returns (or fails) within ``probe_after_s``, that is its result;
2. past ``probe_after_s``, the watch asks the worker for its load (``GetLoad``: answered
   by the worker's gRPC event loop, off the engine thread, taking no lock). Calls waiting
   on one worker share one probe;
3. the worker answers within ``probe_timeout_s``: it is busy, not stalled; the call waits
   on and is probed again every ``probe_after_s``;
4. it does not answer: it is **stalled**. The watch tells the pool (``stalled``: marked
   down, so new prompts go to the other prefill workers; logged; counted in
   ``worker_stalls_total``), cancels the call, and returns None. After a ``Prefill`` the
   dispatcher then commits without a first token and the decode worker computes the
   prompt itself, the path of any failed prefill; after a reservation it reserves on the
   next decode worker; in a stream, the attempt fails and the router migrates the
   request with its tokens so far (``WorkerFailed``). The request waits for the
   detection (``probe_after_s + probe_timeout_s``), not for the straggler;
5. while the worker stays silent, the watch probes it every ``probe_after_s`` and keeps
   it down (``mark_down`` again), so a stall longer than the pool's ``down_s`` does not
   draw prompts back to it; its first answer ends that and puts it back in service at
   once (``mark_up``: a short stall costs its share of the pool for no longer than it
   lasts), as does its leaving the pool or :meth:`StallWatch.close`.

Why giving up is safe: the decode worker's reservation cancels a transfer that has not
landed when the commit carries no first token, and refuses one that arrives later (the
reservation machine, :mod:`workers.reservation`); when the stalled worker resumes it
finds its call cancelled and frees its blocks. Tokens stay exact: the prompt's greedy
continuation does not depend on which worker computed it.

A false alarm (a live worker too slow to answer ``GetLoad`` in time) costs a prompt
computed twice, never a wrong or lost token. ``probe_after_s = 0`` turns the watch off.
Runs on the router's event loop.

Streams are watched more cheaply than single calls, since every token crosses them: a
stream registers once (:meth:`StallWatch.stream`) and stamps each message it reads
(:attr:`Watched.last`, one clock read); one sweeper task wakes every ``probe_after_s``
and probes the workers of the streams quiet for that long (steps 2-5 above), cancelling
the streams of a worker found stalled. A watched read costs ~0.1 us, where wrapping
each read in :meth:`StallWatch.result` cost ~47 us on a 2-core AMD EPYC. A stream that
goes quiet just after a sweep is found at the sweep after next: within about
``2 x probe_after_s + probe_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol, TypeVar, cast

import grpc

from protos.pdserve.v1 import worker_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")


class Probed(Protocol):
    """What the watch needs of a pool's worker (:class:`router.pool.Worker`)."""

    address: str
    stub: Any  # a ``Worker`` stub: ``GetLoad(request, timeout=...)``


class CancellableCall(Awaitable[T], Protocol):
    def cancel(self) -> bool: ...


class StallPool(Protocol):
    """What the watch tells (:class:`router.pool.WorkerPool`)."""

    workers: Any  # the pool's workers now (a stalled one that left is not followed)

    def stalled(self, worker: Any) -> None: ...

    def mark_down(self, worker: Any, at_least_s: float = 0.0) -> None: ...

    def mark_up(self, worker: Any) -> None: ...


class Watched:
    """One stream under watch: the time of its last message (or of its start), and
    whether the watch cancelled it for its worker's stall."""

    __slots__ = ("worker", "cancel", "last", "stalled")

    def __init__(self, worker: Probed, cancel: Callable[[], object]) -> None:
        self.worker, self.cancel = worker, cancel
        self.last = time.monotonic()
        self.stalled = False


class StallWatch:
    def __init__(self, probe_after_s: float, probe_timeout_s: float,
                 pool: StallPool) -> None:
        if probe_after_s < 0 or probe_timeout_s <= 0:
            raise ValueError(f"stall probe: after {probe_after_s} s, timeout "
                             f"{probe_timeout_s} s: the first must be >= 0 (0: off), the "
                             "second > 0")
        self.probe_after_s = probe_after_s
        self.probe_timeout_s = probe_timeout_s
        self.pool = pool
        self._probes: dict[str, asyncio.Task[bool]] = {}  # address -> the probe under way
        self._silent: dict[str, asyncio.Task[None]] = {}  # address -> its follow-up
        self._closed = False
        self._streams: set[Watched] = set()
        self._sweeper: asyncio.Task[None] | None = None

    async def result(self, call: Awaitable[T], worker: Probed,
                     cancel: Callable[[], object] | None = None) -> T | None:
        """``call``'s result, or None when ``worker`` stalled meanwhile (the call is then
        cancelled: ``cancel``, by default ``call.cancel``, e.g. a stream's whole call for
        one of its reads). Raises what the call raises. Cancelling this cancels the call."""
        if not self.probe_after_s:
            return await call
        cancel = cancel or cast(CancellableCall[T], call).cancel
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.probe_after_s)
                if done:
                    return task.result()
                if not await self._answers(worker):
                    if task.done():  # it returned while the probe waited: take it
                        return task.result()
                    self._stalled(worker)
                    return None
        finally:
            if not task.done():
                cancel()
                task.cancel()

    @contextlib.contextmanager
    def stream(self, worker: Probed, cancel: Callable[[], object]) -> Iterator[Watched]:
        """Watch a stream from ``worker`` while the block runs: stamp ``last`` at every
        message; when ``stalled`` is set, the watch cancelled it (``cancel``)."""
        watched = Watched(worker, cancel)
        if not self.probe_after_s or self._closed:
            yield watched
            return
        self._streams.add(watched)
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.ensure_future(self._sweep())
        try:
            yield watched
        finally:
            self._streams.discard(watched)

    def close(self) -> None:
        """Stop following silent workers (the router is closing)."""
        self._closed = True
        for task in [*self._silent.values(), *self._probes.values()]:
            task.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._silent.clear()

    async def _sweep(self) -> None:
        """Every ``probe_after_s`` while streams are watched: probe the workers of the
        quiet ones, at once; cancel the streams of a worker that does not answer."""
        while self._streams and not self._closed:
            await asyncio.sleep(self.probe_after_s)
            quiet_since = time.monotonic() - self.probe_after_s
            by_worker: dict[str, list[Watched]] = {}
            for w in self._streams:
                if w.last <= quiet_since and not w.stalled:
                    by_worker.setdefault(w.worker.address, []).append(w)
            if by_worker:
                results = await asyncio.gather(*(self._check(ws, quiet_since)
                                                 for ws in by_worker.values()),
                                               return_exceptions=True)
                for e in results:
                    if isinstance(e, Exception):
                        log.error("stall sweep failed: %r", e)

    async def _check(self, quiet: list[Watched], quiet_since: float) -> None:
        worker = quiet[0].worker
        if await self._answers(worker):
            return
        still = [w for w in quiet if w.last <= quiet_since and w in self._streams]
        if not still:  # a message came while the probe waited: not silent after all
            return
        self._stalled(worker)
        for w in still:
            w.stalled = True
            w.cancel()

    def _stalled(self, worker: Probed) -> None:
        """One stall is told (logged, counted) once, however many calls it held."""
        self.pool.mark_down(worker, self._cycle_s)
        if worker.address not in self._silent and not self._closed:
            self.pool.stalled(worker)
            address = worker.address
            task = asyncio.ensure_future(self._follow(worker))
            self._silent[address] = task
            task.add_done_callback(
                lambda t: self._silent.pop(address) if self._silent.get(address) is t else None)

    async def _follow(self, worker: Probed) -> None:
        """Step 5: down while silent."""
        while any(w is worker for w in self.pool.workers):
            await asyncio.sleep(self.probe_after_s)
            if await self._answers(worker):
                log.info("worker %s answers again: serving", worker.address)
                self.pool.mark_up(worker)
                return
            self.pool.mark_down(worker, self._cycle_s)

    @property
    def _cycle_s(self) -> float:
        """The longest gap between two probes of a silent worker: it stays down across."""
        return 2 * (self.probe_after_s + self.probe_timeout_s)

    async def _answers(self, worker: Probed) -> bool:
        """Whether ``worker`` answers ``GetLoad`` within the timeout (one probe at a time
        per worker; every caller waiting on it gets its answer)."""
        probe = self._probes.get(worker.address)
        if probe is None:
            probe = asyncio.ensure_future(self._probe(worker))
            self._probes[worker.address] = probe
            probe.add_done_callback(lambda _: self._probes.pop(worker.address, None))
        return await asyncio.shield(probe)

    async def _probe(self, worker: Probed) -> bool:
        try:
            await worker.stub.GetLoad(worker_pb2.GetLoadRequest(),
                                      timeout=self.probe_timeout_s)
        except grpc.aio.AioRpcError as e:
            log.debug("stall probe of %s: %s", worker.address, e.code().name)
            return False
        except Exception as e:  # noqa: BLE001 - a channel the pool closed meanwhile
            log.debug("stall probe of %s: %r", worker.address, e)
            return False
        return True
