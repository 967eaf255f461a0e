"""The KV channel's message authentication: MACs bind every field, timestamps bound the
window, nonces are admitted once and their memory stays bounded (injected clock)."""

from __future__ import annotations

import pytest

from workers.transfer.auth import (
    STAMP_BYTES,
    AuthError,
    ChannelAuth,
    ReplayGuard,
    Stamp,
)

KEY = b"k" * 32


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _kind(fn) -> str:  # noqa: ANN001
    with pytest.raises(AuthError) as e:
        fn()
    return e.value.kind


def test_a_stamped_message_verifies_once_and_every_field_is_bound() -> None:
    clock = Clock()
    sender, receiver = ChannelAuth(KEY, clock=clock), ChannelAuth(KEY, clock=clock)
    body = b"header and block ids"
    stamp = sender.stamp("offer", "10.0.0.2:4000", b"session", body)
    receiver.verify(stamp, "offer", "10.0.0.2:4000", b"session", body)
    assert _kind(lambda: receiver.verify(stamp, "offer", "10.0.0.2:4000", b"session",
                                         body)) == "replay"
    fresh = sender.stamp("offer", "10.0.0.2:4000", b"session", body)
    for args in (("join", "10.0.0.2:4000", b"session", body),      # another kind
                 ("offer", "10.0.0.3:4000", b"session", body),     # another decode worker
                 ("offer", "10.0.0.2:4000", b"other", body),       # another pair's session
                 ("offer", "10.0.0.2:4000", b"session", body + b"!")):  # altered body
        assert _kind(lambda a=args: receiver.verify(fresh, *a)) == "bad_mac"
    moved = Stamp(fresh.ts_ms + 1, fresh.nonce, fresh.mac)  # timestamp altered
    assert _kind(lambda: receiver.verify(moved, "offer", "10.0.0.2:4000", b"session",
                                         body)) == "bad_mac"
    wrong_key = ChannelAuth(b"x" * 32, clock=clock)
    forged = wrong_key.stamp("offer", "10.0.0.2:4000", b"session", body)
    assert _kind(lambda: receiver.verify(forged, "offer", "10.0.0.2:4000", b"session",
                                         body)) == "bad_mac"
    assert len(receiver.replay) == 1  # forged and altered messages took no place
    receiver.verify(fresh, "offer", "10.0.0.2:4000", b"session", body)  # still new


def test_stamps_survive_the_wire_and_reject_garbage() -> None:
    stamp = ChannelAuth(KEY).stamp("join", "a:1", b"", b"1 gloo prefill@a:2")
    assert Stamp.from_bytes(stamp.to_bytes()) == stamp and len(stamp.to_bytes()) == STAMP_BYTES
    assert Stamp.from_text(*stamp.to_text().split(" ")) == stamp
    assert _kind(lambda: Stamp.from_bytes(b"short")) == "malformed"
    assert _kind(lambda: Stamp.from_text("1", "zz", "00")) == "malformed"
    assert _kind(lambda: Stamp.from_text("1", "00" * 16, "00" * 31)) == "malformed"
    with pytest.raises(ValueError):
        ChannelAuth(b"short")


def test_stale_and_future_timestamps_are_refused_at_the_skew_bound() -> None:
    clock = Clock()
    guard = ReplayGuard(max_skew_s=30.0, clock=clock)
    now_ms = int(clock.t * 1000)
    guard.admit(now_ms - 29_999, b"a")
    guard.admit(now_ms + 29_999, b"b")  # a sender whose clock runs a little ahead
    assert _kind(lambda: guard.admit(now_ms - 30_001, b"c")) == "stale"
    assert _kind(lambda: guard.admit(now_ms + 30_001, b"d")) == "stale"


def test_a_replay_is_refused_by_nonce_inside_the_window_and_by_age_after_it() -> None:
    clock = Clock()
    start = clock.t
    guard = ReplayGuard(max_skew_s=30.0, clock=clock)
    ts = int(start * 1000) + 30_000  # the worst case: stamped at the future edge
    guard.admit(ts, b"n")
    for later in (1.0, 30.0, 59.9):  # the timestamp alone would pass: the nonce stops it
        clock.t = start + later
        assert _kind(lambda: guard.admit(ts, b"n")) == "replay"
    clock.t = start + 60.1  # forgotten by now, and too old to pass anyway
    assert _kind(lambda: guard.admit(ts, b"n")) == "stale"
    guard.admit(int(clock.t * 1000), b"m")  # admitting prunes what expired
    assert len(guard) == 1


def test_nonce_memory_is_bounded_and_full_means_refuse_not_admit() -> None:
    clock = Clock()
    guard = ReplayGuard(max_skew_s=10.0, max_nonces=3, clock=clock)
    ts = int(clock.t * 1000)
    for n in (b"1", b"2", b"3"):
        guard.admit(ts, n)
    assert _kind(lambda: guard.admit(ts, b"4")) == "nonces_full"
    assert _kind(lambda: guard.admit(ts, b"1")) == "replay"
    clock.t += 20.5  # the first three expire; room again
    guard.admit(int(clock.t * 1000), b"4")
    assert len(guard) == 1


def test_accept_tags_are_deterministic_and_bound_to_their_transfer() -> None:
    auth = ChannelAuth(KEY)
    tag = auth.tag("decision", "d:1", b"s", 7, 3, b"A")
    assert auth.check_tag(tag, "decision", "d:1", b"s", 7, 3, b"A")
    assert not auth.check_tag(tag, "decision", "d:1", b"s", 7, 4, b"A")  # another seq
    assert not auth.check_tag(tag, "decision", "d:1", b"s", 7, 3, b"AD")  # other framing
    assert not auth.check_tag(tag, "decision", "d:1", b"s", 73, b"A")  # fields don't merge
