"""The emulated link's rule (cluster.linkemu.DelayLine): pure, on a given clock."""

from __future__ import annotations

import pytest

from cluster.linkemu import DelayLine, Impairment


def test_a_clean_line_hands_frames_on_at_once_in_order() -> None:
    line = DelayLine()
    for i in range(5):
        assert line.admit(1, bytes([i]), now=10.0)
    assert line.due(10.0) == [(1, bytes([i])) for i in range(5)]
    assert line.next_release() is None


def test_delay_holds_each_frame_and_jitter_never_reorders_a_direction() -> None:
    line = DelayLine(seed=3)
    line.impairment = Impairment(delay_ms=40.0, jitter_ms=30.0)
    for i in range(200):
        line.admit(i % 2, i.to_bytes(2, "big"), now=i * 1e-4)  # 0.1 ms apart
    assert line.due(0.0099) == []  # nothing before 40 - 30 ms
    out = line.due(1.0)
    assert len(out) == 200
    for side in (0, 1):
        seq = [int.from_bytes(f, "big") for d, f in out if d == side]
        assert seq == sorted(seq)  # each direction keeps its order


def test_loss_drops_about_that_share() -> None:
    line = DelayLine(seed=1)
    line.impairment = Impairment(loss=0.2)
    kept = sum(line.admit(0, b"x", now=0.0) for _ in range(10_000))
    assert 7_700 <= kept <= 8_300 and line.dropped == 10_000 - kept
    line.impairment = Impairment(loss=1.0)
    assert not line.admit(0, b"x", now=0.0)


def test_bad_impairments_are_refused() -> None:
    with pytest.raises(ValueError, match="jitter_ms"):
        Impairment(delay_ms=1.0, jitter_ms=2.0)
    with pytest.raises(ValueError, match="probability"):
        Impairment(loss=1.5)
    with pytest.raises(ValueError):
        Impairment(delay_ms=-1.0)
