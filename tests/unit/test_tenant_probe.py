"""The cross-tenant probing benchmark's score (benchmarks/tenant_probe.py)."""

import pytest

from benchmarks.tenant_probe import auc


def test_auc_is_one_when_every_secret_probe_is_faster() -> None:
    assert auc([0.01, 0.02], [0.5, 0.6, 0.7]) == 1.0


def test_auc_is_a_half_when_timing_tells_nothing() -> None:
    assert auc([0.1, 0.3], [0.1, 0.3]) == 0.5
    assert auc([0.2], [0.2]) == 0.5


def test_auc_counts_pairs_and_ties_half() -> None:
    # hits 1, 3 vs misses 2, 3: (1<2) (1<3) (3>2: 0) (3==3: 0.5) -> 2.5 / 4
    assert auc([1, 3], [2, 3]) == pytest.approx(0.625)
    with pytest.raises(ValueError):
        auc([], [1.0])
