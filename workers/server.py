"""``pdserve worker``: one engine served over the internal gRPC API.

Lifecycle: bind HOST:PORT (port 0: one the OS picks), load the model and allocate the
KV cache (the slow part), start the engine thread (and the KV channel end of the role:
a sender on ``prefill``, a receiver hosting its rendezvous on ``decode``), serve
Prometheus ``/metrics`` (``--metrics-port``), mark gRPC health SERVING, register (with
``--redis-url``), serve until stopped, then mark NOT_SERVING. SIGTERM (what Kubernetes
sends; ``pdserve scale`` sets ``drain`` on the actor instead) drains first: leave the
registry, keep serving what was already routed here until nothing runs, waits or is in
transfer (at most ``drain_timeout_s``). SIGINT skips the drain. Then stop accepting,
abort what is left (freeing its blocks), close the channel and exit.

Calls: ``Generate`` (any role) runs a request here, a server stream; ``Prefill``
(prefill role) computes a prompt, returns its first token and sends the KV to the
decode worker's reservation; ``Decode`` (decode role) is the bidirectional stream of
a disaggregated request (worker.proto tells the message order); ``SetRole`` changes
the role in place, draining what the old role's KV channel end carries first, the
engine, its weights and the requests running there staying
(:mod:`workers.roles`, which also says who may call it). When a caller cancels
or its deadline passes, gRPC cancels the handler and the engine loop aborts the request,
freeing its blocks (reserved blocks once no transfer can write into them).

Errors: a request failing on its own (bad input, found at once or inside a step) ends
``INVALID_ARGUMENT`` and nothing else is touched; an engine failure ends every request
``UNAVAILABLE`` (the router retries elsewhere), turns gRPC health NOT_SERVING and takes
the worker out of the registry (:mod:`workers.engine_loop` tells which is which).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.metrics import Metrics
from common.registry import WorkerInfo
from common.request import Request
from common.sampling import InvalidRequestError
from common.served_steps import StepLog
from common.wire import FINISH_REASONS, KEEPALIVE_SERVER, MAX_MESSAGE_BYTES, request_from_proto
from protos.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from .config import WorkerConfig
from .engine.llm_engine import LLMEngine, RequestOutput
from .engine.model_runner import default_intra_op_threads
from .engine.sampler import TokenLogprobs
from .engine_loop import EngineLoop, EngineUnavailableError
from .kv_targets import KVTargets
from .metrics import WorkerMetrics
from .presence import Presence
from .reservation import Reservation
from .roles import RoleChangeError, RoleSwitch, channel_ends, wait_idle
from .step_trace import StepPublisher
from .transfer import (
    ChannelStats,
    EarlyOffer,
    KVReceiver,
    KVSender,
    TransferResult,
    TransferState,
)

log = logging.getLogger(__name__)

def to_proto(out: RequestOutput, first_index: int) -> worker_pb2.WorkerGenerateResponse:
    """An engine output as a stream message. A prefill worker's ``remote`` end carries
    usage but no finish reason: the request goes on elsewhere."""
    msg = worker_pb2.WorkerGenerateResponse(token_ids=out.new_token_ids, text=out.delta_text,
                                            index=out.index)
    if out.logprobs is not None:
        msg.logprobs.extend(map(_logprob, out.logprobs[first_index:]))
    if out.prompt_logprobs is not None:
        msg.prompt_logprobs.extend(map(_logprob, out.prompt_logprobs))
    if out.finished:
        if out.finish_reason != "remote":
            msg.finish_reason = FINISH_REASONS[out.finish_reason or "abort"]
        msg.usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(out.token_ids),
            cached_tokens=out.num_cached_tokens))
        if out.first_token_time is not None:
            msg.queue_s = max(0.0, out.first_token_time - out.arrival_time)
    return msg


def _logprob(lp: TokenLogprobs) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def _log_failed_send(result: TransferResult) -> None:
    if result.state is not TransferState.DONE:  # the decode side recomputes or migrates
        log.warning("KV send of %s ended %s: %s", result.request_id, result.state.value,
                    result.reason)


def stats_to_proto(stats: ChannelStats | None) -> common_pb2.TransferStats:
    if stats is None:
        return common_pb2.TransferStats()
    return common_pb2.TransferStats(entered=stats.entered, in_flight=stats.in_flight,
                                    bytes_moved=stats.bytes_moved,
                                    pairs_open=stats.pairs_open, busy_s=stats.busy_s)


def reservation_to_proto(r: Reservation) -> worker_pb2.Reservation:
    msg = worker_pb2.Reservation(local=r.local, cached_tokens=r.cached_tokens)
    if not r.local:
        msg.target.CopyFrom(worker_pb2.KVTarget(address=r.kv_address, skip_blocks=r.skip_blocks,
                                                block_ids=r.block_ids))
    return msg


def _status(e: InvalidRequestError | EngineUnavailableError) -> grpc.StatusCode:
    """The request's own fault, or this worker's (the router retries elsewhere)."""
    if isinstance(e, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.UNAVAILABLE


async def _typed(msg: worker_pb2.WorkerGenerateRequest, context) -> Request:  # noqa: ANN001
    """The request as the engine takes it; a bad value ends the call INVALID_ARGUMENT."""
    try:
        return request_from_proto(msg)
    except InvalidRequestError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        raise  # abort raises; this line only tells type checkers so


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, loop: EngineLoop, config: WorkerConfig,
                 sender: KVSender | None = None, receiver: KVReceiver | None = None,
                 targets: KVTargets | None = None) -> None:
        self._loop = loop
        self._config = config
        self._sender, self._receiver = sender, receiver
        self._targets = targets  # prefill: the decode workers KV may go to (None: any)
        self.roles: RoleSwitch | None = None  # SetRole's; None: the role is fixed

    def use(self, config: WorkerConfig, sender: KVSender | None, receiver: KVReceiver | None,
            targets: KVTargets | None) -> None:
        """The role's ends from now on (a role change, :mod:`workers.roles`)."""
        self._config, self._sender, self._receiver = config, sender, receiver
        self._targets = targets

    async def Prefill(self, request, context):  # noqa: N802
        if self._sender is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this worker's role is {self._config.role}, not prefill")
        req, target = await _typed(request.request, context), request.target
        if self._targets is not None and not await self._targets.allowed(target.address):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"KV target {target.address[:100]!r} is no decode worker the "
                                "registry lists; nothing was computed or sent")
        sender, loop, kv = self._sender, self._loop, self._loop.engine.kv_view()
        skip, dst = target.skip_blocks, list(target.block_ids)
        early: list[tuple[EarlyOffer, list[int]]] = []  # the offer made before the KV
        offer_when = sender.config.offer
        ended = threading.Lock()  # held by the call's end: no offer after it
        over = False

        def offer_kv(block_table: list[int]):  # noqa: ANN202 - engine thread, before the forward
            """Offer now; the forward then tells the offer of each layer done, whose KV
            goes while the next layers compute."""
            src = block_table[skip:]
            if len(src) != len(dst):  # send_kv logs it
                return None
            with ended:  # a call that ended (cancelled meanwhile) offers nothing
                if over:
                    return None
                offer = sender.offer_paged(target.address, req.request_id, kv.cache, src, dst,
                                           kv.block_size, kv_format=kv.kv_format,
                                           kv_digest=kv.kv_digest)
                early.append((offer, src))
            return offer.layers_done if offer_when == "layers" else None

        def send_kv(block_table: list[int], release) -> None:  # noqa: ANN001 - engine thread
            src = block_table[skip:]
            if len(src) != len(dst):  # the decode side recomputes after its commit wait
                log.error("request %s: %d blocks to send, the reservation holds %d",
                          req.request_id, len(src), len(dst))
                release()
                return
            if early:  # the KV is in the blocks offered: send it (a void one fails there)
                offer, offered = early[0]
                if offered != src:
                    log.error("request %s: its KV is not in the blocks offered early; the "
                              "decode side recomputes it", req.request_id)
                    offer.void()
                offer.go()
                handle = offer.handle
            else:
                try:  # read in place from the held blocks; released once the send ended
                    handle = sender.send_paged(target.address, req.request_id, kv.cache, src,
                                               dst, kv.block_size, kv_format=kv.kv_format,
                                               kv_digest=kv.kv_digest)
                except Exception:  # noqa: BLE001 - sender closed: the decode side recomputes
                    log.exception("request %s: cannot send its KV", req.request_id)
                    release()
                    return
            handle.add_done_callback(_log_failed_send)
            handle.add_quiesced_callback(lambda: loop.call_soon(release))

        last: dict[int, RequestOutput] = {}  # by choice
        try:
            async for out in self._loop.generate(
                    req, send_kv, offer_kv if offer_when != "after" else None):
                last[out.index] = out
        except (InvalidRequestError, EngineUnavailableError) as e:
            await context.abort(_status(e), str(e))
        finally:  # no KV follows an early offer the request's end left undecided
            with ended:
                over = True
            for offer, _ in early:
                offer.void()
        assert len(last) == req.n and all(out.finished for out in last.values())
        return worker_pb2.PrefillResponse(
            first=to_proto(last[0], 0), choices=[to_proto(last[i], 0) for i in range(1, req.n)])

    async def Decode(self, request_iterator, context):  # noqa: N802
        if self._receiver is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this worker's role is {self._config.role}, not decode")
        requests = request_iterator.__aiter__()
        first = await anext(requests, None)
        if first is None or first.WhichOneof("kind") != "start":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "Decode: the first message must be `start`")
        req = await _typed(first.start, context)
        # Should the role change after the check above, the reservation is local (the
        # engine loop places it with no receiver): computed here, not refused.
        commit, stream = self._loop.reserve(req, self._config.local_prefill_threshold)

        async def read_commit() -> None:
            msg = await anext(requests, None)  # the caller hung up without one: compute here
            ok = msg is not None and msg.WhichOneof("kind") == "commit"
            if ok and msg.commit.HasField("first_token"):
                commit(msg.commit.first_token, tuple(msg.commit.choice_tokens))
            else:
                commit(None)

        reader: asyncio.Task | None = None
        sent_logprobs: dict[int, int] = {}  # by choice
        try:
            async for item in stream:
                if isinstance(item, Reservation):
                    if not item.local:
                        reader = asyncio.create_task(read_commit())
                    yield worker_pb2.DecodeResponse(reservation=reservation_to_proto(item))
                    continue
                yield worker_pb2.DecodeResponse(
                    output=to_proto(item, sent_logprobs.get(item.index, 0)))
                sent_logprobs[item.index] = len(item.logprobs or ())
        except (InvalidRequestError, EngineUnavailableError) as e:
            await context.abort(_status(e), str(e))
        finally:
            if reader is not None:
                reader.cancel()

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        req = await _typed(request, context)
        sent_logprobs: dict[int, int] = {}  # by choice
        try:
            async for out in self._loop.generate(req):
                yield to_proto(out, sent_logprobs.get(out.index, 0))
                sent_logprobs[out.index] = len(out.logprobs or ())
        except (InvalidRequestError, EngineUnavailableError) as e:
            await context.abort(_status(e), str(e))

    async def GetLoad(self, request, context):  # noqa: N802
        load, cap = self._loop.load(), self._loop.engine.capacity()
        return worker_pb2.WorkerLoad(
            role=self._config.role, model=self._config.model_name,
            running_requests=load.running, waiting_requests=load.waiting,
            free_blocks=load.free_blocks, total_blocks=load.total_blocks,
            max_model_len=cap.max_model_len, reserved_requests=load.reserved,
            transfers=self.transfer_stats(), block_size=cap.block_size,
            model_id=cap.model_id, prompt_tokens=self._loop.counters.prompt_tokens,
            cached_prompt_tokens=self._loop.counters.cached_prompt_tokens)

    async def SetRole(self, request, context):  # noqa: N802
        if self.roles is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "this worker cannot change its role")
        cap = (request.prefill_tokens_while_decoding
               if request.HasField("prefill_tokens_while_decoding") else None)
        try:
            done = await self.roles.change(request.role, request.reason,
                                           request.drain_timeout_s or None, cap)
        except RoleChangeError as e:
            await context.abort(e.code, str(e))
        return worker_pb2.SetRoleResponse(
            role=done.role, previous_role=done.previous_role, drained_s=done.drained_s,
            kv_address=done.kv_address, prefill_tokens_while_decoding=done.prefill_cap)

    def channel_stats(self) -> ChannelStats | None:
        """This role's end of the KV channel's counters; None on a mixed worker."""
        end = self._sender or self._receiver
        return end.stats() if end is not None else None

    def transfer_stats(self) -> common_pb2.TransferStats:
        return stats_to_proto(self.channel_stats())


@dataclass(frozen=True)
class Serving:
    """What a started worker tells whoever launched it (a Ray actor, a test)."""

    address: str
    role: str
    metrics_port: int | None
    total_blocks: int


async def serve(config: WorkerConfig, on_ready: Callable[[Serving], None] | None = None,
                stop: asyncio.Event | None = None, drain: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (None: until SIGINT or SIGTERM). SIGTERM, or ``drain``
    set before ``stop``, drains first (see :func:`_drain`); SIGINT stops at once,
    aborting what is left."""
    server = grpc.aio.server(options=[  # the router's limit, so both ends agree
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0),
        *KEEPALIVE_SERVER])
    bind = f"{config.host}:{config.port}"
    port = (server.add_secure_port(bind, config.cluster_tls.server_credentials())
            if config.cluster_tls else server.add_insecure_port(bind))
    if port == 0:
        raise OSError(f"worker could not bind {config.host}:{config.port}: is the port in use?")
    config = dataclasses.replace(config, port=port)  # port 0: the one the OS picked
    address = f"{config.host}:{port}"
    presence = None
    if config.redis_url:
        presence = Presence(config.redis_url, config.model_name, address, config.registry_ttl_s)
    publisher, switch = None, []  # switch: the RoleSwitch, once there is one
    if config.publish_steps and presence is not None:
        publisher = StepPublisher(
            StepLog(presence.client, config.model_name),
            config.engine.num_threads or default_intra_op_threads(),
            lambda: switch[0].role if switch else config.role)
    # Built on the engine thread: the only thread with an intra-op team (EngineLoop).
    loop, end = channel_ends(
        config, lambda: LLMEngine(config.engine, [presence.publisher] if presence else ()),
        publisher)
    engine = loop.engine
    capacity = engine.capacity()
    targets = None
    if end.sender is not None and presence is not None:
        targets = KVTargets(presence.registry.live)
    elif end.sender is not None:
        log.warning("no registry: this prefill worker sends KV to whatever decode address a "
                    "Prefill call names (give --redis-url to check targets)")
    servicer = WorkerServicer(loop, config, end.sender, end.receiver, targets)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    metrics = Metrics({"model": config.model_name, "role": config.role, "worker": address},
                      ray=config.ray_metrics)
    sampler = WorkerMetrics(metrics, loop, servicer.channel_stats)
    info = WorkerInfo(address, config.role, address, capacity.num_blocks, capacity.block_size,
                      kv_address=end.kv_address)  # the registry entry; roles.info once started
    servicer.roles = roles = RoleSwitch(config, loop, end, servicer, presence, info, metrics,
                                        targets)
    switch.append(roles)
    metrics_port = (metrics.serve(config.metrics_port, config.host)
                    if config.metrics_port is not None else None)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_watch = asyncio.create_task(_not_serving_once_failed(loop, health_servicer))
    print(f"pdserve worker ({config.role}) serving {config.model_name} on {address} "
          f"({engine.dtype}, {capacity.num_blocks} KV blocks"
          + (f"; metrics on :{metrics_port}" if metrics_port else "") + ")",
          file=sys.stderr, flush=True)
    if stop is None:
        stop, drain = asyncio.Event(), asyncio.Event()
        aio = asyncio.get_running_loop()
        aio.add_signal_handler(signal.SIGINT, stop.set)
        aio.add_signal_handler(signal.SIGTERM, lambda: (drain.set(), stop.set()))
    if on_ready is not None:
        on_ready(Serving(address, config.role, metrics_port, capacity.num_blocks))
    beat_stop = asyncio.Event()
    heartbeat = None
    if presence is not None:
        def load() -> dict:
            now = loop.load()
            return {"running": now.running, "waiting": now.waiting,
                    "reserved": now.reserved, "free_blocks": now.free_blocks}

        heartbeat = asyncio.create_task(presence.run(roles.info, load, beat_stop,
                                                     lambda: loop.serving))
    sampling = asyncio.create_task(sampler.run(beat_stop))
    publish_stop = asyncio.Event()  # after the drain: its steps are served steps too
    publishing = (asyncio.create_task(publisher.run(publish_stop)) if publisher is not None
                  else None)
    await stop.wait()
    health_watch.cancel()
    beat_stop.set()
    if heartbeat is not None:
        await heartbeat
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    if drain is not None and drain.is_set():
        await _drain(config, loop, servicer, presence)
    await server.stop(grace=2)
    await sampling
    publish_stop.set()
    if publishing is not None:
        await publishing
    loop.close()
    roles.close()  # the current role's end of the KV channel
    if presence is not None:
        presence.close()
    metrics.close()


async def _not_serving_once_failed(loop: EngineLoop,
                                   health_servicer: health.aio.HealthServicer) -> None:
    """Health says NOT_SERVING from the moment the engine loop stops serving."""
    aio = asyncio.get_running_loop()
    failed = asyncio.Event()

    def on_failure(_reason: str) -> None:  # on the engine thread
        aio.call_soon_threadsafe(failed.set)

    loop.on_failure(on_failure)
    await failed.wait()
    log.error("the engine failed (%s): health is NOT_SERVING", loop.failure)
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)


async def _drain(config: WorkerConfig, loop: EngineLoop, servicer: WorkerServicer,
                 presence: Presence | None) -> None:
    """Leave the registry (routers stop choosing this worker within their discovery
    interval), keep serving what arrives for ``drain_grace_s``, then wait until nothing
    runs, waits, is reserved or is in transfer, at most ``drain_timeout_s``."""
    if presence is not None:
        await asyncio.to_thread(presence.leave)
    took = await wait_idle(loop, lambda: servicer.transfer_stats().in_flight,
                           config.drain_grace_s, config.drain_timeout_s)
    if took is not None:
        log.info("drained in %.1fs", took)
        return
    log.warning("drain timed out after %.0fs with requests left; aborting them",
                config.drain_timeout_s)
