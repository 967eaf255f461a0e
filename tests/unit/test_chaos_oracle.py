"""The chaos harness's oracle and recovery rule (benchmarks.chaos_oracle): pure logic."""

from __future__ import annotations

from benchmarks.chaos_oracle import Outcome, Row, check, recovery_s, verdict

REF = [5, 6, 7, 8, 9, 10]


def test_verdicts() -> None:
    assert verdict(REF, REF) == "exact"
    assert verdict(REF[:4], REF) == "missing"
    assert verdict(REF + [11], REF) == "duplicated"
    assert verdict([5, 6, 7, 6, 7, 8], REF) == "duplicated"  # re-sent from position 1
    assert verdict([5, 6, 7, 8, 9, 99], REF) == "wrong"
    assert verdict([5, 6, 99], REF) == "wrong"


def test_cancelled_streams_only_need_a_matching_prefix_and_failures_are_failures() -> None:
    assert check(Outcome(0, 0.0, [5, 6], cancelled=True), REF) == "cancelled"
    assert check(Outcome(0, 0.0, [5, 7], cancelled=True), REF) == "wrong"
    assert check(Outcome(0, 0.0, [5, 6], error="UNAVAILABLE"), REF) == "failed"
    assert check(Outcome(0, 0.0, list(REF)), REF) == "exact"


def test_row_counts_each_class() -> None:
    row = Row("kill-decode", 1, 0)
    row.add([Outcome(0, 0.0, list(REF), migrations=1), Outcome(0, 0.1, REF[:2]),
             Outcome(0, 0.2, error="UNAVAILABLE"), Outcome(0, 0.3, [1], cancelled=True),
             Outcome(0, 0.4, [5], cancelled=True)], [REF])
    assert (row.sent, row.missing, row.failures, row.wrong, row.cancelled) == (5, 1, 1, 1, 1)
    assert row.errors == {"UNAVAILABLE": 1} and row.migrations == 1 and row.bad_tokens == 2


def _load(ttft_of, until: float = 20.0, step: float = 0.1) -> list[Outcome]:
    out, t = [], 0.0
    while t < until:
        out.append(Outcome(0, t, [1], ttft_s=ttft_of(t)))
        t = round(t + step, 6)
    return out


def test_recovery_is_when_ttft_p99_stays_back_near_its_baseline() -> None:
    # 50 ms before the fault at t=6; 800 ms for 4 s after it; then back to 55 ms.
    outcomes = _load(lambda t: 0.8 if 6 <= t < 10 else (0.055 if t >= 10 else 0.05))
    assert recovery_s(outcomes, 6.0, 6.0) == 4.0
    assert recovery_s(_load(lambda t: 0.05), 6.0, 6.0) == 0.0  # no harm done
    never = _load(lambda t: 0.8 if t >= 6 else 0.05)
    assert recovery_s(never, 6.0, 6.0) is None


def test_failures_after_the_fault_hold_recovery_back() -> None:
    outcomes = _load(lambda t: 0.05)
    for o in outcomes:
        if 6 <= o.arrival_s < 8:
            o.error, o.ttft_s = "UNAVAILABLE", None
    assert recovery_s(outcomes, 6.0, 6.0) == 2.0
