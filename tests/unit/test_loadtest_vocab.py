"""Where ``pdserve bench`` gets its prompt ids, and when a run counts as failed."""

from __future__ import annotations

import pytest

from loadtest import vocab
from loadtest.runner import failed_verdict
from loadtest.workloads import DEFAULT_TOKEN_IDS, random_workload


def test_the_pool_is_the_samples_distinct_ids_less_those_an_empty_text_gets() -> None:
    assert vocab.pool_from_sample([1, 50, 60, 50, 70, 60], [1]) == [50, 60, 70]
    assert vocab.pool_from_sample([9, 8, 9], []) == [9, 8]  # first-seen order: seeded runs repeat


def test_workloads_draw_only_from_the_pool_given() -> None:
    pool = [300, 301, 377]
    reqs = random_workload(20, 50, 4, seed=1, token_ids=pool)
    assert {t for r in reqs for t in r.prompt} == set(pool)


def test_max_token_id_keeps_the_old_draws() -> None:
    """``--max-token-id N`` draws from [N/30, N) exactly as the harness always did."""
    ids = vocab.from_max_token_id(30000)
    assert ids == DEFAULT_TOKEN_IDS == range(1000, 30000)
    assert random_workload(5, 10, 2, seed=4, token_ids=ids) == random_workload(5, 10, 2, seed=4)
    with pytest.raises(ValueError, match="--max-token-id"):
        vocab.from_max_token_id(10)


def test_any_failure_fails_the_run_unless_a_fraction_is_allowed() -> None:
    ok = {"completed": 10, "failed": 0, "first_error": None}
    some = {"completed": 8, "failed": 2, "first_error": "INVALID_ARGUMENT: prompt\n  ids"}
    assert failed_verdict([ok], 0.0) is None
    assert failed_verdict([ok, some], 0.0) == (
        "2 of 20 requests failed (first error: INVALID_ARGUMENT: prompt ids)")
    assert failed_verdict([some], 0.2) is None
    assert "more than --max-failed-fraction 0.1" in failed_verdict([some], 0.1)
    assert failed_verdict([{"completed": 0, "failed": 48, "first_error": "x"}], 0.0) \
        .startswith("48 of 48 requests failed")
