"""The chaos harness's oracle and recovery rule (benchmarks.chaos_oracle): pure logic."""

from __future__ import annotations

from dataclasses import asdict

from benchmarks.chaos_oracle import Outcome, Row, baseline_p99, check, recovery_s, verdict
from benchmarks.chaos_report import failed_checks, table

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


def test_the_pooled_baseline_is_what_one_noisy_pre_window_cannot_be() -> None:
    """One fault's pre window holds a quiet stretch (50 ms); the load's usual tail is
    120 ms. Against its own window a 120 ms request after the fault looks like harm; the
    baseline pooled over the scenario's faults knows the tail, and says no harm done."""
    quiet = _load(lambda t: 0.12 if t >= 6 and int(t * 10) % 10 == 3 else 0.05)
    noisy = [_load(lambda t, k=k: 0.12 if int(t * 10) % 10 == k else 0.05) for k in range(5)]
    pooled = baseline_p99([(quiet, 6.0), *((c, 6.0) for c in noisy)], 6.0)
    assert pooled == 0.12
    assert recovery_s(quiet, 6.0, 6.0) > 10  # its own 50 ms baseline: a long "outage"
    assert recovery_s(quiet, 6.0, 6.0, baseline_s=pooled) == 0.0
    assert baseline_p99([([], 6.0)], 6.0) is None


def test_restoration_is_reported_per_kill_and_a_missing_one_misses_the_target() -> None:
    row = Row("kill-decode", 3, 0, restored_s=[4.2, 6.1, 5.0], recovery_s=[3.0, 0.0, 2.5])
    assert row.worst_restored_s == 6.1 and row.worst_recovery_s == 3.0
    report = {"shapes": [{"rows": [{**asdict(row), "bad_tokens": 0,
                                    "worst_recovery_s": row.worst_recovery_s}]}]}
    assert "| 2.5 / 3.0 | 5.0 / 6.1 |" in table(report)
    assert failed_checks(report) == []
    row.restored_s[1] = None
    report["shapes"][0]["rows"][0].update(restored_s=row.restored_s)
    assert row.worst_restored_s is None
    assert any("1 not back" in m for m in failed_checks(report))
    assert "| - |" in table({"shapes": [{"rows": [{**asdict(Row("none", 0, 0)),
                                                   "bad_tokens": 0,
                                                   "worst_recovery_s": 0.0}]}]})
