"""Stores and process groups for transfer pairs: binding, connecting, timed waits.

The decode worker hosts one ``TCPStore`` for all its pairs. Everything here binds the
configured interface only: the store's listening socket is bound by us and handed over
as ``master_listen_fd`` (``TCPStore(host_name=...)`` alone listens on every interface),
and each gloo process group gets a device created for that host.

Store keys (under :data:`ROOT`; pair keys through :func:`pair_store`)::

    pair_seq                counter; a sender's ``add`` names its new pair
    inbox                   the receiver's one queue: joins ``J v1 <id> <backend> <name>``,
                            offers (header + block ids), ``B<id>`` (sender closed a pair)
    join/<id>               "A" or "R:<reason>": the receiver's answer to a join
    pair/<id>/pg/...        the pair's process group rendezvous (2 ranks)
    pair/<id>/ready         set once the receiver has registered the pair
    pair/<id>/decision/<s>  "A" | "AD" | "R:<reason>" | "C": who decided transfer s, set
                            once by compare_set, so an accept racing a sender's timeout
                            has a single winner
    pair/<id>/replies       queue of "<s>": decision s was set by the receiver
    pair/<id>/closed        set when the receiver closed the pair, with the reason

With a cluster key (``TransferConfig.auth_key``; :mod:`workers.transfer.auth`) a join is
``J v2 <id> <backend> <ts> <nonce> <mac> <name>``, an offer is ``S`` + stamp + header +
block ids, a bye ``B<id> <ts> <nonce> <mac>``; accepts (``join/<id>``, decisions) are
followed by their 32-byte MAC, and the values of ``pair/<id>/pg/...`` by theirs
(:class:`SignedStore`). ``STOP`` is honoured only from the process itself (it is shutting
down), never because a store client pushed one.

A ``TCPStore`` client serialises its calls on one socket, so a blocking wait holds up
every other call on that client: each blocking loop (the receiver's inbox, a sender
pair's replies) owns a client, and everything else makes only quick calls on a shared
one. Connections are kept few on purpose: opening one can stall for seconds on some
hosts (seen: 1 in ~10 torch TCPStore connects taking 5 s inside a gVisor sandbox).
"""

from __future__ import annotations

import datetime
import hmac
import logging
import socket
import threading
import time
from collections.abc import Iterable

import torch.distributed as dist

from workers.transfer.auth import MAC_BYTES, ChannelAuth
from workers.transfer.state import TransferHandle

log = logging.getLogger(__name__)

ROOT = "pdserve/kvx/v1"
JOIN_PREFIX = b"J"
SIGNED_OFFER_PREFIX = b"S"
BYE_PREFIX = b"B"
STOP = b"STOP"
ACCEPT = b"A"  # staged framing
ACCEPT_DIRECT = b"AD"  # direct framing (see header.message_plan)
CANCEL = b"C"
REFUSE_PREFIX = b"R:"

_ALL_INTERFACES = {"", "0.0.0.0", "::", "*"}


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def check_host(host: str) -> None:
    if host in _ALL_INTERFACES:
        raise ValueError(f"refusing to bind the transfer path to all interfaces ({host!r}); "
                         "give the address of the interface this worker serves on")


def listen_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A store server bound to ``host`` only (port 0: an ephemeral port)."""
    check_host(host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # a restarted decode worker can take its port back while old connections linger
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        bound_port = sock.getsockname()[1]
        store = dist.TCPStore(host, bound_port, None, True, td(timeout_s),
                              wait_for_workers=False, master_listen_fd=sock.fileno(),
                              use_libuv=True)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns and closes the fd now
    return store


STORE_ATTEMPT_S = 1.0
"""How long one try to join a remote store waits before the listener is probed again."""


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of a remote store; raises within ``timeout_s`` if nobody answers, and
    at once (ConnectionRefusedError) when nothing listens there: TCPStore's client
    retries a refused connect for its whole timeout, which would keep every send to a
    dead decode worker (and the prefill blocks it reads) waiting that long.

    A process dying (SIGKILLed, still tearing down) keeps its listening socket a moment:
    the probe gets into its backlog, then the store's connect is reset, and TCPStore
    would retry for the whole timeout. So the store is joined in tries of
    :data:`STORE_ATTEMPT_S`, the listener probed before each: once it is gone, the
    refusal is raised at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        with socket.create_connection((host, port), timeout=max(left, 0.001)):
            pass
        try:
            store = dist.TCPStore(host, port, None, False,
                                  td(max(min(STORE_ATTEMPT_S, left), 0.001)),
                                  wait_for_workers=False)
        except RuntimeError:  # DistNetworkError, DistStoreError: reset or no answer
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)  # a connect reset at once: not a busy loop
            continue
        store.set_timeout(td(timeout_s))
        return store


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"transfer address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def new_process_group(backend: str, store: dist.Store, rank: int, host: str,
                      timeout_s: float) -> dist.ProcessGroup:
    """The 2-rank group of one pair; blocks until the peer constructs its half or
    ``timeout_s`` passes. No global default group is involved."""
    if backend == "gloo":
        gloo = dist.ProcessGroupGloo
        opts = gloo._Options()
        opts._timeout = td(timeout_s)
        opts._devices = [gloo.create_device(hostname=host)]
        return gloo(store, rank, 2, opts)
    if backend == "nccl":  # pragma: no cover - needs two GPUs; untested on this machine
        nccl = dist.ProcessGroupNCCL
        opts = nccl.Options()
        opts._timeout = td(timeout_s)
        opts.is_high_priority_stream = False
        return nccl(store, rank, 2, opts)
    raise ValueError(f"unknown transfer backend {backend!r}; use 'gloo' or 'nccl'")


class SignedStore(dist.Store):
    """A pair's rendezvous keys with every value followed by its MAC, bound to the pair's
    session: the process group connects only to an address one of the two ends wrote.
    Implements what gloo's (and NCCL's) rendezvous calls: set, get, wait, add, check."""

    def __init__(self, inner: dist.Store, auth: ChannelAuth, audience: str, session: bytes,
                 pair_id: int) -> None:
        super().__init__()
        self._inner, self._auth = inner, auth
        self._scope = (audience, session, pair_id)

    def _tag(self, key: str, value: bytes) -> bytes:
        audience, session, pair_id = self._scope
        return self._auth.tag("rendezvous", audience, session, pair_id, key, value)

    def set(self, key: str, value: bytes | str) -> None:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, raw + self._tag(key, raw))

    def get(self, key: str) -> bytes:
        raw = self._inner.get(key)
        value, mac = raw[:-MAC_BYTES], raw[-MAC_BYTES:]
        if len(raw) < MAC_BYTES or not hmac.compare_digest(mac, self._tag(key, value)):
            raise RuntimeError(f"rendezvous value {key!r} of pair {self._scope[2]} failed "
                               "authentication: written by a process without the cluster "
                               "secret")
        return value

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)


def rendezvous_store(pair_keys: dist.Store, auth: ChannelAuth | None, audience: str,
                     session: bytes, pair_id: int) -> dist.Store:
    """The store a pair's process group meets on (signed when there is a key)."""
    keys = dist.PrefixStore("pg", pair_keys)
    return keys if auth is None else SignedStore(keys, auth, audience, session, pair_id)


def is_timeout(exc: BaseException) -> bool:
    """Whether a store or gloo error was a deadline, not a broken connection."""
    text = str(exc).lower()
    return "timeout" in text or "timed out" in text


def pair_store(root: dist.Store, pair_id: int) -> dist.PrefixStore:
    """The keys of one pair. Always go through this: PrefixStore joins prefix and key
    with "/", so hand-written nested keys drift."""
    return dist.PrefixStore(f"pair/{pair_id}", root)


def wait_key(store: dist.Store, key: str, timeout_s: float) -> bytes | None:
    """The value of ``key`` once set, or None after ``timeout_s``. Raises when the store
    is unreachable (its host died). Blocks ``store``'s client meanwhile."""
    try:
        store.wait([key], td(timeout_s))
    except dist.DistStoreError as e:
        if is_timeout(e):
            return None
        raise
    return store.get(key)


def settle_when_resolved(handle: TransferHandle, works: Iterable[dist.Work], what: str,
                         timeout_s: float) -> None:
    """Call before ending a failed transfer: gloo cannot take back a posted send or
    receive, so the handle does not quiesce (its memory is not reused) until every
    posted message has resolved, watched on a daemon thread.

    Each is waited on for at most ``timeout_s`` (the data timeout): a wait that times
    out makes gloo close the pair, which fails every message still posted on it (the
    pair is abandoned anyway). Seen with a decode worker SIGKILLed mid-send: a posted
    send neither completed nor failed until its wait timed out, so a longer wait here
    held the prefill's blocks that much longer."""
    pending = [w for w in works if not w.is_completed()]
    if not pending:
        return
    settle = handle.linger()
    log.warning("%s of %r: %d payload messages still posted after the failure; their "
                "memory stays held until they resolve", what, handle.request_id, len(pending))

    def watch() -> None:
        t0 = time.monotonic()
        for w in pending:
            while not w.is_completed():
                try:
                    w.wait(td(timeout_s))
                except Exception as e:  # noqa: BLE001 - resolved (failed) or not yet
                    log.debug("%s of %r: posted message: %s", what, handle.request_id, e)
        log.info("%s of %r: the posted messages resolved after %.1fs; memory released",
                 what, handle.request_id, time.monotonic() - t0)
        settle()

    threading.Thread(target=watch, daemon=True, name=f"kvx-linger-{handle.request_id}").start()
