"""benchmarks.profile: a shape's point is its fastest repetition once every step is
brought to one machine speed by the speed reference timed beside it."""

from __future__ import annotations

import pytest

from benchmarks.profile import fastest_points, reference_spread, speed_scale


def _step(shape: str, seconds: float, reference: float = 0.0) -> dict:
    return {"kind": "decode", "shape": shape, "chunks": [[1, 64]], "seconds": seconds,
            "reference_s": reference}


def test_the_scale_brings_each_step_to_the_fast_tenth_of_the_references() -> None:
    refs = [0.010] * 9 + [0.020]
    assert speed_scale(refs) == pytest.approx([1.0] * 9 + [0.5])
    assert speed_scale([0.010, 0.0]) == [1.0, 1.0]  # a step without one: none scaled
    assert speed_scale([]) == []


def test_a_slow_spell_is_scaled_away_before_the_fastest_repetition_is_taken() -> None:
    # Shape a ran both times in a slow spell (reference 1.5x); shape b once fast, once
    # slow. Scaled, a's point is its time at the fast speed.
    steps = [_step("a", 0.150, 0.015), _step("a", 0.160, 0.015),
             *[_step("b", 0.050, 0.010) for _ in range(8)], _step("b", 0.075, 0.015)]
    shapes, points = fastest_points(steps)
    by = dict(zip(shapes, (p.seconds for p in points), strict=True))
    assert by["a"] == pytest.approx(0.100) and by["b"] == pytest.approx(0.050)
    spread = reference_spread(steps)
    assert spread is not None and spread["p10_ms"] == pytest.approx(10.0)
    assert spread["max_ms"] == pytest.approx(15.0)


def test_steps_without_a_reference_keep_their_times() -> None:
    shapes, points = fastest_points([_step("a", 0.2), _step("a", 0.1)])
    assert shapes == ["a"] and points[0].seconds == pytest.approx(0.1)
    assert reference_spread([_step("a", 0.2)]) is None
