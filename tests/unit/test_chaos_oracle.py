"""The chaos harness's oracle and recovery rule (benchmarks.chaos_oracle): pure logic."""

from __future__ import annotations

import math
import random
from dataclasses import asdict

from benchmarks.chaos_oracle import (
    Outcome,
    Row,
    _binomial_tail,
    baseline_p99,
    check,
    pooled_recovery_s,
    recovery_s,
    verdict,
)
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
    row = Row("kill-decode", 3, 0, restored_s=[4.2, 6.1, 5.0], recovery_s=[3.0, 0.0, 2.5],
              pooled_recovery_s=2.0)
    assert row.worst_restored_s == 6.1 and row.worst_recovery_s == 3.0
    report = {"shapes": [{"rows": [{**asdict(row), "bad_tokens": 0,
                                    "worst_recovery_s": row.worst_recovery_s}]}]}
    assert "| 2.0; 2.5 / 3.0 | 5.0 / 6.1 |" in table(report)
    assert failed_checks(report) == []
    row.restored_s[1] = None
    report["shapes"][0]["rows"][0].update(restored_s=row.restored_s)
    assert row.worst_restored_s is None
    assert any("1 not back" in m for m in failed_checks(report))
    assert "| - |" in table({"shapes": [{"rows": [{**asdict(Row("none", 0, 0)),
                                                   "bad_tokens": 0,
                                                   "worst_recovery_s": 0.0}]}]})


def _fault_cycles(ttft_of, faults: int = 50, seed: int = 0) -> list[tuple[list[Outcome], float]]:
    """``faults`` cycles at 3 requests/s, fault at t=6, TTFT from ``ttft_of(t, rng)``."""
    rng = random.Random(seed)
    cycles = []
    for _ in range(faults):
        times = sorted(rng.uniform(0, 16) for _ in range(48))
        cycles.append(([Outcome(0, t, [1], ttft_s=ttft_of(t, rng)) for t in times], 6.0))
    return cycles


def test_no_fault_reads_no_harm_where_a_small_window_p99_would_cry_wolf() -> None:
    """No fault at all, log-normal TTFT. A window of one fault's ~10 requests has a
    'p99' that is its max, above the pooled p99 one window in ten or so: held to it,
    faults 'recover' late or never. The rule asks whether more than 1% of a window is
    over the limit beyond chance (binomial test), and pooled over 50 faults each window
    holds 100+ requests: no harm, on every seed."""
    late = 0
    for seed in range(5):
        noise = _fault_cycles(lambda t, rng: 0.1 * math.exp(rng.gauss(0.0, 0.5)), seed=seed)
        base = baseline_p99(noise, 6.0)
        assert base is not None
        limit = base * 1.2
        after = [[o.ttft_s for o in c if 6 <= o.arrival_s < 9] for c, _ in noise]
        late += sum(max(v) > limit for v in after if v)  # what a max-as-p99 rule sees
        assert pooled_recovery_s(noise, base, window_s=1.0) == 0.0
        assert sum(recovery_s(o, t, 6.0, baseline_s=base) != 0.0 for o, t in noise) <= 2
    assert late >= 5


def test_binomial_tail() -> None:
    assert _binomial_tail(0, 10, 0.01) == 1.0
    assert abs(_binomial_tail(1, 10, 0.01) - (1 - 0.99 ** 10)) < 1e-12
    assert abs(_binomial_tail(2, 10, 0.01) - 0.004266) < 1e-6
    assert _binomial_tail(900, 1000, 0.01) < 1e-9


def test_a_partial_slowdown_is_still_harm() -> None:
    """A fifth of the requests slow for 4 s after the fault (one worker of five gone):
    the p99 is up, and recovery waits for it."""
    cycles = _fault_cycles(lambda t, rng: 1.0 if 6 <= t < 10 and rng.random() < 0.2
                           else 0.1 + rng.random() * 0.01)
    base = baseline_p99(cycles, 6.0)
    assert base is not None
    assert 3.5 <= pooled_recovery_s(cycles, base, window_s=1.0) <= 4.0  # type: ignore[operator]


def test_pooled_recovery_sees_a_real_outage_and_one_that_never_ends() -> None:
    def outage(t: float, rng: random.Random) -> float:
        return 2.0 if 6 <= t < 10 else 0.1 + rng.random() * 0.01

    cycles = _fault_cycles(outage)
    base = baseline_p99(cycles, 6.0)
    assert base is not None and base < 0.12
    assert 3.5 <= pooled_recovery_s(cycles, base, window_s=1.0) <= 4.0  # type: ignore[operator]
    stuck = _fault_cycles(lambda t, rng: 2.0 if t >= 6 else 0.1)
    assert pooled_recovery_s(stuck, 0.1, window_s=1.0) is None
    few = _fault_cycles(outage, faults=2)  # too few requests per window: nothing judged
    assert pooled_recovery_s(few, base, window_s=1.0) is None


def test_rescore_reads_a_report_again_into_the_same_cycles() -> None:
    from benchmarks.chaos import _cycles_of, rescore

    cycles = _fault_cycles(lambda t, rng: 2.0 if 6 <= t < 8 else 0.1, faults=40)
    points = [{"t": o.arrival_s - t, "ttft_s": o.ttft_s, "error": None, "cancelled": False}
              for c, t in cycles for o in c]
    old = [len(c) for c, _ in cycles]
    assert [len(c) for c, _ in _cycles_of(points)] == old  # split where time drops
    indexed = [{**p, "fault": i} for i, (c, _) in enumerate(cycles)
               for p in points[sum(old[:i]):sum(old[:i + 1])]]
    assert [len(c) for c, _ in _cycles_of(indexed)] == old
    row = {**asdict(Row("kill-decode", 40, 0)), "bad_tokens": 0, "worst_recovery_s": None}
    report = {"options": {"pre_s": 6.0}, "shapes": [
        {"shape": "disagg", "rate_rps": 3.0, "rows": [row],
         "outcomes": {"kill-decode": points}}]}
    new = rescore(report)["shapes"][0]["rows"][0]
    assert new["baseline_ttft_s"] == baseline_p99(cycles, 6.0)
    assert 1.5 <= new["pooled_recovery_s"] <= 2.0
    assert len(new["recovery_s"]) == 40 and report["shapes"][0]["rows"][0] is row


def test_pdserve_chaos_rescore_rewrites_a_saved_report(tmp_path) -> None:  # noqa: ANN001
    from benchmarks.chaos_report import write
    from cluster.cli.chaos import cmd_rescore

    cycles = _fault_cycles(lambda t, rng: 2.0 if 6 <= t < 8 else 0.1, faults=40)
    points = [{"t": o.arrival_s - t, "ttft_s": o.ttft_s, "error": None, "cancelled": False}
              for c, t in cycles for o in c]
    row = {**asdict(Row("kill-decode", 40, len(points))), "bad_tokens": 0,
           "worst_recovery_s": None}
    write({"options": {"pre_s": 6.0}, "shapes": [
        {"shape": "disagg", "capacity_rps": 4.0, "rate_rps": 3.0, "rows": [row],
         "outcomes": {"kill-decode": points}}]}, tmp_path, "a run")
    assert "MISSED" in (tmp_path / "chaos.md").read_text()  # no recovery computed yet
    assert cmd_rescore(str(tmp_path)) == 0
    md = (tmp_path / "chaos.md").read_text()
    assert md.startswith("a run (rescored)") and "Targets: all met" in md
    assert cmd_rescore(str(tmp_path / "nowhere")) == 2
