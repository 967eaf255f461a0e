"""The call protocols: how one attempt at a request runs on the workers.

:meth:`Dispatcher.stream` yields the worker's ``WorkerGenerateResponse`` messages for one
attempt, whichever protocol runs it (worker.proto gives the message order):

- **mixed** (no prefill or no decode pool): the policy picks a mixed worker (with none,
  while a role change is under way, any worker); one ``Generate`` stream.
- **disaggregated**: open ``Decode`` on the least-loaded decode worker and send
  ``start``; it answers with a reservation. A decode worker that fails there is marked
  down for ``down_s`` and the next one tried, as is one that stalls there
  (:mod:`router.stall`); when none can take the request,
  UNAVAILABLE. If the reservation is ``local`` (conditional disaggregation: the
  uncached part is short) the decode worker prefills itself and no ``Prefill`` is sent.
  Otherwise the policy picks a prefill worker and ``Prefill`` returns the first token,
  which is relayed at once (TTFT never waits for the KV transfer) after being
  ``commit``-ted to the decode worker; the rest streams from ``Decode``. With a
  placement rule (:mod:`router.adaptive`, when the router has a machine profile) the
  router may also keep a prompt the decode worker did not take locally on that worker,
  from the live state (its running decodes, the prefill pool's queue): it commits
  without a first token, as after a failed prefill, and the decode worker computes the
  prompt in its own steps; so it does, with ``prefill_queue_limit``, when every prefill
  worker that could take the prompt and is not down has that many prompts of this router
  in flight (overflow: a prefill pool short of a worker borrows the decode workers'
  steps; requests placed within one prefix lookup of each other see the same count); and
  while the prefill pool is short of a worker (one down or lost, or back or new and still
  cold: ``WorkerPool.short``), it keeps there any prompt the decode worker holds but for
  its last block (the lost worker's prompts are cold on its peers). A prefill that
  fails for the worker's sake (died, transport error), or whose worker stalled
  (:mod:`router.stall`: it did not answer a probe while the call ran), commits without a
  first token: the decode worker recomputes the prompt and the request still completes.

A request of several choices (``n``) is one attempt everywhere: one ``Generate``, or one
reservation and one ``Prefill``, which samples every choice's first token from the
prompt it computed once; the commit carries them all and the decode worker forks the
prompt's blocks for each choice. Messages name their choice (``index``); the attempt
ends when every choice has ended (a choice that ended at its first token ends on the
prefill worker's word, and the decode worker's duplicate end is dropped).

Failures are sorted once, in :func:`from_worker`: a status about the request or its
caller (:data:`CALLER_CODES`) is passed on as that status; anything else marks the
worker down and raises :class:`router.errors.WorkerFailed`, which the router answers by
migrating the request. Every exit cancels the calls it opened (a no-op on finished ones;
the workers abort the request and free its blocks otherwise) and gives back the
``in_flight`` and ``queued_tokens`` it counted. A stream (``Generate``, or ``Decode``
after its reservation) whose worker stalls mid-generation (:mod:`router.stall`: no
message and no answer to a probe) is cancelled and raises ``WorkerFailed`` too, so the
request migrates with its tokens so far instead of waiting out the stall.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from common.request import Request
from common.wire import request_to_proto
from protos.pdserve.v1 import api_pb2, worker_pb2

from .adaptive import PlacementInputs, PrefillPlacement
from .choice import Chooser, PromptHashes
from .errors import RouterError, WorkerFailed
from .policies import Decision
from .pool import Worker, WorkerPool
from .stall import StallWatch, Watched

log = logging.getLogger(__name__)

CALLER_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED)
"""Worker answers about the request or its caller, not about the worker's health."""


class Dispatcher:
    def __init__(self, pool: WorkerPool, chooser: Chooser,
                 placement: PrefillPlacement | None = None) -> None:
        self.pool = pool
        self.chooser = chooser
        self.placement = placement
        c = pool.config
        self.stalls = StallWatch(c.stall_probe_after_s, c.stall_probe_timeout_s, pool)
        self._unpaired: set[tuple[str, str]] = set()  # (decode address, model id) logged

    def stream(self, request: Request, timeout: float | None, routing: api_pb2.Routing,
               hashes: PromptHashes | None = None
               ) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        """One attempt, disaggregated when both pools serve; fills ``routing`` in. The
        typed request becomes its wire form here, once, for every call of the attempt;
        ``hashes`` are the request's block hashes, kept across its attempts."""
        wreq = request_to_proto(request)
        if self.pool.disaggregated:
            return self.disaggregated(wreq, timeout, routing, hashes)
        return self.mixed(wreq, timeout, routing, hashes)

    async def mixed(self, wreq: worker_pb2.WorkerGenerateRequest, timeout: float | None,
                    routing: api_pb2.Routing, hashes: PromptHashes | None = None
                    ) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        worker, decision = await self.chooser.choose("mixed", wreq, hashes)
        _record(routing, decision)
        queued = decision.estimated_tokens - worker.queued_tokens
        worker.in_flight += 1
        worker.queued_tokens += queued
        call = None
        try:
            call = worker.stub.Generate(wreq, timeout=timeout)
            with self.stalls.stream(worker, call.cancel) as watched:
                while (msg := await _read(call, watched)) is not grpc.aio.EOF:
                    if queued and msg.token_ids:
                        worker.queued_tokens -= queued  # prefilled
                        queued = 0
                    yield msg
        except grpc.aio.AioRpcError as e:
            if e.code() not in CALLER_CODES:
                self.pool.failed(worker, e)
            raise from_worker(e, worker.address) from e
        finally:
            if call is not None:
                call.cancel()  # no-op when finished; frees the worker's blocks otherwise
            worker.in_flight -= 1
            worker.queued_tokens -= queued

    async def disaggregated(self, wreq: worker_pb2.WorkerGenerateRequest,
                            timeout: float | None, routing: api_pb2.Routing,
                            hashes: PromptHashes | None = None
                            ) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        deadline = None if timeout is None else time.monotonic() + timeout
        decode, call, reservation = await self._reserve(wreq, deadline)
        routing.decode_worker = decode.address
        choices, done = wreq.n or 1, set()  # choices in all, and those that ended
        context = len(wreq.prompt_token_ids)
        decode.context_tokens += context
        try:
            prefilled = None
            local = self._place(wreq, decode, reservation)
            if local:
                policy = self.chooser.policy.name
                routing.MergeFrom(api_pb2.Routing(policy=policy, reason=local,
                                                  worker=decode.address))
                self.chooser.decided(policy, local)
                if not reservation.local:  # the rule kept it here: compute it here
                    await _write(call, worker_pb2.DecodeRequest(commit=worker_pb2.DecodeCommit()))
                    await _write(call, None)
            else:
                prefilled = await self._prefill(wreq, reservation.target, deadline, routing,
                                                hashes, decode)
                if prefilled is None:  # compute the whole prompt on the decode worker
                    # Counted as a local placement of its own (the prefill worker failed or
                    # stalled), beside the prefill choice already counted for it.
                    self.chooser.decided(self.chooser.policy.name, "local_fallback")
                    await _write(call, worker_pb2.DecodeRequest(commit=worker_pb2.DecodeCommit()))
                else:
                    firsts = [prefilled.first, *prefilled.choices]
                    done.update(i for i, f in enumerate(firsts) if f.finish_reason)
                    if len(done) < choices:
                        # Commit first: a slow consumer must not hold the decode worker back.
                        await _write(call, worker_pb2.DecodeRequest(
                            commit=worker_pb2.DecodeCommit(
                                first_token=firsts[0].token_ids[0],
                                choice_tokens=[f.token_ids[0] for f in firsts[1:]])))
                    for i, first in enumerate(firsts):
                        if first.finish_reason:  # that choice ended there: its last word
                            first.index = i
                            yield first
                        else:
                            yield worker_pb2.WorkerGenerateResponse(
                                token_ids=first.token_ids, text=first.text,
                                logprobs=first.logprobs, index=i,
                                prompt_logprobs=first.prompt_logprobs)
                    if len(done) == choices:  # all ended at the first token; cancel frees
                        return                # the reservation
                await _write(call, None)
            with self.stalls.stream(decode, call.cancel) as watched:
                while len(done) < choices:
                    msg = await _read(call, watched)
                    if msg is grpc.aio.EOF:
                        self.pool.mark_down(decode)
                        raise WorkerFailed(f"decode worker {decode.address} ended the stream early")
                    out = msg.output
                    if out.index in done:  # it ended on the prefill worker, which said so
                        continue
                    decode.context_tokens += len(out.token_ids)
                    context += len(out.token_ids)
                    if out.finish_reason and prefilled is not None:
                        # The prompt was computed (or reused) on the prefill worker.
                        out.usage.cached_tokens = prefilled.first.usage.cached_tokens
                        out.queue_s = prefilled.first.queue_s
                    if out.finish_reason:
                        done.add(out.index)
                    yield out
        except grpc.aio.AioRpcError as e:
            if e.code() not in CALLER_CODES:
                self.pool.failed(decode, e)
            raise from_worker(e, decode.address) from e
        finally:
            call.cancel()  # no-op when finished; frees the reservation otherwise
            decode.in_flight -= 1
            decode.context_tokens -= context

    def _place(self, wreq: worker_pb2.WorkerGenerateRequest, decode: Worker,
               reservation: worker_pb2.Reservation) -> str:
        """Why the prompt is computed on the decode worker ("local" when the worker
        chose so itself, else the rule's reason); "" when a prefill worker computes it."""
        if reservation.local:
            return "local"
        serving = self.pool.serving("prefill")
        prefill = [w for w in serving if same_kv(w, decode)]
        if serving and not prefill:  # its KV would be refused: compute it here
            self.chooser.metrics.inc("prefill_placement_total", where="local",
                                     reason="kv_mismatch")
            if (decode.address, decode.model_id) not in self._unpaired:
                self._unpaired.add((decode.address, decode.model_id))
                log.warning(
                    "decode worker %s (%s) has no prefill worker of its model, dtype and KV "
                    "cache format (prefill workers: %s): it computes its prompts itself; "
                    "start both pools with the same --dtype and --kv-cache-dtype",
                    decode.address, decode.model_id,
                    ", ".join(f"{w.address} ({w.model_id})" for w in serving))
            return "local_kv_mismatch"
        if self._prefill_queue_full(prefill):
            self.chooser.metrics.inc("prefill_placement_total", where="local",
                                     reason="prefill_queue")
            return "local_prefill_queue"
        if self._held_while_short(prefill, wreq, decode, reservation):
            self.chooser.metrics.inc("prefill_placement_total", where="local",
                                     reason="prefill_short")
            return "local_prefill_short"
        if self.placement is None or not prefill:
            return ""
        cached = reservation.cached_tokens
        here, reason = self.placement.decide(PlacementInputs(
            uncached_tokens=len(wreq.prompt_token_ids) - cached, cached_tokens=cached,
            decode_running=decode.in_flight - 1,
            decode_context_tokens=decode.context_tokens - len(wreq.prompt_token_ids),
            prefill_queued_tokens=min(w.queued_tokens for w in prefill)))
        self.chooser.metrics.inc("prefill_placement_total", where="local" if here else "remote",
                                 reason=reason)
        return f"local_{reason}" if here else ""

    def _prefill_queue_full(self, prefill: list[Worker]) -> bool:
        """The overflow: every prefill worker that is up (a lost one takes nothing) has
        ``prefill_queue_limit`` of this router's prompts in flight. Off (0): no work."""
        limit = self.pool.config.prefill_queue_limit
        if not limit or not prefill:
            return False
        now = time.monotonic()
        up = [w.in_flight for w in prefill if w.down_until <= now]
        return not up or min(up) >= limit

    def _held_while_short(self, prefill: list[Worker], wreq: worker_pb2.WorkerGenerateRequest,
                          decode: Worker, reservation: worker_pb2.Reservation) -> bool:
        """The overflow's other half: while the prefill pool is short of a worker
        (:meth:`~router.pool.WorkerPool.short`: one down or lost, or back or new with a
        cold cache), a prompt the decode worker already holds but for its last block is
        computed there. The lost worker's prompts are cold on its peers, which would compute them
        whole while short of a worker; the decode worker's step takes the few tokens it
        lacks. Only with the overflow on (``prefill_queue_limit``) and a prefill worker
        left that could take the prompt (``prefill``)."""
        if not self.pool.config.prefill_queue_limit or not prefill:
            return False
        uncached = len(wreq.prompt_token_ids) - reservation.cached_tokens
        if uncached > max(decode.block_size, 1):
            return False
        return self.pool.short("prefill", lambda w: same_kv(w, decode))

    async def _reserve(self, wreq: worker_pb2.WorkerGenerateRequest, deadline: float | None
                       ) -> tuple[Worker, grpc.aio.StreamStreamCall, worker_pb2.Reservation]:
        """Open Decode on the least-loaded decode worker that answers."""
        errors = []
        for worker in self.pool.by_load("decode"):
            timeout = _left(deadline)
            worker.in_flight += 1
            call = worker.stub.Decode(timeout=timeout)
            try:
                await call.write(worker_pb2.DecodeRequest(start=wreq))
                msg = await self.stalls.result(call.read(), worker, call.cancel)
                if msg is None:  # the worker stalled (router.stall): the next one
                    worker.in_flight -= 1
                    errors.append(f"{worker.address}: stalled")
                    continue
                if msg is grpc.aio.EOF or msg.WhichOneof("kind") != "reservation":
                    raise RouterError(grpc.StatusCode.UNAVAILABLE,
                                      f"decode worker {worker.address} sent no reservation")
                return worker, call, msg.reservation
            except grpc.aio.AioRpcError as e:
                call.cancel()
                worker.in_flight -= 1
                if e.code() in CALLER_CODES:
                    raise from_worker(e, worker.address) from e
                self.pool.failed(worker, e)
                errors.append(f"{worker.address}: {e.code().name}")
            except BaseException:
                call.cancel()
                worker.in_flight -= 1
                raise
        raise RouterError(grpc.StatusCode.UNAVAILABLE,
                          f"no decode worker could take the request ({'; '.join(errors)}); "
                          "retry later")

    async def _prefill(self, wreq: worker_pb2.WorkerGenerateRequest,
                       target: worker_pb2.KVTarget, deadline: float | None,
                       routing: api_pb2.Routing, hashes: PromptHashes | None,
                       decode: Worker) -> worker_pb2.PrefillResponse | None:
        """The first token from the prefill worker the policy picks among those whose KV
        ``decode`` accepts; None when it failed (the caller recomputes on the decode
        worker). Bad input raises."""
        worker, decision = await self.chooser.choose("prefill", wreq, hashes,
                                                     among=lambda w: same_kv(w, decode))
        _record(routing, decision)
        timeout = _left(deadline)
        queued = decision.estimated_tokens - worker.queued_tokens
        worker.in_flight += 1
        worker.queued_tokens += queued
        try:
            # None when the worker stalled meanwhile (router.stall): computed on decode.
            return await self.stalls.result(worker.stub.Prefill(
                worker_pb2.PrefillRequest(request=wreq, target=target), timeout=timeout),
                worker)
        except grpc.aio.AioRpcError as e:
            if e.code() in CALLER_CODES:
                raise from_worker(e, worker.address) from e
            self.pool.failed(worker, e)
            return None
        finally:
            worker.in_flight -= 1
            worker.queued_tokens -= queued


def same_kv(a: Worker, b: Worker) -> bool:
    """Whether KV moves between two workers: the same model, dtype and KV cache format
    (their ``model_id``, which seeds the block hashes; unknown matches anything) and the
    same block size (a CPU and a GPU worker left to their defaults differ). The decode
    worker refuses anything else, naming both (workers/transfer/header.py)."""
    return (not a.model_id or not b.model_id or a.model_id == b.model_id) \
        and a.block_size == b.block_size


_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]{0,63}): ")
"""The field a worker's INVALID_ARGUMENT names (``InvalidRequestError``'s "field: ...")."""


def from_worker(e: grpc.aio.AioRpcError, address: str) -> RouterError:
    """A worker's status as the router's: the caller's own codes pass through; anything
    else is the worker failing, which the router may answer by migrating."""
    code = e.code()
    if code in CALLER_CODES:
        details = e.details() or code.name
        field = _FIELD.match(details) if code == grpc.StatusCode.INVALID_ARGUMENT else None
        return RouterError(code, details, field.group(1) if field else None)
    return WorkerFailed(f"worker {address} failed: {code.name}: {e.details()}; retry the "
                        "request")


async def _read(call: grpc.aio.UnaryStreamCall | grpc.aio.StreamStreamCall,
                watched: Watched) -> Any:
    """The stream's next message (``grpc.aio.EOF`` at its end), stamped for the stall
    watch (:mod:`router.stall`). A read the watch cancelled because the worker stalled
    fails the attempt (``WorkerFailed``), which the router migrates with the tokens so
    far; a cancellation of the request itself passes through (told apart on Python 3.11+,
    ``Task.cancelling``; on 3.10 one that lands just after the watch's is taken for the
    stall, and the request moves once before its cancellation ends it)."""
    try:
        msg = await call.read()
    except (asyncio.CancelledError, grpc.aio.AioRpcError):
        if watched.stalled and not _cancelling():
            raise WorkerFailed(f"worker {watched.worker.address} stalled mid-stream: no "
                               "message and no answer to the stall probe") from None
        raise
    watched.last = time.monotonic()
    return msg


def _cancelling() -> bool:
    """Whether this task is being cancelled (Python 3.11+ can tell; 3.10 says no)."""
    task = asyncio.current_task()
    return bool(task is not None and getattr(task, "cancelling", lambda: 0)())


async def _write(call: grpc.aio.StreamStreamCall, msg: worker_pb2.DecodeRequest | None) -> None:
    """Write (None: done writing); a call the worker already ended raises its status."""
    try:
        await (call.done_writing() if msg is None else call.write(msg))
    except asyncio.InvalidStateError:
        await call.wait_for_connection()  # raises AioRpcError with the call's status
        raise grpc.aio.AioRpcError(await call.code(), grpc.aio.Metadata(),
                                   grpc.aio.Metadata(), await call.details()) from None


def _record(routing: api_pb2.Routing, d: Decision) -> None:
    routing.MergeFrom(api_pb2.Routing(policy=d.policy, reason=d.reason, worker=d.address,
                                      indexed_cached_tokens=d.cached_tokens,
                                      estimated_prefill_tokens=d.estimated_tokens))


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
    return left
