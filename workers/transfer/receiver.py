"""The decode end: host the rendezvous, accept pairs, match offers to reservations.

Threads, all daemons:

- ``kvx-inbox``: pops the store's inbox in arrival order. A join is answered and its
  pair's process group (rank 1) opened on a short-lived ``kvx-open-<id>`` thread; a new
  pair from a prefill name replaces that name's old pair (a restarted prefill worker
  never leaves a stale one behind). An offer is matched with its reservation (or parked
  until the reservation arrives, at most ``offer_timeout_s``) and handed to a receive
  thread. A bye closes its pair;
- ``kvx-recv-<request>``, one per matched offer: checks it (refusal leaves the
  destination untouched), picks the framing, accepts, and lands the payload
  (:mod:`workers.transfer.landing`);
- ``kvx-house``: expires reservations nobody offered for and parked offers nobody
  reserved for.

Every reservation ends in DONE, FAILED or TIMED_OUT; none is left behind by a dead peer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from workers.transfer.blocks import KVDestination
from workers.transfer.channel import TransferConfig
from workers.transfer.header import (
    HeaderError,
    KVLayout,
    TransferHeader,
    check_offer,
    decode_offer,
    message_plan,
    request_id64,
)
from workers.transfer.landing import BufferPool, receive_direct, receive_staged, use_direct
from workers.transfer.rendezvous import (
    ACCEPT,
    ACCEPT_DIRECT,
    BYE_PREFIX,
    JOIN_PREFIX,
    REFUSE_PREFIX,
    ROOT,
    STOP,
    is_timeout,
    listen_store,
    new_process_group,
    pair_store,
    td,
)
from workers.transfer.state import (
    ChannelStats,
    StateCounters,
    TransferHandle,
    TransferState,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Reservation:
    handle: TransferHandle
    layout: KVLayout
    block_ids: list[int]
    destination: KVDestination
    deadline: float
    matched: bool = False


@dataclass(eq=False)
class _Offer:
    pair: _RecvPair
    header: TransferHeader
    block_ids: list[int]
    arrived: float = field(default_factory=time.monotonic)


class _RecvPair:
    """Rank 1 of one pair. Its store calls are quick ones on the receiver's client."""

    def __init__(self, owner: KVReceiver, pair_id: int, name: str, pg: dist.ProcessGroup,
                 pg_client: dist.Store):
        self.owner, self.pair_id, self.name, self.pg = owner, pair_id, name, pg
        self._pg_client = pg_client  # lives as long as the group
        self.store = pair_store(owner._root, pair_id)
        self.slots = threading.BoundedSemaphore(owner.config.pair_concurrency)
        self.closed: str | None = None
        self._lock = threading.Lock()

    def decide(self, seq: int, answer: bytes) -> bytes:
        """Set the transfer's decision unless the sender already cancelled, and wake the
        sender; returns the decision that holds."""
        held = self.store.compare_set(f"decision/{seq}", "", answer)
        if held == answer:
            self.store.queue_push("replies", str(seq).encode())
        return held

    @staticmethod
    def refuse_unknown(root: dist.Store, pair_id: int, seq: int, why: str) -> None:
        """Refuse an offer without its pair object (unknown, closed, or unparseable)."""
        store = pair_store(root, pair_id)
        reason = REFUSE_PREFIX + why.encode()
        try:
            if store.compare_set(f"decision/{seq}", "", reason) == reason:
                store.queue_push("replies", str(seq).encode())
        except Exception as e:  # noqa: BLE001
            log.warning("could not refuse transfer %d on unknown pair %d: %s", seq, pair_id, e)

    def refuse(self, seq: int, reason: str) -> None:
        try:
            self.decide(seq, REFUSE_PREFIX + reason.encode())
        except Exception as e:  # noqa: BLE001 - a refusal nobody reads is harmless
            log.warning("pair %d: could not refuse transfer %d (%s): %s", self.pair_id, seq,
                        reason, e)

    def close(self, reason: str) -> None:
        with self._lock:
            if self.closed is not None:
                return
            self.closed = reason
        log.info("transfer pair %d from %s closed: %s", self.pair_id, self.name, reason)
        try:
            self.store.set("closed", reason)
        except Exception:  # noqa: BLE001 - the store goes away with the receiver
            pass
        self.owner._forget_pair(self)


class KVReceiver:
    """Receives KV into reserved blocks. One per decode process; thread-safe.

    Construction binds the store on ``config.host:config.port`` and starts serving;
    ``address`` is what prefill workers send to. ``expect`` registers a reservation
    and never blocks.
    """

    def __init__(self, name: str, config: TransferConfig | None = None):
        self.name = name
        self.config = cfg = config or TransferConfig()
        self._counters = StateCounters()
        self._lock = threading.Lock()
        self._live: dict[int, _Reservation] = {}
        self._parked: dict[int, _Offer] = {}
        self._pairs: dict[int, _RecvPair] = {}
        self._by_name: dict[str, _RecvPair] = {}
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._buffers = BufferPool(cfg.wire_device, cfg.staging_pool_bytes)
        self._master: dist.TCPStore | None = listen_store(cfg.host, cfg.port,
                                                          cfg.connect_timeout_s)
        self.address = f"{cfg.host}:{self._master.port}"
        self._root = dist.PrefixStore(ROOT, self._master.clone())
        for target, tname in ((self._inbox_loop, "kvx-inbox"), (self._house_loop, "kvx-house")):
            t = threading.Thread(target=target, daemon=True, name=tname)
            t.start()
            self._threads.append(t)

    def expect(self, request_id: str, layout: KVLayout, block_ids: Sequence[int],
               destination: KVDestination, timeout_s: float | None = None) -> TransferHandle:
        """Reserve: accept one offer for ``request_id`` of ``len(block_ids)`` blocks of
        ``layout`` into exactly these block ids, from any pair, within ``timeout_s``
        (default ``expect_timeout_s``). The handle may be cancelled while PENDING or
        RECEIVING. Raises ValueError if the request already has a live reservation."""
        if not block_ids:
            raise ValueError(f"nothing to receive for {request_id!r}: no block ids")
        rid = request_id64(request_id)
        handle = TransferHandle(request_id, self._counters,
                                frozenset({TransferState.PENDING, TransferState.RECEIVING}))
        timeout = self.config.expect_timeout_s if timeout_s is None else timeout_s
        res = _Reservation(handle, layout, list(block_ids), destination,
                           time.monotonic() + timeout)
        with self._lock:
            if self._stop.is_set():
                handle.advance(TransferState.FAILED, "receiver closed")
                raise RuntimeError(f"KVReceiver {self.name!r} is closed")
            if rid in self._live:
                handle.advance(TransferState.FAILED, "duplicate reservation")
                raise ValueError(f"request {request_id!r} already has a live KV reservation")
            self._live[rid] = res
            offer = self._parked.pop(rid, None)
            if offer is not None:
                res.matched = True
        handle.add_done_callback(lambda _r: self._forget(rid, res))
        if offer is not None:
            self._start_receive(offer, res)
        return handle

    def live_transfers(self) -> int:
        """Reservations not yet terminal (a leak check expects 0 when idle)."""
        with self._lock:
            return len(self._live)

    def parked_offers(self) -> int:
        with self._lock:
            return len(self._parked)

    def stats(self) -> ChannelStats:
        with self._lock:
            pairs = len(self._pairs)
        return self._counters.snapshot(pairs)

    def close_pair(self, prefill_name: str, reason: str = "closed by the decode worker") -> bool:
        """Close the pair from ``prefill_name`` (e.g. the registry says it died)."""
        with self._lock:
            pair = self._by_name.get(prefill_name)
        if pair is None:
            return False
        pair.close(reason)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Fail every live reservation that can still be called back, close every pair,
        stop the threads, release the port. Receives in flight end by themselves within
        ``data_timeout_s`` per message (their handles then turn FAILED)."""
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()
            live = list(self._live.values())
            pairs = list(self._pairs.values())
        for res in live:  # a direct receive in flight ends by itself (data timeout)
            res.handle.cancel(f"decode receiver {self.name!r} closed")
        for pair in pairs:
            pair.close("decode receiver closed")
        try:
            self._root.queue_push("inbox", STOP)
        except Exception:  # noqa: BLE001
            pass
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(max(deadline - time.monotonic(), 0.0))
        self._root = None  # type: ignore[assignment]
        self._master = None  # the server stops when its last reference goes

    # --- pairs ------------------------------------------------------------------------

    def _inbox_loop(self) -> None:
        client = self._root.clone()
        client.set_timeout(td(self.config.idle_wait_s))
        while not self._stop.is_set():
            try:
                msg = client.queue_pop("inbox", True)
            except Exception as e:  # noqa: BLE001
                if is_timeout(e) and not self._stop.is_set():
                    continue  # idle
                return
            # typed by the first byte: "J"oin, "B"ye, "STOP", and offers, whose header
            # starts with its version byte (1), little-endian
            try:
                if msg == STOP:
                    return
                if msg.startswith(JOIN_PREFIX):
                    self._on_join(msg.removeprefix(JOIN_PREFIX))
                elif msg.startswith(BYE_PREFIX):
                    with self._lock:
                        pair = self._pairs.get(int(msg.removeprefix(BYE_PREFIX) or b"0"))
                    if pair is not None:
                        pair.close("the prefill worker closed the pair")
                else:
                    self._on_offer(msg)
            except Exception:  # noqa: BLE001 - one bad message must not stop the inbox
                log.exception("transfer inbox: cannot handle message %r", msg[:64])

    def _on_join(self, msg: bytes) -> None:
        parts = msg.decode(errors="replace").split(" ", 3)
        if len(parts) != 4 or parts[0] != "v1" or not parts[1].isdigit():
            log.warning("ignoring malformed join request %r", msg[:80])
            return
        pair_id, backend, name = int(parts[1]), parts[2], parts[3]
        if backend != self.config.backend:
            self._root.set(f"join/{pair_id}", REFUSE_PREFIX + f"backend {backend}, this decode "
                                              f"worker uses {self.config.backend}".encode())
            return
        self._root.set(f"join/{pair_id}", ACCEPT)
        threading.Thread(target=self._open_pair, args=(pair_id, name), daemon=True,
                         name=f"kvx-open-{pair_id}").start()

    def _open_pair(self, pair_id: int, name: str) -> None:
        cfg = self.config
        try:
            # its own client: the rendezvous blocks it for as long as the joiner takes
            pg_client = self._root.clone()
            keys = dist.PrefixStore("pg", pair_store(pg_client, pair_id))
            pg = new_process_group(cfg.backend, keys, 1, cfg.host, cfg.connect_timeout_s)
        except Exception as e:  # noqa: BLE001 - the joiner died or gave up: no pair
            log.warning("transfer pair %d from %s did not open: %s", pair_id, name, e)
            return
        pair = _RecvPair(self, pair_id, name, pg, pg_client)
        with self._lock:
            if self._stop.is_set():
                return
            old = self._by_name.get(name)
            self._pairs[pair_id] = pair
            self._by_name[name] = pair
        if old is not None:
            old.close(f"replaced by pair {pair_id} from the same prefill worker {name!r}")
        pair.store.set("ready", b"1")
        log.info("transfer pair %d open: %s -> %s (%s)", pair_id, name, self.name, cfg.backend)

    def _forget_pair(self, pair: _RecvPair) -> None:
        with self._lock:
            if self._pairs.get(pair.pair_id) is pair:
                del self._pairs[pair.pair_id]
            if self._by_name.get(pair.name) is pair:
                del self._by_name[pair.name]
            stale = [rid for rid, o in self._parked.items() if o.pair is pair]
            offers = [self._parked.pop(rid) for rid in stale]
        for o in offers:
            pair.refuse(o.header.seq, f"pair closed: {pair.closed}")

    def _forget(self, rid: int, res: _Reservation) -> None:
        with self._lock:
            if self._live.get(rid) is res:
                del self._live[rid]

    # --- offers -----------------------------------------------------------------------

    def _on_offer(self, msg: bytes) -> None:
        try:
            header, block_ids = decode_offer(msg)
        except HeaderError as e:
            log.warning("decode receiver %s: malformed offer: %s", self.name, e)
            if e.seq is not None and e.pair_id is not None:
                _RecvPair.refuse_unknown(self._root, e.pair_id, e.seq, f"malformed offer: {e}")
            return  # else the sender's own deadline ends its transfer
        with self._lock:
            pair = self._pairs.get(header.pair_id)
        if pair is None:
            # closed or never opened here: refuse on the pair's keys so the sender learns
            _RecvPair.refuse_unknown(self._root, header.pair_id, header.seq,
                                     "pair unknown or closed on this decode worker")
            return
        offer = _Offer(pair, header, block_ids)
        rid = header.request_id64
        with self._lock:
            res = self._live.get(rid)
            displaced = None
            if res is None:
                displaced = self._parked.get(rid)
                self._parked[rid] = offer
            elif res.matched:
                res = None
                displaced = offer
            else:
                res.matched = True
        if displaced is not None:
            displaced.pair.refuse(displaced.header.seq,
                                  "another offer for this request is already being received "
                                  "or has replaced this one")
        if res is not None:
            self._start_receive(offer, res)

    def _start_receive(self, offer: _Offer, res: _Reservation) -> None:
        threading.Thread(target=self._serve, args=(offer, res), daemon=True,
                         name=f"kvx-recv-{res.handle.request_id}").start()

    def _serve(self, offer: _Offer, res: _Reservation) -> None:
        pair, header, handle = offer.pair, offer.header, res.handle
        reason = check_offer(header, offer.block_ids, res.layout, res.block_ids,
                             self.config.max_payload_bytes)
        if reason is None and pair.closed is not None:
            reason = f"pair closed: {pair.closed}"
        if reason is not None:
            pair.refuse(header.seq, reason)
            handle.advance(TransferState.FAILED,
                           f"refused the offer from {pair.name!r} (pair {pair.pair_id}): {reason}")
            return
        if not pair.slots.acquire(timeout=self.config.offer_timeout_s):
            pair.refuse(header.seq, "decode worker busy")
            handle.advance(TransferState.FAILED, f"pair {pair.pair_id} stayed busy")
            return
        try:
            cfg = self.config
            direct = use_direct(header, offer.block_ids, res.destination, cfg.wire_device,
                                cfg.direct_min_bytes)
            # Direct receives write into the destination asynchronously; they cannot be
            # called back, so such a transfer is not cancellable once RECEIVING.
            if (direct and not handle.seal()) or not handle.advance(TransferState.RECEIVING):
                pair.refuse(header.seq, f"reservation already {handle.state.value}")
                return
            if pair.decide(header.seq, ACCEPT_DIRECT if direct else ACCEPT) not in (
                    ACCEPT, ACCEPT_DIRECT):
                handle.advance(TransferState.FAILED,
                               f"prefill worker {pair.name!r} withdrew the offer (it timed out "
                               "waiting for the accept)")
                return
            plan = message_plan(header, offer.block_ids, direct)
            if direct:
                receive_direct(pair.pg, header, plan, res.destination, handle,
                               cfg.data_timeout_s, cfg.wire_device)
            else:
                receive_staged(pair.pg, header, plan, res.destination, handle,
                               cfg.data_timeout_s, cfg.recv_window, self._buffers)
            self._counters.add_bytes(header.payload_bytes)
            handle.advance(TransferState.DONE, nbytes=header.payload_bytes)
        except Exception as e:  # noqa: BLE001 - every failure ends the transfer
            state = TransferState.TIMED_OUT if is_timeout(e) else TransferState.FAILED
            pair.close(f"transport error: {e}")
            handle.advance(state, f"payload from {pair.name!r} (pair {pair.pair_id}) broke: {e}")
        finally:
            pair.slots.release()

    # --- deadlines --------------------------------------------------------------------

    def _house_loop(self) -> None:
        cfg = self.config
        while not self._stop.wait(cfg.housekeeping_interval_s):
            now = time.monotonic()
            with self._lock:
                expired = [r for r in self._live.values() if not r.matched and r.deadline < now]
                stale = [(rid, o) for rid, o in self._parked.items()
                         if now - o.arrived > cfg.offer_timeout_s]
                for rid, _ in stale:
                    del self._parked[rid]
            for r in expired:
                r.handle.advance(TransferState.TIMED_OUT,
                                 f"no KV offer for {r.handle.request_id!r} reached decode "
                                 f"worker {self.name!r} before its deadline")
            for _, o in stale:
                o.pair.refuse(o.header.seq, "no reservation for this request on the decode "
                                            "worker")

