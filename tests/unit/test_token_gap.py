"""The token-gap benchmark's summary: quantiles and the ratio rows (pure)."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.token_gap import Samples, main, quantile, summary_rows


def test_quantile_is_the_inclusive_linear_one() -> None:
    xs = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0]
    q = statistics.quantiles(xs, n=10, method="inclusive")
    assert quantile(xs, 0.5) == statistics.median(xs)
    assert quantile(xs, 0.9) == pytest.approx(q[-1])
    assert quantile(xs, 0.0) == 1.0 and quantile(xs, 1.0) == 10.0
    assert quantile([7.0], 0.99) == 7.0


def test_summary_has_a_row_per_variant_and_the_ratios_of_those_present() -> None:
    rows = summary_rows({"layers": Samples([30.0, 40.0, 50.0], [200.0] * 3),
                         "colocated": Samples([20.0, 20.0, 25.0], [190.0] * 3)})
    assert rows[1].split()[:3] == ["layers", "3", "40.0"]
    assert rows[2].split()[:3] == ["colocated", "3", "20.0"]
    assert rows[3] == "layers / colocated: gap p50 2.00x, p90 2.00x"
    assert len(rows) == 4  # no "after": no ratio against it


def test_unknown_variant_is_refused_by_name() -> None:
    with pytest.raises(SystemExit):
        main(["--variants", "layers,nope"])
