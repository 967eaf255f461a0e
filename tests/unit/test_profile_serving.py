"""benchmarks.profile_serving.fit_serving: the served step as ``factor x engine +
per_seq x batch`` through a light and a heavy wave, with a per-sequence cost never
below zero."""

from __future__ import annotations

import pytest

from benchmarks.profile_serving import fit_serving


def test_two_waves_give_the_factor_and_the_per_sequence_cost() -> None:
    # served = 1.1 x engine + 3 ms x batch, at batch 2 and 8.
    waves = [(1.1 * 50 + 3 * 2, 50.0, 2), (1.1 * 70 + 3 * 8, 70.0, 8)]
    factor, per_seq = fit_serving(waves)
    assert factor == pytest.approx(1.1) and per_seq == pytest.approx(3.0)


def test_a_two_thread_worker_whose_slowdown_grows_with_the_batch_is_a_per_sequence_cost(
) -> None:
    # As measured on a 2-core AMD EPYC (SmolLM2 fp32, one 2-thread worker): a factor
    # alone would be 85.5 / 54.7 = 1.56 and overstate a light load.
    waves = [(31.0 + 3.85 * 2, 31.0, 2), (54.7 + 3.85 * 8, 54.7, 8)]
    factor, per_seq = fit_serving(waves)
    assert factor == pytest.approx(1.0, abs=1e-9) and per_seq == pytest.approx(3.85)


def test_the_per_sequence_cost_is_never_negative_and_the_factor_may_fall_below_one() -> None:
    # A fit would say per_seq < 0: the factor alone is kept.
    factor, per_seq = fit_serving([(60.0, 50.0, 2), (70.0, 70.0, 8)])
    assert per_seq == 0.0 and factor == pytest.approx((50 * 60 + 70 * 70) / (50**2 + 70**2))
    # The machine runs faster now than when the grid was measured: a factor below 1.
    factor, per_seq = fit_serving([(0.9 * 50, 50.0, 2), (0.9 * 70, 70.0, 8)])
    assert factor == pytest.approx(0.9) and per_seq == pytest.approx(0.0, abs=1e-9)


def test_one_wave_gives_a_factor() -> None:
    assert fit_serving([(62.0, 50.0, 8)]) == (pytest.approx(1.24), 0.0)


def test_step_ratios_compare_each_gap_with_the_predicted_one_at_its_index() -> None:
    from benchmarks.profile_serving import jitter_quantiles, step_ratios

    predicted = [[0.05, 0.06, 0.07]] * 3  # every request alike, steps growing
    measured = [[0.05, 0.06, 0.07], [0.10, 0.12, 0.14], [0.05, 0.06, 0.07]]
    ratios = step_ratios(measured, predicted)
    assert sorted(ratios) == pytest.approx([1.0] * 6 + [2.0] * 3)  # over the median
    assert step_ratios(measured, []) == []
    assert jitter_quantiles(ratios) == ()  # too few to say
    qs = dict(jitter_quantiles([1.0] * 80 + [1.5] * 20))
    assert qs[0.5] == pytest.approx(1.0) and qs[0.995] == pytest.approx(1.5)
