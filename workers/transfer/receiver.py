"""The decode end: host the rendezvous, accept pairs, match offers to reservations.

Threads, all daemons:

- ``kvx-inbox``: pops the store's inbox in arrival order. A join is answered and its
  pair's process group (rank 1) opened on a short-lived ``kvx-open-<id>`` thread; a new
  pair from a prefill name replaces that name's old pair (a restarted prefill worker
  never leaves a stale one behind). An offer is matched with its reservation (or parked
  until the reservation arrives, at most ``offer_timeout_s``) and handed to a receive
  thread. A bye closes its pair, which ends every transfer still landing on it
  (FAILED, its memory held until its receive thread lets go);
- ``kvx-recv-<request>``, one per matched offer: checks it (refusal leaves the
  destination untouched), picks the framing, accepts, lands the payload
  (:mod:`workers.transfer.landing`) and compares its checksum with the offer's (an
  early offer's: the trailer's, which may instead say the payload is void: CANCELLED,
  or expired: TIMED_OUT): a
  mismatch ends the transfer FAILED, counted in ``stats().checksum_failures``;
- ``kvx-house``: expires reservations nobody offered for and parked offers nobody
  reserved for.

Every reservation ends in DONE, FAILED or TIMED_OUT; none is left behind by a dead peer.

Trust (with ``TransferConfig.auth_key``; :mod:`workers.transfer.auth`): a join, offer or
bye whose MAC, timestamp or nonce fails is logged, counted (``stats().refused``) and
dropped before it touches any state: no pair is opened, no offer is matched, no pair is
closed for it. Accepts are MACed for the prefill side to check. Bounds: ``max_pairs``
open pairs (at the bound a join replaces the pair idle longest), ``max_parked_offers``
offers waiting for a reservation, ``max_reservations`` reservations.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from workers.transfer.auth import MAC_BYTES, STAMP_BYTES, AuthError, ChannelAuth, Stamp
from workers.transfer.blocks import KVDestination
from workers.transfer.channel import ChannelError, TransferConfig
from workers.transfer.header import (
    TRAILER_BYTES,
    TRAILER_EXPIRED,
    TRAILER_MESSAGE,
    TRAILER_VOID,
    HeaderError,
    KVLayout,
    TransferHeader,
    check_offer,
    decode_offer,
    decode_trailer,
    message_plan,
    request_id64,
    tag_for,
)
from workers.transfer.landing import BufferPool, receive_direct, receive_staged, use_direct
from workers.transfer.rendezvous import (
    ACCEPT,
    ACCEPT_DIRECT,
    BYE_PREFIX,
    JOIN_PREFIX,
    REFUSE_PREFIX,
    ROOT,
    SIGNED_OFFER_PREFIX,
    STOP,
    is_timeout,
    listen_store,
    new_process_group,
    pair_store,
    rendezvous_store,
    td,
)
from workers.transfer.state import (
    ChannelStats,
    StateCounters,
    TransferHandle,
    TransferState,
)

log = logging.getLogger(__name__)

BYE_GRACE_S = 1.0
"""How long the transfers landing on a pair outlive its bye: what the sender had sent
before it (a drained prefill worker's last payloads) may still be on the wire."""


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
                 pg_client: dist.Store, session: bytes = b""):
        self.owner, self.pair_id, self.name, self.pg = owner, pair_id, name, pg
        self.session = session  # the join's nonce: what this pair's MACs are bound to
        self._pg_client = pg_client  # lives as long as the group
        self.store = pair_store(owner._root, pair_id)
        self.slots = threading.BoundedSemaphore(owner.config.pair_concurrency)
        self.closed: str | None = None
        self.last_used = time.monotonic()
        self.receiving = 0  # receive threads on this pair (owner's lock)
        self._lock = threading.Lock()
        # The transfers of this pair's receive threads, and the settle of each one the
        # pair's close abandoned (called as its thread leaves: its memory is free then).
        self._serving: dict[TransferHandle, Callable[[], None] | None] = {}
        self._landed: set[TransferHandle] = set()

    def decide(self, seq: int, answer: bytes) -> bool:
        """Set the transfer's decision unless the sender already cancelled (or anyone
        else wrote one), and wake the sender; True when ours holds. An accept carries
        its MAC when the channel is keyed."""
        auth = self.owner._auth
        value = answer
        if auth is not None and answer in (ACCEPT, ACCEPT_DIRECT):
            value += auth.tag("decision", self.owner.address, self.session, self.pair_id, seq,
                              answer)
        held = self.store.compare_set(f"decision/{seq}", "", value)
        if held == value:
            self.store.queue_push("replies", str(seq).encode())
        return held == value

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

    @contextmanager
    def serving(self, handle: TransferHandle) -> Iterator[None]:
        """Held by a receive thread for as long as it may end ``handle``; see
        :meth:`landed` for the memory."""
        with self._lock:
            self._serving[handle] = None
        try:
            yield
        finally:
            with self._lock:
                settle = self._serving.pop(handle)
                self._landed.discard(handle)
            if settle is not None:
                settle()

    def landed(self, handle: TransferHandle) -> None:
        """The payload is in and no receive is posted into the destination any more (what
        is left, a checksum or an early offer's trailer, touches none of it): an abandon
        from now on holds no memory, and one before lets go of it now."""
        with self._lock:
            self._landed.add(handle)
            settle, self._serving[handle] = self._serving[handle], None
        if settle is not None:
            settle()

    def close(self, reason: str, grace_s: float = 0.0,
              but: TransferHandle | None = None) -> None:
        """Closed for good: no offer is accepted on it any more, and every transfer still
        landing on it ends FAILED, whatever its receive thread still waits on, at once or
        after ``grace_s`` (a bye's: what the sender sent before it may still be on the
        way). A posted gloo receive may outlive its peer's close by a whole wait: on a
        lossy link an early offer's first message or trailer, waiting ``data_timeout_s +
        early_go_timeout_s``, was seen to miss the connection's reset (a CI run's request
        held 65 s). Its request now computes the prompt at once; the blocks stay held
        while a receive may still write them. ``but``: the caller's own transfer, which
        it ends itself."""
        with self._lock:
            if self.closed is not None:
                return
            self.closed = reason
        log.info("transfer pair %d from %s closed: %s", self.pair_id, self.name, reason)
        if grace_s > 0:
            timer = threading.Timer(grace_s, self._abandon_serving, args=(reason, but))
            timer.daemon = True
            timer.start()
        else:
            self._abandon_serving(reason, but)
        try:
            self.store.set("closed", reason)
        except Exception:  # noqa: BLE001 - the store goes away with the receiver
            pass
        self.owner._forget_pair(self)

    def _abandon_serving(self, reason: str, but: TransferHandle | None) -> None:
        with self._lock:
            serving = [(h, h in self._landed) for h in self._serving if h is not but]
        for handle, landed in serving:
            settle = handle.abandon(f"pair {self.pair_id} from {self.name!r} closed under "
                                    f"the transfer: {reason}", hold=not landed)
            if settle is None:
                continue
            with self._lock:  # still landing: its thread settles it (landed, or leaving)
                if handle in self._serving and handle not in self._landed:
                    self._serving[handle], settle = settle, None
            if settle is not None:  # landed or gone meanwhile: nothing to hold
                settle()


class KVReceiver:
    """Receives KV into reserved blocks. One per decode process; thread-safe.

    Construction binds the store on ``config.host:config.port`` and starts serving;
    ``address`` is what prefill workers send to. ``expect`` registers a reservation
    and never blocks.
    """

    def __init__(self, name: str, config: TransferConfig | None = None):
        self.name = name
        self.config = cfg = config or TransferConfig()
        self._auth = (ChannelAuth(cfg.auth_key, cfg.auth_max_skew_s, cfg.auth_max_nonces)
                      if cfg.auth_key is not None else None)
        self._counters = StateCounters()
        self._lock = threading.Lock()
        self._opening = 0  # joins accepted whose process group is not up yet
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
        if self._auth is None:
            log.warning("KV receiver %s at %s: no cluster secret, so joins and offers are not "
                        "authenticated: any process that reaches this port can open a pair "
                        "and offer KV (give --cluster-secret-file or --cluster-tls-dir)",
                        name, self.address)
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
            if len(self._live) >= self.config.max_reservations:
                handle.advance(TransferState.FAILED, "too many reservations")
                raise RuntimeError(f"KVReceiver {self.name!r} holds max_reservations="
                                   f"{self.config.max_reservations} reservations already")
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
        """Fail every live reservation that can still be called back, close every pair
        (which fails the receives in flight on it; their threads let go of the memory
        within ``data_timeout_s`` per message), stop the threads, release the port."""
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
            # starts with its version byte (header.VERSION), little-endian
            try:
                if msg == STOP:
                    if self._stop.is_set():
                        return
                    self._refuse("stop", "a STOP this receiver did not send")
                elif msg.startswith(JOIN_PREFIX):
                    self._on_join(msg.removeprefix(JOIN_PREFIX))
                elif msg.startswith(BYE_PREFIX):
                    self._on_bye(msg.removeprefix(BYE_PREFIX))
                elif msg.startswith(SIGNED_OFFER_PREFIX):
                    stamp = Stamp.from_bytes(msg[1:1 + STAMP_BYTES])
                    self._on_offer(msg[1 + STAMP_BYTES:], stamp)
                else:
                    self._on_offer(msg, None)
            except AuthError as e:
                self._refuse(e.kind, f"message {msg[:24]!r}: {e}")
            except Exception:  # noqa: BLE001 - one bad message must not stop the inbox
                log.exception("transfer inbox: cannot handle message %r", msg[:64])

    def _refuse(self, why: str, what: str) -> None:
        """Count and log a control message that is dropped unacted on."""
        self._counters.refuse(why)
        log.warning("decode receiver %s refused %s (%s)", self.name, what, why)

    def _on_bye(self, msg: bytes) -> None:
        parts = msg.decode(errors="replace").split(" ")
        if not parts[0].isdigit():
            raise AuthError("malformed", "bye without a pair id")
        with self._lock:
            pair = self._pairs.get(int(parts[0]))
        if pair is None:
            return
        if self._auth is not None:
            if len(parts) != 4:
                raise AuthError("unauthenticated", f"unsigned bye for pair {parts[0]}")
            self._auth.verify(Stamp.from_text(*parts[1:]), "bye", self.address, pair.session,
                              parts[0].encode())
        pair.close("the prefill worker closed the pair", grace_s=BYE_GRACE_S)

    def _on_join(self, msg: bytes) -> None:
        """``v1 <id> <backend> <name>`` (no key), or ``v2 <id> <backend> <ts> <nonce>
        <mac> <name>`` (keyed; the nonce becomes the pair's session). Verified before
        anything is allocated for it."""
        version, _, rest = msg.decode(errors="replace").partition(" ")
        parts = rest.split(" ", 2 if version == "v1" else 5)
        if version not in ("v1", "v2") or len(parts) != (3 if version == "v1" else 6) or (
                not parts[0].isdigit()):
            raise AuthError("malformed", f"malformed join request {msg[:80]!r}")
        pair_id, backend, name = int(parts[0]), parts[1], parts[-1]
        keyed = self._auth is not None
        if (version == "v2") != keyed:
            self._refuse("unauthenticated" if keyed else "unexpected_auth",
                         f"a {version} join for pair {pair_id} from {name!r}")
            self._answer_join(pair_id, None, REFUSE_PREFIX + (
                b"this decode worker accepts only joins authenticated with the cluster secret;"
                b" give the prefill worker the same --cluster-secret-file or --cluster-tls-dir"
                if keyed else b"this decode worker has no cluster secret; give both ends the "
                              b"same --cluster-secret-file or --cluster-tls-dir"))
            return
        session = b""
        if self._auth is not None:
            stamp = Stamp.from_text(*parts[2:5])
            try:
                self._auth.verify(stamp, "join", self.address, b"",
                                  f"{pair_id} {backend} {name}".encode())
            except AuthError as e:  # counted before the joiner can learn of it
                self._refuse(e.kind, f"join of pair {pair_id} from {name!r}: {e}")
                self._answer_join(pair_id, None, REFUSE_PREFIX + f"authentication: {e}".encode())
                return
            session = stamp.nonce
        if backend != self.config.backend:
            self._answer_join(pair_id, session, REFUSE_PREFIX + f"backend {backend}, this "
                              f"decode worker uses {self.config.backend}".encode())
            return
        victim = None
        with self._lock:
            if self._stop.is_set():
                return
            full = False
            if name not in self._by_name and (  # a rejoin replaces its own pair: no growth
                    len(self._pairs) + self._opening >= self.config.max_pairs):
                parked = {o.pair for o in self._parked.values()}
                idle = [p for p in self._pairs.values() if not p.receiving and p not in parked]
                victim = min(idle, key=lambda p: p.last_used, default=None)
                if victim is None:
                    full = True
                else:
                    del self._pairs[victim.pair_id]  # its slot is the new pair's
            if not full:
                self._opening += 1
        if full:
            self._refuse("pairs_full", f"join of pair {pair_id} from {name!r}")
            self._answer_join(pair_id, session, REFUSE_PREFIX + f"this decode worker has "
                              f"max_pairs={self.config.max_pairs} transfer pairs open, all "
                              "busy".encode())
            return
        if victim is not None:
            victim.close(f"idle longest while {self.config.max_pairs} pairs are open; "
                         f"replaced by pair {pair_id}")
        self._answer_join(pair_id, session, ACCEPT)
        threading.Thread(target=self._open_pair, args=(pair_id, name, session), daemon=True,
                         name=f"kvx-open-{pair_id}").start()

    def _answer_join(self, pair_id: int, session: bytes | None, answer: bytes) -> None:
        """Accept (with its MAC, keyed) or refuse; never over an answer already there (a
        replayed join must not overwrite the answer to the original)."""
        if answer == ACCEPT and self._auth is not None and session is not None:
            answer += self._auth.tag("join-accept", self.address, session, pair_id)
        self._root.compare_set(f"join/{pair_id}", "", answer)

    def _open_pair(self, pair_id: int, name: str, session: bytes) -> None:
        cfg = self.config
        try:
            try:
                # its own client: the rendezvous blocks it for as long as the joiner takes
                pg_client = self._root.clone()
                keys = rendezvous_store(pair_store(pg_client, pair_id), self._auth,
                                        self.address, session, pair_id)
                pg = new_process_group(cfg.backend, keys, 1, cfg.host, cfg.connect_timeout_s)
            except Exception as e:  # noqa: BLE001 - the joiner died or gave up: no pair
                log.warning("transfer pair %d from %s did not open: %s", pair_id, name, e)
                return
            pair = _RecvPair(self, pair_id, name, pg, pg_client, session)
            with self._lock:
                if self._stop.is_set():
                    return
                old = self._by_name.get(name)
                self._pairs[pair_id] = pair
                self._by_name[name] = pair
        finally:
            with self._lock:
                self._opening -= 1
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

    def _on_offer(self, msg: bytes, stamp: Stamp | None) -> None:
        """Parse (integers only), find the pair, verify (keyed: before anything is done
        for it but an unsigned refusal, which can only stop a transfer), then match it
        with its reservation or park it."""
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
        if self._auth is not None:
            if stamp is None:
                raise AuthError("unauthenticated", f"unsigned offer on pair {header.pair_id}")
            self._auth.verify(stamp, "offer", self.address, pair.session, msg)
        pair.last_used = time.monotonic()
        offer = _Offer(pair, header, block_ids)
        rid = header.request_id64
        with self._lock:
            res = self._live.get(rid)
            displaced = None
            full = res is None and rid not in self._parked and (
                len(self._parked) >= self.config.max_parked_offers)
            if full:
                pass
            elif res is None:
                displaced = self._parked.get(rid)
                self._parked[rid] = offer
            elif res.matched:
                res = None
                displaced = offer
            else:
                res.matched = True
        if full:
            self._counters.refuse("parked_full")
            pair.refuse(header.seq, f"no reservation yet, and max_parked_offers="
                                    f"{self.config.max_parked_offers} offers already wait for "
                                    "theirs")
            return
        if displaced is not None:
            displaced.pair.refuse(displaced.header.seq,
                                  "another offer for this request is already being received "
                                  "or has replaced this one")
        if res is not None:
            self._start_receive(offer, res)

    def _start_receive(self, offer: _Offer, res: _Reservation) -> None:
        with self._lock:
            offer.pair.receiving += 1
        threading.Thread(target=self._serve_counted, args=(offer, res), daemon=True,
                         name=f"kvx-recv-{res.handle.request_id}").start()

    def _serve_counted(self, offer: _Offer, res: _Reservation) -> None:
        try:
            with offer.pair.serving(res.handle):
                self._serve(offer, res)
        finally:
            with self._lock:
                offer.pair.receiving -= 1

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
            if not pair.decide(header.seq, ACCEPT_DIRECT if direct else ACCEPT):
                handle.advance(TransferState.FAILED,
                               f"prefill worker {pair.name!r} withdrew the offer (it timed out "
                               "waiting for the accept)")
                return
            plan = message_plan(header, offer.block_ids, direct)
            # An early offer's first message follows the prefill's first layer, and its
            # trailer the prefill's decision: those two may also wait for the sender's
            # early_go_timeout_s. Between them a message waits a layer's compute at most
            # (a link that died midway is found within data_timeout_s, as before).
            wait_s = cfg.data_timeout_s + (cfg.early_go_timeout_s if header.trailer else 0)
            if direct:
                landed = receive_direct(pair.pg, header, plan, res.destination, handle,
                                        cfg.data_timeout_s, cfg.wire_device, wait_s)
            else:
                landed = receive_staged(pair.pg, header, plan, res.destination, handle,
                                        cfg.data_timeout_s, cfg.recv_window, self._buffers,
                                        wait_s)
            pair.landed(handle)  # no receive posted into the destination any more
            expected = header.payload_checksum
            if header.trailer:  # posted after the payload's: NCCL matches in posting order
                expected, status = self._read_trailer(pair, header, wait_s)
                if status == TRAILER_VOID:
                    handle.advance(TransferState.CANCELLED,
                                   f"the prefill worker {pair.name!r} withdrew the KV of its "
                                   "early offer (the request ended without it)")
                    return
                if status == TRAILER_EXPIRED:
                    handle.advance(TransferState.TIMED_OUT,
                                   f"the prefill worker {pair.name!r} did not have the KV of "
                                   "its early offer ready in time")
                    return
            if landed != expected:  # the pair is in step: it stays open
                self._checksum_failed(pair, header, handle, landed, expected)
                return
            if handle.state is TransferState.RECEIVING:  # a closed pair's ended FAILED
                self._counters.add_bytes(header.payload_bytes)
            handle.advance(TransferState.DONE, nbytes=header.payload_bytes)
        except Exception as e:  # noqa: BLE001 - every failure ends the transfer
            state = TransferState.TIMED_OUT if is_timeout(e) else TransferState.FAILED
            # the pair first (whoever sees this transfer end sees its pair closed), and
            # the others landing on it with it; this one ends with its own reason
            pair.close(f"transport error: {e}", but=handle)
            handle.advance(state, f"payload from {pair.name!r} (pair {pair.pair_id}) broke: {e}")
        finally:
            pair.slots.release()

    def _read_trailer(self, pair: _RecvPair, header: TransferHeader, wait_s: float
                      ) -> tuple[int, int]:
        """(checksum, status) from an early offer's trailer, its MAC checked when keyed;
        raises ChannelError (the caller closes the pair) for one that does not verify."""
        size = TRAILER_BYTES + (MAC_BYTES if self._auth is not None else 0)
        buf = torch.empty(size, dtype=torch.uint8, device=self.config.wire_device)
        pair.pg.recv([buf], 0, tag_for(header.seq, TRAILER_MESSAGE)).wait(td(wait_s))
        data = buf.cpu().numpy().tobytes()
        body, mac = data[:TRAILER_BYTES], data[TRAILER_BYTES:]
        if self._auth is not None and not self._auth.check_tag(
                mac, "trailer", self.address, pair.session, pair.pair_id, header.seq, body):
            self._counters.refuse("bad_mac")
            raise ChannelError(f"the trailer of transfer {header.seq} does not verify under "
                               "the cluster key")
        try:
            return decode_trailer(body)
        except HeaderError as e:
            raise ChannelError(f"transfer {header.seq}: {e}") from None

    def _checksum_failed(self, pair: _RecvPair, header: TransferHeader,
                         handle: TransferHandle, landed: int, expected: int) -> None:
        """A payload that landed whole but not as sent: FAILED like any broken transfer
        (the decode side frees the blocks and recomputes), never DONE."""
        self._counters.checksum_failure()
        reason = (f"KV payload checksum mismatch from {pair.name!r} (pair {pair.pair_id}, "
                  f"transfer {header.seq}): offer {expected:#x}, landed "
                  f"{landed:#x}; the blocks are dropped and the prompt recomputed")
        log.warning("decode receiver %s: %s (request %r)", self.name, reason,
                    handle.request_id)
        handle.advance(TransferState.FAILED, reason)

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

