"""Authenticating the KV channel's control messages under the cluster secret.

The decode worker's ``TCPStore`` has no authentication of its own: whoever reaches its
port can read and write any key. So the messages that make either end act carry an
HMAC-SHA256 under the cluster key (``TransferConfig.auth_key``), and each end acts only
on messages that verify:

- a **join** (prefill -> decode inbox) and every **offer** and **bye** carry a
  :class:`Stamp`: a timestamp, a fresh 16-byte nonce and the MAC over (message kind,
  the decode worker's transfer address, the pair's session, timestamp, nonce, body).
  The receiver refuses a bad MAC, a timestamp more than ``max_skew_s`` from its clock,
  and a nonce it saw within the window (:class:`ReplayGuard`). The join's nonce is the
  pair's *session*: everything later on the pair is bound to it.
- the decode side's **accepts** (of a join, of an offer) and the values of the pair's
  process-group rendezvous carry a MAC over (kind, address, session, what is accepted):
  the prefill worker sends KV only to a peer that proved it holds the key, and no
  third process can slip its own address into the rendezvous. Refusals and cancels are
  not signed: a forged one can only stop a transfer, which any store client can do.
- an early offer's **trailer** (the payload's checksum and status, sent on the pair's
  process group after the payload) carries a MAC over (kind, address, session, pair,
  transfer, trailer): it vouches for the checksum as the offer's stamp does for a
  checksum in the offer.

A replayed message within the window is caught by its nonce; after the window by its
timestamp (a nonce is remembered for ``2 * max_skew_s``, the longest a replay of an
admitted message could still pass the timestamp check). Memory is bounded: at most
``max_nonces`` remembered; when full (a flood of valid messages) new ones are refused
until old ones expire, never admitted unchecked.

What a process without the key that reaches the store's port can still do: read and
write any key (``TCPStore`` has no authentication), so deny service: fill the store's
memory, pre-write refusals or ``closed`` keys, close in-flight transfers' decisions with
a refusal, flood the inbox (each message costs the receiver a parse and a MAC). What it
can no longer do: get a pair opened on the decode worker, get an offer matched to a
reservation or any byte of its own written into reserved blocks, close a pair with a
bye, stop the inbox with ``STOP``, slip its address into a pair's rendezvous, or get a
prefill worker to send KV to it by answering a join or an offer. Left to the network:
gloo's payload connections are plaintext TCP, so an attacker on the path between the
two workers can read or alter KV in flight (a NetworkPolicy, or IPsec/WireGuard between
nodes, closes that; a MAC over the payload would cost a core-second per GB or two).

Pure: no sockets, no threads of its own; the clock is injected for tests.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

MAC_BYTES = 32
NONCE_BYTES = 16
STAMP_BYTES = 8 + NONCE_BYTES + MAC_BYTES
_DOMAIN = b"pdserve-kvx-auth-v1"


class AuthError(ValueError):
    """A message that must not be acted on. ``kind`` names the check that failed
    (``bad_mac``, ``stale``, ``replay``, ``nonces_full``), for counters."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Stamp:
    """What makes one message fresh and authentic: when, a nonce, and the MAC."""

    ts_ms: int
    nonce: bytes
    mac: bytes

    def to_bytes(self) -> bytes:
        return struct.pack("<q", self.ts_ms) + self.nonce + self.mac

    @classmethod
    def from_bytes(cls, data: bytes) -> Stamp:
        if len(data) != STAMP_BYTES:
            raise AuthError("malformed", f"stamp of {len(data)} bytes, expected {STAMP_BYTES}")
        return cls(struct.unpack("<q", data[:8])[0], data[8:8 + NONCE_BYTES],
                   data[8 + NONCE_BYTES:])

    def to_text(self) -> str:
        return f"{self.ts_ms} {self.nonce.hex()} {self.mac.hex()}"

    @classmethod
    def from_text(cls, ts: str, nonce: str, mac: str) -> Stamp:
        try:
            stamp = cls(int(ts), bytes.fromhex(nonce), bytes.fromhex(mac))
        except ValueError:
            raise AuthError("malformed", "stamp fields are not integers and hex") from None
        if len(stamp.nonce) != NONCE_BYTES or len(stamp.mac) != MAC_BYTES:
            raise AuthError("malformed", "stamp nonce or MAC has the wrong length")
        return stamp


class ReplayGuard:
    """Admits a (timestamp, nonce) once: the timestamp within ``max_skew_s`` of the
    clock, the nonce unseen in the last ``2 * max_skew_s``. Thread-safe; ``admit``
    mutates and never blocks."""

    def __init__(self, max_skew_s: float = 30.0, max_nonces: int = 65536,
                 clock: Callable[[], float] = time.time) -> None:
        if max_skew_s <= 0 or max_nonces < 1:
            raise ValueError("max_skew_s must be > 0 and max_nonces >= 1")
        self.max_skew_s, self.max_nonces, self._clock = max_skew_s, max_nonces, clock
        self._lock = threading.Lock()
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> forget after

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)

    def admit(self, ts_ms: int, nonce: bytes) -> None:
        """Raise AuthError (``stale``, ``replay``, ``nonces_full``) or remember it."""
        now = self._clock()
        skew = now - ts_ms / 1000.0
        if abs(skew) > self.max_skew_s:
            raise AuthError("stale", f"timestamp {skew:+.1f}s from this clock (the bound is "
                                     f"{self.max_skew_s:g}s; are the clocks synchronised?)")
        with self._lock:
            while self._seen:  # insertion order = expiry order (a fixed lifetime each)
                oldest, until = next(iter(self._seen.items()))
                if until > now:
                    break
                del self._seen[oldest]
            if nonce in self._seen:
                raise AuthError("replay", "nonce already seen: a replayed message")
            if len(self._seen) >= self.max_nonces:
                raise AuthError("nonces_full", f"{self.max_nonces} nonces remembered within "
                                               "the window; refusing until they expire")
            self._seen[nonce] = now + 2 * self.max_skew_s


def _encode(*parts: bytes | str | int) -> bytes:
    """Parts, typed and length-prefixed: no two different tuples encode alike."""
    out = [_DOMAIN]
    for p in parts:
        if isinstance(p, int):
            out.append(b"i" + struct.pack("<q", p))
        else:
            raw = p.encode() if isinstance(p, str) else bytes(p)
            out.append((b"s" if isinstance(p, str) else b"b") + struct.pack("<I", len(raw))
                       + raw)
    return b"".join(out)


class ChannelAuth:
    """MACs under one key, and the replay window of the receiving end. Thread-safe."""

    def __init__(self, key: bytes, max_skew_s: float = 30.0, max_nonces: int = 65536,
                 clock: Callable[[], float] = time.time) -> None:
        if len(key) < 16:
            raise ValueError("the channel key must have at least 16 bytes")
        self._key, self._clock = key, clock
        self.replay = ReplayGuard(max_skew_s, max_nonces, clock)

    def tag(self, kind: str, audience: str, session: bytes, *parts: bytes | str | int) -> bytes:
        """A deterministic MAC (accepts, rendezvous values)."""
        return hmac.new(self._key, _encode(kind, audience, session, *parts),
                        hashlib.sha256).digest()

    def check_tag(self, mac: bytes, kind: str, audience: str, session: bytes,
                  *parts: bytes | str | int) -> bool:
        return hmac.compare_digest(mac, self.tag(kind, audience, session, *parts))

    def stamp(self, kind: str, audience: str, session: bytes, body: bytes) -> Stamp:
        """A fresh stamp for a message the other end will :meth:`verify`."""
        ts_ms, nonce = int(self._clock() * 1000), os.urandom(NONCE_BYTES)
        return Stamp(ts_ms, nonce, self.tag(kind, audience, session, ts_ms, nonce, body))

    def verify(self, stamp: Stamp, kind: str, audience: str, session: bytes,
               body: bytes) -> None:
        """Raise AuthError unless the MAC holds and the message is fresh and new. The
        MAC is checked first: a forged message never takes a place in the window."""
        if not self.check_tag(stamp.mac, kind, audience, session, stamp.ts_ms, stamp.nonce,
                              body):
            raise AuthError("bad_mac", "MAC does not verify: the sender does not hold this "
                                       "cluster's secret, or the message was altered")
        self.replay.admit(stamp.ts_ms, stamp.nonce)
