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
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .engine.llm_engine import LLMEngine, RequestOutput
from .engine.params import SamplingParams


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue


@dataclass
class _Abort:
    add: _Add  # the very request to stop: a later request may reuse its id


_STOP = object()


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Add] = {}
        self._load = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def load(self) -> EngineLoad:
        return self._load

    def close(self) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout=10)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        out: asyncio.Queue = asyncio.Queue()
        add = _Add(request_id, prompt_token_ids, params, cache_salt,
                   asyncio.get_running_loop(), out)
        self._commands.put(add)
        finished = False
        try:
            while True:
                item = await out.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished  # before yielding: the consumer may stop here
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(add))

    # -- engine thread -----------------------------------------------------------------

    def _snapshot(self) -> EngineLoad:
        sched = self.engine.scheduler
        return EngineLoad(len(sched.running), len(sched.waiting),
                          sched.block_manager.num_free_blocks, sched.block_manager.num_blocks)

    def _run(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests()
            try:
                cmd = self._commands.get(block=not busy)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd is _STOP:
                    self._fail_all(RuntimeError("the worker is shutting down"))
                    return
                self._apply(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a bug, not bad input: fail every request loudly
                    self._fail_all(RuntimeError(f"engine step failed: {e!r}"))
                    continue
                for output in outputs:
                    stream = self._streams.get(output.request_id)
                    if stream is None:
                        continue
                    if output.finished:
                        del self._streams[output.request_id]
                    self._deliver(stream, output)
            self._load = self._snapshot()

    def _apply(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Abort):
            rid = cmd.add.request_id
            if self._streams.get(rid) is cmd.add:
                del self._streams[rid]
                self.engine.abort_request(rid)
            return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                    cmd.cache_salt)
        except Exception as e:  # InvalidRequestError and friends go back to the caller
            self._deliver(cmd, e)
            return
        self._streams[cmd.request_id] = cmd

    def _deliver(self, stream: _Add, item: RequestOutput | Exception) -> None:
        """Hand an item to the consumer's event loop; a closed loop aborts the request."""
        try:
            stream.loop.call_soon_threadsafe(stream.out.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is gone: nobody will read
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]
                self.engine.abort_request(stream.request_id)

    def _fail_all(self, error: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            self.engine.abort_request(rid)
            self._deliver(stream, error)
        self._streams.clear()
