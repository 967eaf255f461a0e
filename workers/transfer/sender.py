"""The prefill end: open pairs on first use, offer, and send accepted payloads.

A send runs on its own daemon thread:

1. find the pair to the decode address, or open it (join, 2-rank process group, wait
   until the receiver registered it), each step bounded by ``connect_timeout_s``;
2. take one of the pair's in-flight slots, hash the payload (the offer carries its
   checksum, :mod:`workers.transfer.checksum`) and post the offer to the receiver's
   inbox;
3. wait for the decision, bounded by the send's timeout: the pair's reply thread wakes
   it when the receiver decided; on expiry it cancels with compare_set, and whichever of
   cancel and accept landed first holds;
4. on accept, send the payload messages in the framing the receiver chose, each wait
   bounded by ``data_timeout_s``.

An *early* offer (:meth:`KVSender.offer_paged`) runs steps 1-3 while the prefill's last
step still computes the KV, so the control path (thread start, pair, offer, accept:
~10 ms of hops on busy cores) is off the first->second token path. Its offer carries no
checksum (:data:`~workers.transfer.header.FLAG_TRAILER`); after the accept it waits
for its :class:`EarlyOffer` to be decided, at most ``early_go_timeout_s``: ``go`` sends
the payload, hashes it while it is on the wire and sends the checksum in a trailer;
``void`` (or no decision in time) sends zeros of the payload's size and a void (expired)
trailer, so the receiver's posted receives complete and the pair stays in step, and the
transfer ends CANCELLED (TIMED_OUT) on both ends.

With a cluster key the join, every offer and the bye are stamped and MACed, and the
decode side's accepts must carry its MAC (:mod:`workers.transfer.auth`): KV goes only to
a peer that holds the key, whatever address a caller named.

A transport error closes the pair; the next send to that address opens a fresh one (a
new pair id, so nothing stale can match). A pair the receiver closed before anything was
offered is replaced at once.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from queue import SimpleQueue
from typing import TypeVar

import torch
import torch.distributed as dist

from workers.transfer.auth import MAC_BYTES, ChannelAuth
from workers.transfer.blocks import PagedSource, TensorSource, gather_blocks
from workers.transfer.channel import ChannelError, TransferConfig
from workers.transfer.checksum import flip_one_byte, payload_checksum
from workers.transfer.header import (
    FLAG_TRAILER,
    TRAILER_EXPIRED,
    TRAILER_MESSAGE,
    TRAILER_OK,
    TRAILER_VOID,
    KVLayout,
    Message,
    TransferHeader,
    encode_offer,
    encode_trailer,
    message_plan,
    request_id64,
    tag_for,
)
from workers.transfer.rendezvous import (
    ACCEPT,
    ACCEPT_DIRECT,
    BYE_PREFIX,
    CANCEL,
    JOIN_PREFIX,
    REFUSE_PREFIX,
    ROOT,
    SIGNED_OFFER_PREFIX,
    STOP,
    connect_store,
    is_timeout,
    new_process_group,
    pair_store,
    parse_address,
    rendezvous_store,
    settle_when_resolved,
    td,
    wait_key,
)
from workers.transfer.state import (
    ChannelStats,
    StateCounters,
    TransferHandle,
    TransferResult,
    TransferState,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class _StoreCalls:
    """One daemon thread running a pair's store calls in order. Not a
    ThreadPoolExecutor: its threads are joined at exit, and a call hung on a silent peer
    would then hold the whole process."""

    def __init__(self, name: str) -> None:
        self._queue: SimpleQueue = SimpleQueue()
        self._closed = False
        threading.Thread(target=self._run, daemon=True, name=name).start()

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        if self._closed:
            raise ChannelError("the pair is closed")
        future: Future[T] = Future()
        self._queue.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Run what was submitted, then end (without waiting)."""
        self._closed = True
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)


class EarlyOffer:
    """A transfer offered before its KV exists (:meth:`KVSender.offer_paged`). Exactly
    one decision follows the accept, the first call holding: :meth:`go` (the KV is in
    the source blocks now: send the rest of it) or :meth:`void` (it will not be: the
    transfer ends CANCELLED, and no more of the blocks is read). Before either,
    :meth:`layers_done` may say that the first layers' KV is in the blocks already: their
    payload messages go at once, while the prefill computes the next layers (what is
    sent stays sent: a void after it still ends the transfer CANCELLED, the decode side
    discarding it all). All are safe from any thread; ``go`` and ``void`` return whether
    this call decided. No decision within ``early_go_timeout_s`` after the accept voids
    it as expired (TIMED_OUT)."""

    handle: TransferHandle
    """Set by :meth:`KVSender.offer_paged` before it returns the offer."""

    def __init__(self) -> None:
        self._cond = threading.Condition()  # reentrant: an expiry decides under it
        self.ready: bool | None = None
        self.go_time: float | None = None
        self.expired = False
        self._planes = 0  # planes (2 per layer) known to hold the KV before the decision

    def go(self) -> bool:
        return self._decide(True)

    def void(self) -> bool:
        return self._decide(False)

    def layers_done(self, layers: int) -> None:
        """Layers ``[0, layers)`` of the KV are in the source blocks (a prefill worker's
        forward says so after each layer)."""
        with self._cond:
            if self.ready is None and 2 * layers > self._planes:
                self._planes = 2 * layers
                self._cond.notify_all()

    def _decide(self, ready: bool, expired: bool = False) -> bool:
        with self._cond:
            if self.ready is not None:
                return False
            self.ready, self.go_time, self.expired = ready, time.monotonic(), expired
            self._cond.notify_all()
        return True

    def wait_planes(self, planes: float, deadline: float) -> bool:
        """Whether planes ``[0, planes)`` hold the KV, waiting until they do, a decision,
        or ``deadline`` (``time.monotonic()``; then it expires): True after ``go`` or
        once :meth:`layers_done` covers them, False after ``void`` or expiry."""
        with self._cond:
            while self.ready is None and self._planes < planes:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._decide(False, expired=True)
                    break
                self._cond.wait(left)
            return self.ready is not False

    def wait(self, deadline: float) -> bool:
        """The decision, waited for until ``deadline`` (none by then: expired): whether
        the KV is ready."""
        return self.wait_planes(math.inf, deadline) and bool(self.ready)


class _SendPair:
    """Rank 0 of one pair: its process group, its store calls, its reply thread."""

    def __init__(self, address: str, pair_id: int, pg: dist.ProcessGroup, root: dist.Store,
                 config: TransferConfig, auth: ChannelAuth | None = None,
                 session: bytes = b""):
        self.address, self.pair_id, self.pg, self.config = address, pair_id, pg, config
        self.auth, self.session = auth, session
        self.root = root  # quick calls only (one shared client)
        self.store = pair_store(root, pair_id)
        self.slots = threading.BoundedSemaphore(config.pair_concurrency)
        self._lock = threading.Lock()
        self._next_seq = 1
        self._waiters: dict[int, threading.Event] = {}
        self.broken: str | None = None
        # TCPStore's client has no receive timeout but for wait/get: a call to a decode
        # worker whose host went silent (a cut link, a node lost: no FIN, no RST) blocks
        # until TCP gives up, minutes later, holding the transfer's prefill blocks. So
        # the transfer path's store calls run here, each awaited for connect_timeout_s.
        self._calls = _StoreCalls(f"kvx-store-{pair_id}")
        self._replies = threading.Thread(target=self._reply_loop, daemon=True,
                                         name=f"kvx-replies-{pair_id}")
        self._replies.start()

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` (a call on this pair's store) within ``connect_timeout_s``, else
        ChannelError (a timeout); the call that hangs stays on the pair's store thread
        and every later one times out behind it: the pair is broken."""
        future = self._calls.submit(fn, *args)
        try:
            return future.result(timeout=self.config.connect_timeout_s)
        except FutureTimeout:
            raise ChannelError(f"the decode worker's store at {self.address} did not answer "
                               f"within {self.config.connect_timeout_s}s (timeout)") from None

    def next_seq(self) -> tuple[int, threading.Event]:
        """A new transfer number and the event its decision will set."""
        with self._lock:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            self._waiters[seq] = ev = threading.Event()
            return seq, ev

    def done(self, seq: int) -> None:
        with self._lock:
            self._waiters.pop(seq, None)

    def close(self, reason: str) -> None:
        """Mark broken, tell the receiver and stop the reply thread (best effort: the
        receiver may be gone)."""
        with self._lock:
            if self.broken is not None:
                return
            self.broken = reason
            waiters = list(self._waiters.values())
        for ev in waiters:
            ev.set()

        def tell() -> None:
            try:
                self.root.queue_push("inbox", self.signed(BYE_PREFIX, "bye",
                                                          str(self.pair_id)))
                self.store.queue_push("replies", STOP)
            except Exception:  # noqa: BLE001 - the peer's store may be dead; nothing to tell
                pass

        # Awaited as any store call is (a silent peer holds the caller connect_timeout_s
        # at most, see ``call``): once close returns, the peer was told and the reply
        # thread woken.
        told = self._calls.submit(tell)
        self._calls.shutdown()
        try:
            told.result(timeout=self.config.connect_timeout_s)
        except FutureTimeout:
            pass

    def signed(self, prefix: bytes, kind: str, body: str) -> bytes:
        """``prefix + body``, and its stamp when the channel is keyed."""
        if self.auth is None:
            return prefix + body.encode()
        stamp = self.auth.stamp(kind, self.address, self.session, body.encode())
        return prefix + f"{body} {stamp.to_text()}".encode()

    def offer(self, body: bytes) -> bytes:
        if self.auth is None:
            return body
        stamp = self.auth.stamp("offer", self.address, self.session, body)
        return SIGNED_OFFER_PREFIX + stamp.to_bytes() + body

    def trailer(self, seq: int, checksum: int, status: int) -> torch.Tensor:
        """An early transfer's trailer message, with its MAC when keyed."""
        body = encode_trailer(checksum, status)
        if self.auth is None:
            return body
        mac = self.auth.tag("trailer", self.address, self.session, self.pair_id, seq,
                            body.numpy().tobytes())
        return torch.cat([body, torch.frombuffer(bytearray(mac), dtype=torch.uint8)])

    def accepted(self, seq: int, answer: bytes) -> bytes | None:
        """ACCEPT or ACCEPT_DIRECT when ``answer`` is the receiver's accept of transfer
        ``seq`` (with its MAC, when keyed); None otherwise."""
        if self.auth is None:
            return answer if answer in (ACCEPT, ACCEPT_DIRECT) else None
        value, mac = answer[:-MAC_BYTES], answer[-MAC_BYTES:]
        if value in (ACCEPT, ACCEPT_DIRECT) and self.auth.check_tag(
                mac, "decision", self.address, self.session, self.pair_id, seq, value):
            return value
        return None

    def join_and_shutdown(self, timeout_s: float) -> None:
        """After :meth:`close`: wait for the reply thread, then shut the process group
        down, so no native thread is left running when the process exits."""
        self._replies.join(timeout_s)
        try:
            self.pg.shutdown()
        except Exception as e:  # noqa: BLE001 - best effort at exit
            log.debug("pair %d: process group shutdown: %s", self.pair_id, e)

    def _reply_loop(self) -> None:
        try:
            client = self.store.clone()
            client.set_timeout(td(self.config.idle_wait_s))
        except Exception as e:  # noqa: BLE001
            self.close(f"cannot watch replies: {e}")
            return
        while self.broken is None:
            try:
                msg = client.queue_pop("replies", True)
            except Exception as e:  # noqa: BLE001 - idle expiry: wait again; else broken
                if is_timeout(e):
                    continue
                self.close(f"decode worker's store unreachable: {e}")
                return
            if msg == STOP:
                if self.broken is not None:
                    return
                continue  # not ours: any store client can push one
            try:
                seq = int(msg)
            except ValueError:
                log.warning("pair %d: ignoring reply %r", self.pair_id, msg[:32])
                continue
            with self._lock:
                ev = self._waiters.get(seq)
            if ev is not None:
                ev.set()


class KVSender:
    """Sends KV to decode workers. One per prefill process; thread-safe.

    ``send`` never blocks on the network: it returns a PENDING handle at once and a
    daemon thread carries the transfer through its states.
    """

    def __init__(self, name: str, config: TransferConfig | None = None):
        self.name = name
        self.config = cfg = config or TransferConfig()
        if cfg.fault_flip_kv_byte:
            log.warning("KV sender %s: fault injection on: one byte of every transfer whose "
                        "request id contains %r is flipped on the wire", name,
                        cfg.fault_flip_kv_byte)
        self._auth = (ChannelAuth(cfg.auth_key, cfg.auth_max_skew_s, cfg.auth_max_nonces)
                      if cfg.auth_key is not None else None)
        self._counters = StateCounters()
        self._lock = threading.Lock()
        self._pairs: dict[str, _SendPair] = {}
        self._opening: dict[str, threading.Lock] = {}
        self._unreachable: dict[str, tuple[float, str]] = {}  # address -> (until, why)
        self._closed = False

    def send(self, address: str, request_id: str, block_ids: Sequence[int], kv: torch.Tensor,
             timeout_s: float | None = None, kv_format: str = "auto") -> TransferHandle:
        """Send ``kv`` ``[layers, 2, n, block_size, kv_heads, head_dim]`` into blocks
        ``block_ids`` reserved for ``request_id`` on the decode worker at ``address``.
        ``kv_format``: how the rows encode K/V (a quantized cache's rows are bytes; the
        receiver refuses a format other than its own).

        Bounds: opening a new pair ``connect_timeout_s`` per step; then ``timeout_s``
        (default ``offer_timeout_s``) for a free slot and the receiver's accept; then
        ``data_timeout_s`` per payload message. Keep ``kv`` unchanged until the handle
        is terminal. ``cancel`` works until the offer is posted. Raises ValueError for
        a malformed payload, RuntimeError once closed.
        """
        if kv.dim() != 6 or kv.shape[1] != 2 or kv.shape[2] != len(block_ids):
            raise ValueError(f"kv must be [layers, 2, {len(block_ids)}, block_size, kv_heads, "
                             f"head_dim] for {len(block_ids)} block ids, got {tuple(kv.shape)}")
        if not block_ids:
            raise ValueError(f"nothing to send for {request_id!r}: no block ids")
        layout = KVLayout(kv.shape[0], kv.shape[3], kv.shape[4], kv.shape[5], kv.dtype, kv_format)
        return self._start(address, request_id, layout, block_ids, TensorSource(kv), timeout_s)

    def send_paged(self, address: str, request_id: str, cache: torch.Tensor,
                   src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                   block_size: int, timeout_s: float | None = None,
                   kv_format: str = "auto", kv_digest: int = 0) -> TransferHandle:
        """Send ``src_block_ids`` of a paged cache into ``dst_block_ids`` without copying
        them first: payload messages are read from the cache (views where the source
        blocks form runs). The caller keeps the source blocks unchanged until the handle
        is terminal (a done callback is the place to release them). ``kv_format``: what
        the cache's rows store (``KVView.kv_format``), ``kv_digest`` its key transform's digest."""
        if len(src_block_ids) != len(dst_block_ids) or not src_block_ids:
            raise ValueError(f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} "
                             "target blocks")
        layout = KVLayout.of_cache(cache, block_size, kv_format, kv_digest)
        source = PagedSource(cache, src_block_ids, block_size)
        handle = self._start(address, request_id, layout, dst_block_ids, source, timeout_s)
        handle.add_done_callback(
            lambda r: self._counters.add_busy(r.seconds) if r.ok else None)
        return handle

    def offer_paged(self, address: str, request_id: str, cache: torch.Tensor,
                    src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                    block_size: int, timeout_s: float | None = None,
                    kv_format: str = "auto", kv_digest: int = 0) -> EarlyOffer:
        """As :meth:`send_paged`, but before the KV is in ``src_block_ids``: the pair,
        the offer and the accept go ahead now; the payload waits for the returned
        offer's ``go`` (after which the caller keeps the blocks unchanged until the
        handle is terminal, as for ``send_paged``). ``void`` ends the transfer CANCELLED,
        no decision within ``early_go_timeout_s`` after the accept TIMED_OUT, neither
        reading more of the blocks. The endpoint's ``busy_s`` counts from ``go`` to the end."""
        if len(src_block_ids) != len(dst_block_ids) or not src_block_ids:
            raise ValueError(f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} "
                             "target blocks")
        layout = KVLayout.of_cache(cache, block_size, kv_format, kv_digest)
        source = PagedSource(cache, src_block_ids, block_size)
        early = EarlyOffer()
        early.handle = self._start(address, request_id, layout, dst_block_ids, source,
                                   timeout_s, early)

        def busy(r: TransferResult) -> None:
            if r.ok and early.go_time is not None:
                self._counters.add_busy(time.monotonic() - early.go_time)

        early.handle.add_done_callback(busy)
        return early

    def _start(self, address: str, request_id: str, layout: KVLayout,
               block_ids: Sequence[int], source: TensorSource | PagedSource,
               timeout_s: float | None, early: EarlyOffer | None = None) -> TransferHandle:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"KVSender {self.name!r} is closed")
        handle = TransferHandle(request_id, self._counters)
        timeout = self.config.offer_timeout_s if timeout_s is None else timeout_s
        args = (handle, address, layout, list(block_ids), source, timeout, early)
        threading.Thread(target=self._run, args=args, daemon=True,
                         name=f"kvx-send-{request_id}").start()
        return handle

    def send_blocks(self, address: str, request_id: str, cache: torch.Tensor,
                    src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                    block_size: int, timeout_s: float | None = None,
                    kv_format: str = "auto") -> TransferHandle:
        """Gather ``src_block_ids`` of a paged cache now (so the caller may reuse them as
        soon as this returns) and send them into ``dst_block_ids``. The endpoint's
        ``busy_s`` counts from here (KV ready) to the transfer's end."""
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError(f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} "
                             "target blocks")
        started = time.monotonic()
        kv = gather_blocks(cache, src_block_ids, block_size)
        gathered = time.monotonic() - started
        handle = self.send(address, request_id, dst_block_ids, kv, timeout_s, kv_format)
        handle.add_done_callback(
            lambda r: self._counters.add_busy(r.seconds + gathered) if r.ok else None)
        return handle

    def stats(self) -> ChannelStats:
        with self._lock:
            pairs = sum(p.broken is None for p in self._pairs.values())
        return self._counters.snapshot(pairs)

    def close(self) -> None:
        """Close every pair (their receivers are told). In-flight payloads end by their
        own timeouts; new sends raise."""
        with self._lock:
            self._closed = True
            pairs, self._pairs = list(self._pairs.values()), {}
        for p in pairs:
            p.close(f"prefill worker {self.name!r} closed its sender")
        for p in pairs:  # let the reply threads leave their store waits, then end gloo's
            p.join_and_shutdown(timeout_s=2.0)

    # --- the transfer thread ---------------------------------------------------------

    def _run(self, handle: TransferHandle, address: str, layout: KVLayout,
             block_ids: list[int], source: TensorSource | PagedSource, timeout: float,
             early: EarlyOffer | None) -> None:
        # Two attempts: a pair the decode worker closed before we offered anything is
        # replaced by a fresh one at once (nothing was sent, so nothing can be doubled).
        for _attempt in range(2):
            try:
                pair = self._pair_for(address)
            except Exception as e:  # noqa: BLE001 - every failure ends the transfer
                state = TransferState.TIMED_OUT if is_timeout(e) else TransferState.FAILED
                handle.advance(state, f"cannot open a transfer pair from {self.name!r} to "
                                      f"the decode worker at {address}: {e}")
                return
            deadline = time.monotonic() + timeout
            if not pair.slots.acquire(timeout=timeout):
                handle.advance(TransferState.TIMED_OUT,
                               f"pair {pair.pair_id} to {address} stayed busy with "
                               f"{self.config.pair_concurrency} transfers for {timeout}s")
                return
            try:
                if self._offer_and_send(pair, handle, layout, block_ids, source, deadline,
                                        early):
                    return
            except Exception as e:  # noqa: BLE001
                state = TransferState.TIMED_OUT if is_timeout(e) else TransferState.FAILED
                pair.close(f"transport error: {e}")
                handle.advance(state, f"transfer to {address} (pair {pair.pair_id}) broke: {e}")
                return
            finally:
                pair.slots.release()
        handle.advance(TransferState.FAILED, f"the decode worker at {address} closed pair "
                                             f"{pair.pair_id} twice before an offer went out")

    def _offer_and_send(self, pair: _SendPair, handle: TransferHandle, layout: KVLayout,
                        block_ids: list[int], source: TensorSource | PagedSource,
                        deadline: float, early: EarlyOffer | None) -> bool:
        """Offer, wait for the decision, send (an early offer: wait for ``early`` to be
        decided first, and end with the trailer). False when the pair turned out closed
        before anything was offered (the caller retries on a new pair)."""
        if pair.broken is None and pair.call(pair.store.check, ["closed"]):
            pair.close("closed by the decode worker: "
                       + pair.call(pair.store.get, "closed").decode(errors="replace"))
        if pair.broken is not None:
            return False
        if early is not None and early.ready is False:
            handle.advance(TransferState.CANCELLED, "withdrawn before the offer went out: "
                                                    "the request ended without its KV")
            return True
        if not handle.seal():
            return True  # cancelled before the offer went out
        n = len(block_ids)
        chunk_planes = max(1, min(layout.num_planes,
                                  self.config.chunk_bytes // (n * layout.plane_block_bytes)))
        # before the framing is known; an early offer's comes in its trailer
        checksum = 0 if early is not None else payload_checksum(source.pieces())
        seq, decided = pair.next_seq()
        try:
            header = TransferHeader(request_id64(handle.request_id), seq, pair.pair_id, n,
                                    layout, layout.payload_bytes(n), chunk_planes, checksum,
                                    0 if early is None else FLAG_TRAILER)
            key = f"decision/{seq}"
            pair.call(pair.root.queue_push, "inbox", pair.offer(encode_offer(header, block_ids)))
            if decided.wait(max(deadline - time.monotonic(), 0.0)) and pair.broken is None:
                answer = pair.call(pair.store.get, key)
            else:  # first decision holds
                answer = pair.call(pair.store.compare_set, key, "", CANCEL)
            pair.call(pair.store.delete_key, key)
        finally:
            pair.done(seq)
        if answer == CANCEL:
            handle.advance(TransferState.TIMED_OUT,
                           f"decode worker at {pair.address} did not accept the offer for "
                           f"{handle.request_id!r} in time (no reservation, or busy)")
            return True
        if answer.startswith(REFUSE_PREFIX):
            handle.advance(TransferState.FAILED,
                           f"decode worker at {pair.address} refused {handle.request_id!r}: "
                           + answer.removeprefix(REFUSE_PREFIX).decode(errors="replace"))
            return True
        decision = pair.accepted(seq, answer)
        if decision is None:  # the pair is closed by the caller: nothing is sent on it
            raise ChannelError(f"decision {answer[:16]!r} for transfer {seq} is neither a "
                               "refusal nor an accept from the decode worker"
                               + (" (its MAC does not verify)" if pair.auth else ""))
        handle.advance(TransferState.SENDING)
        go_by = time.monotonic() + self.config.early_go_timeout_s
        on_wire = (lambda t: t) if self.config.backend == "nccl" else (lambda t: t.cpu())
        plan = message_plan(header, block_ids, direct=decision == ACCEPT_DIRECT)
        drop = bool(self.config.fault_drop_midway) and (
            self.config.fault_drop_midway in handle.request_id)
        if drop:  # fault injection: the link goes away after half the payload
            plan = plan[: len(plan) // 2]
        flip = bool(self.config.fault_flip_kv_byte) and (
            self.config.fault_flip_kv_byte in handle.request_id)

        def wire(i: int, m: Message) -> torch.Tensor:
            # an early offer's message waits for its layers' KV (or the decision)
            if early is not None and not early.wait_planes(m.p1, go_by):
                # void: filler of the message's size, the blocks left unread
                return torch.zeros((m.p1 - m.p0) * (m.i1 - m.i0) * layout.plane_block_bytes,
                                   dtype=torch.uint8, device=self.config.wire_device)
            t = on_wire(source.message(m.p0, m.p1, m.i0, m.i1))
            # fault injection: one byte of the first message corrupted, after the hash
            return flip_one_byte(t) if flip and i == 0 else t

        works: list[dist.Work] = []
        ready = True
        try:
            for i, m in enumerate(plan):
                works.append(pair.pg.send([wire(i, m)], 1, tag_for(seq, i)))
            if early is not None and not drop:  # hashed while the payload is on the wire
                ready = early.wait(go_by)
                status = (TRAILER_OK if ready else
                          TRAILER_EXPIRED if early.expired else TRAILER_VOID)
                trailer = pair.trailer(seq, payload_checksum(source.pieces()) if ready else 0,
                                       status)
                works.append(pair.pg.send([trailer.to(self.config.wire_device)], 1,
                                          tag_for(seq, TRAILER_MESSAGE)))
            for w in works:
                w.wait(td(self.config.data_timeout_s))
        except BaseException:  # the source may still be read until the posted sends resolve
            settle_when_resolved(handle, works, "send", self.config.data_timeout_s)
            raise
        if drop:
            raise ChannelError(f"fault injection: transfer of {handle.request_id!r} dropped "
                               f"after {len(plan)} payload messages")
        if not ready:  # an early offer voided or expired: its trailer said so
            if early is not None and early.expired:
                handle.advance(TransferState.TIMED_OUT, "the KV was not ready within "
                               f"early_go_timeout_s={self.config.early_go_timeout_s}s of the "
                               "accept (an expired trailer was sent)")
            else:
                handle.advance(TransferState.CANCELLED, "withdrawn after the accept: the "
                               "request ended without its KV (void trailer sent)")
            return True
        self._counters.add_bytes(header.payload_bytes)
        handle.advance(TransferState.DONE, nbytes=header.payload_bytes)
        return True

    # --- pairs ------------------------------------------------------------------------

    def _check_reachable(self, address: str) -> None:
        """A failed join marks the address for ``connect_timeout_s``: sends queued behind
        it fail at once instead of each waiting out its own connect timeout."""
        until, why = self._unreachable.get(address, (0.0, ""))
        if time.monotonic() < until:
            raise ChannelError(f"the decode worker at {address} was unreachable just now: {why}")

    def _pair_for(self, address: str) -> _SendPair:
        with self._lock:
            if self._closed:
                raise ChannelError("sender closed")
            pair = self._pairs.get(address)
            if pair is not None and pair.broken is None:
                return pair
            self._check_reachable(address)
            opening = self._opening.setdefault(address, threading.Lock())
        # a join is at most four steps of connect_timeout_s each
        if not opening.acquire(timeout=4 * self.config.connect_timeout_s):
            raise ChannelError("timed out waiting for another send to open the pair")
        try:
            with self._lock:
                pair = self._pairs.get(address)
                if pair is not None and pair.broken is None:
                    return pair
                self._check_reachable(address)
            try:
                pair = self._join(address)
            except Exception as e:
                with self._lock:
                    self._unreachable[address] = (
                        time.monotonic() + self.config.connect_timeout_s, str(e)[:200])
                raise
            with self._lock:
                if self._closed:
                    pair.close("sender closed while opening")
                    raise ChannelError("sender closed")
                self._pairs[address] = pair
            return pair
        finally:
            opening.release()

    def _join(self, address: str) -> _SendPair:
        cfg = self.config
        host, port = parse_address(address)
        root = dist.PrefixStore(ROOT, connect_store(host, port, cfg.connect_timeout_s))
        pair_id = root.add("pair_seq", 1)
        session, join = self.join_message(address, pair_id)
        root.queue_push("inbox", join)
        answer = wait_key(root, f"join/{pair_id}", cfg.connect_timeout_s)
        if answer is None:
            raise ChannelError(f"decode worker did not answer join {pair_id} within "
                               f"{cfg.connect_timeout_s}s (timeout)")
        if answer.startswith(REFUSE_PREFIX):
            raise ChannelError("join refused: "
                               + answer.removeprefix(REFUSE_PREFIX).decode(errors="replace"))
        expected = ACCEPT if self._auth is None else ACCEPT + self._auth.tag(
            "join-accept", address, session, pair_id)
        if answer != expected:
            raise ChannelError(f"the answer to join {pair_id} from {address} is not an accept "
                               + ("signed with this cluster's secret; sending nothing there"
                                  if self._auth else f"({answer[:16]!r})"))
        # The client is ours alone until the pair exists, so the rendezvous may block it.
        keys = pair_store(root, pair_id)
        pg = new_process_group(cfg.backend,
                               rendezvous_store(keys, self._auth, address, session, pair_id),
                               0, cfg.host, cfg.connect_timeout_s)
        if wait_key(keys, "ready", cfg.connect_timeout_s) is None:
            raise ChannelError(f"decode worker did not register pair {pair_id} (timeout)")
        log.info("transfer pair %d open: %s -> %s (%s)", pair_id, self.name, address,
                 cfg.backend)
        return _SendPair(address, pair_id, pg, root, cfg, self._auth, session)

    def join_message(self, address: str, pair_id: int) -> tuple[bytes, bytes]:
        """(session, the inbox message asking the decode worker at ``address`` for pair
        ``pair_id``): ``J v1 <id> <backend> <name>``, or with a key ``J v2 <id> <backend>
        <stamp> <name>``, whose nonce is the pair's session."""
        backend = self.config.backend
        if self._auth is None:
            return b"", JOIN_PREFIX + f"v1 {pair_id} {backend} {self.name}".encode()
        stamp = self._auth.stamp("join", address, b"", f"{pair_id} {backend} {self.name}".encode())
        return stamp.nonce, JOIN_PREFIX + (f"v2 {pair_id} {backend} {stamp.to_text()} "
                                           f"{self.name}").encode()
