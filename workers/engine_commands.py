"""What the engine loop passes around: the commands servers post to the engine thread,
its counters, and the errors its streams raise (:mod:`workers.engine_loop` runs them).

Servers never build these; they call :class:`~workers.engine_loop.EngineLoop`'s methods,
which post one command each to the engine thread's queue.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from common.request import Request
from common.sampling import InvalidRequestError

from .engine.llm_engine import OnPrefilled, OnPrefilling, RequestOutput
from .reservation import ReservationMachine
from .transfer import TransferHandle, TransferResult

log = logging.getLogger("workers.engine_loop")


class EngineUnavailableError(RuntimeError):
    """The engine cannot serve (it failed, or the worker is shutting down): not about
    the request, which may succeed on another worker (servers answer UNAVAILABLE)."""


@dataclass
class EngineCounters:
    """Totals since start, updated on the engine thread (read anywhere: plain ints)."""

    generation_tokens: int = 0
    prompt_tokens: int = 0  # of finished requests
    cached_prompt_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    thread_cpu_s: float = 0.0  # the engine thread's CPU time, after the last step
    forward_s: float = 0.0  # wall time in the model's forward
    forward_cpu_s: float = 0.0  # the engine thread's CPU time in the forward

    def count(self, output: RequestOutput) -> None:
        self.generation_tokens += len(output.new_token_ids)
        if output.done:  # the prompt once, however many choices
            self.prompt_tokens += len(output.prompt_token_ids)
            self.cached_prompt_tokens += output.num_cached_tokens
        if output.finished:
            reason = output.finish_reason or "unknown"
            self.finished[reason] = self.finished.get(reason, 0) + 1


KVExpect = Callable[[str, list[int]], TransferHandle]
"""(request id, target block ids) -> the receiver's handle for that reservation."""


@dataclass
class Add:
    request: Request
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    on_prefilled: OnPrefilled | None = None
    on_prefilling: OnPrefilling | None = None
    local_threshold: int | None = None  # set: a reserve (decode side of disaggregation)

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class Abort:
    add: Add  # the very request to stop: a later request may reuse its id


@dataclass
class Commit:
    add: Add
    first_token: int | None
    choice_tokens: tuple[int, ...] = ()  # n > 1: the first tokens of choices 1..n-1


@dataclass
class Call:
    fn: Callable[[], None]


@dataclass
class TransferDone:
    add: Add
    result: TransferResult


@dataclass
class Reserve:
    """One reserve on the engine thread: its machine, and what carrying it out holds."""

    add: Add
    machine: ReservationMachine
    handle: TransferHandle | None = None  # once placed
    committed: bool = False  # the machine takes one commit; a repeat is ignored
    choice_tokens: tuple[int, ...] = ()  # the commit's first tokens of choices 1..n-1
    timers: list[threading.Timer] = field(default_factory=list)


STOP = object()


def request_error(request_id: str, e: Exception) -> InvalidRequestError:
    """What one request's own failure tells its caller: INVALID_ARGUMENT, never a worker
    failure (the router would mark the worker down and carry the request, and whatever
    in it failed here, to the next one)."""
    if isinstance(e, InvalidRequestError):
        return e
    log.error("request %s failed on its own; aborted", request_id, exc_info=e)
    return InvalidRequestError("request", f"failed on this worker ({type(e).__name__}: "
                               f"{e}); it was aborted, the other requests were not affected")


def call_logged(callback: Callable[[str], None], reason: str) -> None:
    try:
        callback(reason)
    except Exception:  # noqa: BLE001 - a failure callback must not stop the others
        log.exception("engine failure callback %r failed", callback)
