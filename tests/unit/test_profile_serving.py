"""benchmarks.profile_serving: the served step as ``fm x memory + fc x compute +
per_seq x batch`` through a light and a heavy decode wave and a prefill wave (a
per-sequence cost never below zero), and the spread of served steps."""

from __future__ import annotations

import pytest

from benchmarks.profile_serving import fit_serving, step_ratios
from common.served_fit import jitter_quantiles


def _wave(fm: float, fc: float, per_seq: float, memory: float, compute: float, batch: int
          ) -> tuple[float, float, float, int]:
    return (fm * memory + fc * compute + per_seq * batch, memory, compute, batch)


def test_three_waves_give_both_factors_and_the_per_sequence_cost() -> None:
    # Memory throttled 1.9x, compute 1.1x, 2 ms per sequence (a slow spell on a VM).
    waves = [_wave(1.9, 1.1, 2.0, 50, 10, 2), _wave(1.9, 1.1, 2.0, 60, 40, 8),
             _wave(1.9, 1.1, 2.0, 100, 1800, 1)]
    assert fit_serving(waves) == pytest.approx((1.9, 1.1, 2.0))


def test_a_per_sequence_cost_that_would_be_negative_is_left_out() -> None:
    waves = [_wave(1.0, 1.0, -2.0, 40, 10, 2), _wave(1.0, 1.0, -2.0, 50, 20, 8),
             _wave(1.0, 1.0, -2.0, 60, 600, 1)]  # exactly solved, per_seq would be -2
    fm, fc, per_seq = fit_serving(waves)
    assert per_seq == 0.0 and fm > 0 and fc > 0


def test_waves_that_cannot_tell_the_factors_apart_give_one() -> None:
    # Every wave has the same memory share: one factor for both, fitted on the totals.
    waves = [_wave(1.2, 1.2, 0.0, 40, 10, 2), _wave(1.2, 1.2, 0.0, 80, 20, 2)]
    fm, fc, per_seq = fit_serving(waves)
    assert fm == pytest.approx(1.2) and fc == pytest.approx(1.2) and per_seq == 0.0
    # Faster than the profile: a factor below 1 is the machine's speed now.
    assert fit_serving([(45.0, 40.0, 10.0, 2)]) == pytest.approx((0.9, 0.9, 0.0))


def test_step_ratios_compare_each_gap_with_the_predicted_one_at_its_index() -> None:
    predicted = [[0.05, 0.06, 0.07]] * 3  # every request alike, steps growing
    measured = [[0.05, 0.06, 0.07], [0.10, 0.12, 0.14], [0.05, 0.06, 0.07]]
    ratios = step_ratios(measured, predicted)
    assert sorted(ratios) == pytest.approx([1.0] * 6 + [2.0] * 3)  # over the median
    assert step_ratios(measured, []) == []
    assert jitter_quantiles(ratios) == ()  # too few to say
    qs = dict(jitter_quantiles([1.0] * 80 + [1.5] * 20))
    assert qs[0.5] == pytest.approx(1.0) and qs[0.995] == pytest.approx(1.5)
