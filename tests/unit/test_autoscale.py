"""planner.autoscale: the live planner's hysteresis (no flapping under steady load, a
margin, a dwell time, confirmations) and the role moves it asks for. Pure."""

import pytest

from common.traffic import TrafficRecord
from loadtest.metrics import SLO
from loadtest.workloads import DEFAULT_TOKEN_IDS as DEFAULT_IDS
from planner.autoscale import AutoscaleConfig, Autoscaler, FitMemory
from planner.caps import PrefillCapChooser, best_cap_goodput, prefill_caps
from planner.config import PoolConfig
from planner.moves import moves, reachable, role_changes, serving_while_moving
from planner.synthetic import synthetic_profile
from planner.window import served_share, tpot_bound, window_slo

MIXED, SPLIT = reachable(2, 1, 32)
RECORDS = [TrafficRecord(float(i), 128, 0, 64) for i in range(20)]


def _scaler(scores, **kw):
    cfg = AutoscaleConfig(**{"min_dwell_s": 60, "confirmations": 2, "min_gain": 0.1, **kw})
    return Autoscaler([MIXED, SPLIT], lambda c, r: scores[c.label], cfg)


def test_reachable_configurations_of_two_one_thread_workers():
    assert MIXED == PoolConfig("mixed", mixed_workers=2, mixed_threads=1)
    assert (SPLIT.kind, SPLIT.prefill_workers, SPLIT.decode_workers) == ("disaggregated", 1, 1)
    adaptive = reachable(3, 1, 0, adaptive_itl_budget_ms=150)
    assert [c.kind for c in adaptive] == ["mixed", "adaptive", "adaptive"]
    assert [(c.prefill_workers, c.decode_workers) for c in adaptive[1:]] == [(1, 2), (2, 1)]
    assert {c.ttft_slo_ms for c in adaptive} == {None}
    targeted = reachable(2, 1, 0, adaptive_itl_budget_ms=150, ttft_slo_ms=400)
    assert [c.ttft_slo_ms for c in targeted] == [None, 400]  # the router's, where it places
    assert reachable(2, 1, 0, ttft_slo_ms=400)[1].ttft_slo_ms is None  # static: no rule


def test_a_measured_goodput_is_the_floor_of_the_current_configurations_score():
    """20 requests in a 20 s window: 1 req/s. The split's calibration predicts it far
    below two mixed workers, while it measurably serves 85% of its requests within the
    SLOs (0.85 req/s): it stays (a prediction is not trusted below a measurement);
    without the measurement it would move."""
    scores = {MIXED.roles_label: 0.9, SPLIT.roles_label: 0.3}
    kw = {"confirmations": 1, "min_dwell_s": 0, "window_s": 20}
    assert _scaler(scores, **kw).decide(0.0, SPLIT, RECORDS).target == MIXED
    d = _scaler(scores, **kw).decide(0.0, SPLIT, RECORDS, served=0.85)  # 0.9: < 10% more
    assert (d.target, d.reason, d.served) == (None, "gain_below_threshold", 0.85)
    assert d.scores[SPLIT.roles_label] == pytest.approx(0.85)
    # a floor, never a ceiling: measured below the prediction, the prediction stands
    d = _scaler(scores, **kw).decide(0.0, MIXED, RECORDS, served=0.2)
    assert d.scores[MIXED.roles_label] == 0.9 and d.reason == "current_best"


def test_predicted_and_measured_goodput_are_per_second_of_the_window():
    """A light window every configuration serves whole: the live planner's simulated
    goodput is its requests over the window's seconds (not over the run's duration,
    whose drain tail differs by configuration), the very figure of the running
    configuration measured to serve them all (its floor): a floor no higher than an
    equal prediction."""
    from planner.scores import simulated

    records = [TrafficRecord(100.0 + 2 * i, 128, 0, 16) for i in range(10)]
    profile = synthetic_profile("cpu")
    figures = simulated(profile, 1, slo_ttft_ms=60_000, slo_tpot_ms=5_000, window_s=15.0)
    predicted = {c.roles_label: figures(c, records) for c in (MIXED, SPLIT)}
    assert all(f["goodput_fraction"] == 1.0 for f in predicted.values())
    assert all(f["duration_s"] > 18.0 for f in predicted.values())  # last arrival + its run
    goodput = {label: f["goodput"] for label, f in predicted.items()}
    assert goodput == {MIXED.roles_label: pytest.approx(10 / 15),
                       SPLIT.roles_label: pytest.approx(10 / 15)}
    scaler = Autoscaler([MIXED, SPLIT], lambda c, r: goodput[c.roles_label],
                        AutoscaleConfig(window_s=15, min_gain=0.1))
    d = scaler.decide(0.0, MIXED, records, served=1.0)  # all 10 within the SLOs
    assert d.scores == goodput and d.reason == "current_best"
    # Without a window (a benchmark's figure): per second of the simulated run.
    run_basis = simulated(profile, 1, slo_ttft_ms=60_000, slo_tpot_ms=5_000)(MIXED, records)
    assert run_basis["goodput"] == pytest.approx(10 / run_basis["duration_s"])


def test_served_share_counts_the_requests_that_finished_within_the_slos():
    slo = SLO(ttft_ms=500, tpot_ms=50)
    t = 1000.0
    records = [
        TrafficRecord(t, 100, 0, 11, "a", ttft_s=0.4, e2e_s=0.4 + 10 * 0.04),  # met
        TrafficRecord(t, 100, 0, 11, "b", ttft_s=0.6, e2e_s=1.0),  # TTFT missed
        TrafficRecord(t, 100, 0, 11, "c", ttft_s=0.1, e2e_s=0.1 + 10 * 0.06),  # TPOT missed
        TrafficRecord(t, 100, 0, 1, "d", ttft_s=0.3, e2e_s=0.3),  # one token: TTFT alone
        TrafficRecord(t, 100, 0, 0, "e"),  # failed
        TrafficRecord(t, 100, 0, 64, "f", done=False),  # still in flight: a miss
    ]
    assert served_share(records, slo) == pytest.approx(2 / 6)
    assert served_share([], slo) == 0.0
    # the SLOs not given are the simulator's, relative to the machine
    step = synthetic_profile("cpu").step(1)
    derived = window_slo(step, records)
    assert derived.ttft_ms == pytest.approx(5000 * step.prefill_seconds(100))
    assert window_slo(step, records, 450.0, 60.0) == SLO(450.0, 60.0)


def test_steady_load_never_flaps():
    """Scores that wobble around a tie under a steady load: no decision moves."""
    wobble = iter([1.0, 1.05, 1.0, 0.97, 1.0, 1.08] * 20)
    s = Autoscaler([MIXED, SPLIT], lambda c, r: next(wobble) if c == SPLIT else 1.0)
    decisions = [s.decide(t * 20.0, MIXED, RECORDS) for t in range(50)]
    assert all(d.target is None for d in decisions)
    assert {d.reason for d in decisions} <= {"current_best", "gain_below_threshold"}


def test_a_clear_winner_needs_two_wins_then_dwell_holds_the_next_move():
    s = _scaler({MIXED.label: 1.0, SPLIT.label: 2.0})
    first = s.decide(0.0, MIXED, RECORDS)
    assert (first.target, first.reason) == (None, "confirming")
    assert first.scores == {MIXED.label: 1.0, SPLIT.label: 2.0}
    second = s.decide(20.0, MIXED, RECORDS)
    assert (second.target, second.reason, second.action) == (SPLIT, "switch", "switch")
    # The load turns: mixed now wins clearly, but not within the dwell time.
    s.score = lambda c, r: {MIXED.label: 3.0, SPLIT.label: 1.0}[c.label]
    assert s.decide(40.0, SPLIT, RECORDS).reason == "dwell"
    assert s.decide(60.0, SPLIT, RECORDS).reason == "dwell"
    third = s.decide(80.0, SPLIT, RECORDS)
    assert (third.target, third.reason) == (MIXED, "switch")  # two wins and 60 s passed


def test_too_little_traffic_and_a_small_gain_stay():
    s = _scaler({MIXED.label: 1.0, SPLIT.label: 1.05})
    assert s.decide(0.0, MIXED, RECORDS[:3]).reason == "few_requests"
    assert s.decide(0.0, MIXED, RECORDS).reason == "gain_below_threshold"
    s = _scaler({MIXED.label: 0.0, SPLIT.label: 0.5})  # anything beats nothing
    s.decide(0.0, MIXED, RECORDS)
    assert s.decide(20.0, MIXED, RECORDS).target == SPLIT


def test_role_moves_are_fewest_and_keep_a_way_to_serve():
    assert role_changes({"a": "mixed", "b": "mixed"}, SPLIT) == [("a", "decode"),
                                                                ("b", "prefill")]
    assert role_changes({"a": "prefill", "b": "decode"}, MIXED) == [("a", "mixed"),
                                                                   ("b", "mixed")]
    assert role_changes({"a": "prefill", "b": "decode"}, SPLIT) == []
    three = reachable(3, 1, 0)
    assert role_changes({"a": "prefill", "b": "decode", "c": "decode"}, three[2]) == [
        ("c", "prefill")]  # the first decode worker (by name) keeps its role
    with pytest.raises(ValueError, match="needs 2 workers"):
        role_changes({"a": "mixed"}, SPLIT)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_gain"):
        AutoscaleConfig(min_gain=-1)
    with pytest.raises(ValueError, match="candidate"):
        Autoscaler([], lambda c, r: 0.0)


def test_the_simulated_score_does_not_flap_under_a_steady_load():
    """The production score (the simulator on each window's requests) over 30 decisions
    of one steady Poisson load: windows differ only by chance, and the planner moves at
    most once (to whichever configuration it finds better), never back and forth."""
    import random

    from planner.scores import simulated_goodput
    from planner.synthetic import synthetic_profile

    profile = synthetic_profile("cpu")
    rng = random.Random(3)
    t, records = 0.0, []
    while t < 30 * 20 + 60:
        t += rng.expovariate(1.5)
        long = rng.random() < 0.25
        records.append(TrafficRecord(t, 1536 if long else 128, 0, 16 if long else 96))
    score = simulated_goodput(profile, 1, slo_ttft_ms=3000, slo_tpot_ms=150)
    s = Autoscaler([MIXED, SPLIT], score, AutoscaleConfig(interval_s=20, window_s=60,
                                                          min_dwell_s=60))
    current, moves = MIXED, []
    for k in range(30):
        now = 60 + 20 * k
        window = [r for r in records if now - 60 <= r.arrival < now]
        d = s.decide(now, current, window)
        if d.target is not None:
            moves.append(d.target.label)
            current = d.target
    assert len(moves) <= 1, moves


def test_the_pools_serving_while_workers_change_roles():
    three = reachable(3, 2, 0)  # 3 mixed; 1P + 2D; 2P + 1D
    assert moves(MIXED, SPLIT) == ["mixed", "mixed"]
    assert moves(SPLIT, MIXED) == ["prefill", "decode"]
    assert moves(three[1], three[2]) == ["decode"]
    assert moves(SPLIT, SPLIT) == []
    one_mixed = PoolConfig("mixed", mixed_workers=1, mixed_threads=1)
    assert serving_while_moving(MIXED, SPLIT) == one_mixed
    assert serving_while_moving(SPLIT, MIXED) == one_mixed  # the decode worker, whole
    assert serving_while_moving(three[0], three[1]) == PoolConfig(
        "mixed", mixed_workers=2, mixed_threads=2)
    during = serving_while_moving(three[1], three[2])  # a decode worker of two leaves
    assert (during.kind, during.prefill_workers, during.decode_workers) == (
        "disaggregated", 1, 1)
    assert serving_while_moving(SPLIT, SPLIT) == SPLIT
    solo = PoolConfig("mixed", mixed_workers=1, mixed_threads=1)
    assert serving_while_moving(solo, PoolConfig("mixed", mixed_workers=1,
                                                 mixed_threads=2)) == solo


def test_a_switch_pays_for_its_role_changes_over_the_horizon():
    """2 mixed -> 1P+1D is two changes; meanwhile one worker serves (goodput 0.5 of
    the window's traffic here). Over a 60 s horizon 2 x 5 s of changes leave a 2x
    winner +75%; a 1.3x winner whose changes take 2 x 20 s loses; changes longer than
    the horizon leave what one worker serves meanwhile."""
    scores = {MIXED.label: 1.0, SPLIT.label: 2.0, "1 mixed x1t": 0.5}
    s = _scaler(scores, window_s=60, min_dwell_s=30)
    d = s.decide(0.0, MIXED, RECORDS, {"mixed": 5.0})
    assert (d.reason, d.switch_s) == ("confirming", 10.0)
    assert d.net_gain == pytest.approx((0.5 * 10 + 2.0 * 50) / 60 - 1)
    assert s.decide(20.0, MIXED, RECORDS, {"mixed": 5.0}).reason == "switch"
    scores[SPLIT.label] = 1.3
    s = _scaler(scores, window_s=60)
    d = s.decide(0.0, MIXED, RECORDS, {"mixed": 20.0, "decode": 0.0})
    assert (d.reason, d.target) == ("switch_cost", None)
    assert d.net_gain == pytest.approx((0.5 * 40 + 1.3 * 20) / 60 - 1)
    assert s.decide(20.0, MIXED, RECORDS).reason == "confirming"  # changes for free
    s = _scaler(scores, window_s=60, payback_s=30)
    assert s.decide(0.0, MIXED, RECORDS, {"mixed": 20.0}).net_gain == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="payback_s"):
        AutoscaleConfig(payback_s=0)


def test_a_gain_too_small_is_not_weighed_for_its_cost():
    s = _scaler({MIXED.label: 1.0, SPLIT.label: 1.05})
    d = s.decide(0.0, MIXED, RECORDS, {"mixed": 5.0})
    assert (d.reason, d.net_gain, d.switch_s) == ("gain_below_threshold", None, 0.0)


def test_an_unproven_candidate_must_win_by_the_larger_margin():
    """Where the candidate or the current configuration is scored without a calibration
    of its own steps, the switch needs ``min_gain_unproven``; both with one, ``min_gain``.
    The switch's cost is weighed against the same bar."""
    s = _scaler({MIXED.label: 1.0, SPLIT.label: 1.2})
    d = s.decide(0.0, MIXED, RECORDS, proven={MIXED.label})
    assert (d.reason, d.target, d.net_gain) == ("unproven", None, None)
    assert s.decide(20.0, MIXED, RECORDS, proven={MIXED.label}).reason == "unproven"
    assert s.decide(40.0, MIXED, RECORDS, proven=set()).reason == "unproven"
    assert s.decide(50.0, MIXED, RECORDS, proven={SPLIT.label}).reason == "unproven"
    assert s.decide(60.0, MIXED, RECORDS, proven={MIXED.label, SPLIT.label}).reason == \
        "confirming"
    assert s.decide(80.0, MIXED, RECORDS).reason == "switch"  # None: all proven
    s = _scaler({MIXED.label: 1.0, SPLIT.label: 1.5, "1 mixed x1t": 0.5}, window_s=60,
                min_dwell_s=60)
    d = s.decide(0.0, MIXED, RECORDS, {"mixed": 5.0}, proven=())  # +50%; paid: +33%
    assert d.net_gain == pytest.approx((0.5 * 10 + 1.5 * 50) / 60 - 1)
    assert d.reason == "confirming"
    d = s.decide(20.0, MIXED, RECORDS, {"mixed": 7.0}, proven=())  # paid: +26.7%
    assert (d.reason, d.target) == ("switch_cost", None)
    with pytest.raises(ValueError, match="min_gain_unproven"):
        AutoscaleConfig(min_gain=0.4, min_gain_unproven=0.3)


def test_fit_memory_keeps_each_configurations_own_fit_for_a_while():
    m: FitMemory[str] = FitMemory(keep_s=100)
    assert m.own(MIXED.label, 0.0) is None and m.proven(0.0) == set()
    m.note(MIXED.label, "mixed fit", 10.0)
    m.note(SPLIT.label, "split fit", 50.0)
    assert m.own(MIXED.label, 60.0) == "mixed fit" and m.own(SPLIT.label, 60.0) == "split fit"
    assert m.proven(60.0) == {MIXED.label, SPLIT.label}
    assert m.own(MIXED.label, 111.0) is None and m.proven(111.0) == {SPLIT.label}
    m.note(MIXED.label, "newer", 120.0)
    assert m.own(MIXED.label, 121.0) == "newer"
    assert m.own(MIXED.label, 119.0) is None  # not fitted yet then
    with pytest.raises(ValueError, match="remember_s"):
        AutoscaleConfig(remember_s=0)
    assert AutoscaleConfig(window_s=15).memory_s == 150


def test_requests_in_flight_take_the_finished_ones_median_output():
    from common.traffic import expected_outputs

    done = [TrafficRecord(1.0, 100, 0, n, f"d{n}") for n in (10, 30, 500)]
    flying = [TrafficRecord(2.0, 100, 0, 8000, "a", done=False),
              TrafficRecord(3.0, 100, 0, 12, "b", done=False)]
    got = expected_outputs(done + flying)
    assert [r.output_tokens for r in got] == [10, 30, 500, 30, 12]  # median; its bound
    assert expected_outputs(flying) == flying  # nothing finished: the bounds stand
    assert expected_outputs(done) == done
    earlier = [TrafficRecord(0.0, 100, 0, n, f"e{n}") for n in (400, 600, 700)]
    got = expected_outputs(flying, earlier)  # the ended ones of a longer span
    assert [r.output_tokens for r in got] == [600, 12]
    assert [r.output_tokens for r in expected_outputs(done + flying, earlier)][3] == 450


def _chooser(figures, **kw):
    """A chooser over caps 0 / 64 / 256 whose predictions are ``figures[cap]``."""
    def predict(config, records):
        g, itl = figures[config.prefill_tokens_while_decoding]
        return {"goodput": g, "itl_p99_ms": itl}

    return PrefillCapChooser((0, 64, 256), predict, **kw)


def test_the_cap_with_the_lowest_itl_among_the_near_best_goodputs_wins_twice_in_a_row():
    # 64 has the lowest ITL but loses 10% goodput; 256 is within 5% and halves ITL p99.
    c = _chooser({0: (1.00, 900.0), 64: (0.90, 150.0), 256: (0.97, 300.0)})
    first = c.decide(0.0, MIXED, RECORDS)
    assert (first.target, first.reason, first.current) == (None, "confirming", 0)
    assert first.predicted[64] == (0.90, 150.0)
    second = c.decide(5.0, MIXED, RECORDS)
    assert (second.target, second.reason) == (256, "switch")
    capped = MIXED.__class__(**{**MIXED.as_dict(), "prefill_tokens_while_decoding": 256})
    assert c.decide(10.0, capped, RECORDS).reason == "current_best"


def test_the_cap_is_kept_when_no_other_cuts_itl_or_serves_more_by_the_margins():
    c = _chooser({0: (1.00, 100.0), 64: (1.00, 90.0), 256: (1.00, 95.0)})
    assert [c.decide(t, MIXED, RECORDS).reason for t in (0.0, 5.0, 10.0)] == [
        "below_threshold"] * 3  # 10% lower ITL p99: below the 20% margin
    quiet = _chooser({0: (1.0, 900.0), 64: (1.0, 100.0), 256: (1.0, 100.0)})
    assert quiet.decide(0.0, MIXED, RECORDS[:5]).reason == "few_requests"
    # Unsteady predictions: a leader that changes between decisions never switches.
    tables = [{0: (1.0, 900.0), 64: (1.0, 100.0), 256: (1.0, 400.0)},
              {0: (1.0, 900.0), 64: (1.0, 400.0), 256: (1.0, 100.0)}]
    flip = _chooser(tables[0])
    for k in range(10):
        flip.predict = _chooser(tables[k % 2]).predict
        assert flip.decide(5.0 * k, MIXED, RECORDS).target is None


def test_the_caps_tried_are_relative_to_the_machine():
    from planner.synthetic import synthetic_profile

    cpu, gpu = synthetic_profile("cpu"), synthetic_profile("gpu")
    caps_cpu, caps_gpu = prefill_caps(cpu, 1), prefill_caps(gpu, 1)
    assert caps_cpu[0] == 0 and caps_gpu[0] == 0 and len(caps_cpu) > 1
    assert all(c % cpu.block_size == 0 for c in caps_cpu)
    assert max(caps_gpu) > max(caps_cpu)  # a GPU computes more prompt in a decode's time
    assert max(caps_gpu) <= gpu.max_num_batched_tokens


def test_the_simulated_cap_cuts_itl_p99_under_load_and_keeps_the_prompt_tokens():
    """The simulator runs the real scheduler with the cap: under a load of long prompts
    and decodes, ITL p99 falls well below the uncapped one's; with nothing decoding
    beside it, a lone long prompt's TTFT is unchanged."""
    import random

    from planner.scores import simulated
    from planner.synthetic import synthetic_profile

    profile = synthetic_profile("cpu")
    rng = random.Random(5)
    t, records = 0.0, []
    while t < 40:
        t += rng.expovariate(2.0)
        long = rng.random() < 0.25
        records.append(TrafficRecord(t, 1536 if long else 128, 0, 16 if long else 96))
    figures = simulated(profile, 1, slo_ttft_ms=3000, slo_tpot_ms=150)
    cap = prefill_caps(profile, 1)[1]
    capped = MIXED.__class__(**{**MIXED.as_dict(), "prefill_tokens_while_decoding": cap})
    loaded = figures(MIXED, records)["itl_p99_ms"], figures(capped, records)["itl_p99_ms"]
    assert loaded[1] < 0.5 * loaded[0], loaded
    lone = [TrafficRecord(0.0, 1536, 0, 4)]
    assert figures(capped, lone)["ttft_p50_ms"] == figures(MIXED, lone)["ttft_p50_ms"]


def test_a_candidate_is_scored_with_its_best_cap_so_a_cap_can_stop_a_split():
    """The overloaded windows of a headline run: two mixed workers predicted 1.12 req/s
    without a cap and 1.42 with one, the split 1.67. Against the uncapped mixed the split
    wins by 49% (past the 30% margin); against its best cap by 17%: no switch."""
    from dataclasses import replace

    table = {("mixed", 0): 1.12, ("mixed", 192): 1.42, ("mixed", 64): 0.9,
             ("disaggregated", 0): 1.67, ("disaggregated", 192): 1.60}

    def figures(cfg, records):
        return {"goodput": table[cfg.kind, cfg.prefill_tokens_while_decoding]}

    score = best_cap_goodput(figures, (0, 192))
    assert (score(MIXED, RECORDS), score(SPLIT, RECORDS)) == (1.42, 1.67)
    assert score(replace(MIXED, prefill_tokens_while_decoding=64), RECORDS) == 1.42
    cfg = AutoscaleConfig(min_dwell_s=0, confirmations=1)
    plain = lambda c, r: figures(c, r)["goodput"]  # noqa: E731
    capped = Autoscaler([MIXED, SPLIT], plain, cfg, refine=score)
    d = capped.decide(0.0, MIXED, RECORDS, proven=())
    assert (d.target, d.reason) == (None, "unproven")
    assert d.scores == {MIXED.label: 1.42, SPLIT.label: 1.67}  # refined
    uncapped = Autoscaler([MIXED, SPLIT], plain, cfg)
    assert uncapped.decide(0.0, MIXED, RECORDS, proven=()).target == SPLIT


def test_no_unproven_leap_while_the_current_configuration_is_overloaded():
    """60 requests in a 60 s window: 1 req/s offered. Two mixed workers predicted to
    serve 0.5 req/s within the SLOs (under 75% of it) and the split 1.0: a 100% gain,
    past the unproven margin, but the split is not entered; proven, it is."""
    busy = [TrafficRecord(float(i), 1536, 0, 16) for i in range(60)]
    s = _scaler({MIXED.label: 0.5, SPLIT.label: 1.0}, window_s=60, min_dwell_s=0,
                confirmations=1)
    d = s.decide(0.0, MIXED, busy, proven={MIXED.label})
    assert (d.reason, d.target) == ("overloaded", None)
    assert s.decide(5.0, MIXED, busy, proven={MIXED.label, SPLIT.label}).target == SPLIT
    served = _scaler({MIXED.label: 0.8, SPLIT.label: 1.2}, window_s=60, confirmations=1)
    assert served.decide(0.0, MIXED, busy, proven=()).target == SPLIT  # 80% served: not
    with pytest.raises(ValueError, match="min_served_unproven"):
        AutoscaleConfig(min_served_unproven=1.5)


def test_an_unproven_leap_is_made_where_the_current_configuration_measurably_fails():
    """20 requests in a 60 s window (1/3 req/s). Two mixed workers predicted to serve
    0.2 req/s and measured serving 10% of their requests within the SLOs (under 30%):
    little is left to lose, the split predicted 0.24 (20% more, not the unproven 30%) is
    entered to be measured, at the first such decision (no confirmation). Measured
    serving 40% or 60%, the margin and the guard stand."""
    busy = [TrafficRecord(float(i), 1536, 0, 16) for i in range(0, 60, 3)]
    s = _scaler({MIXED.label: 0.2, SPLIT.label: 0.24}, window_s=60, min_dwell_s=0,
                confirmations=2)
    assert s.decide(0.0, MIXED, busy, proven={MIXED.label}).reason == "unproven"
    assert s.decide(0.0, MIXED, busy, proven={MIXED.label}, served=0.4).reason == "unproven"
    d = s.decide(0.0, MIXED, busy, proven={MIXED.label}, served=0.1)  # at once
    assert (d.reason, d.target, d.served) == ("rescue", SPLIT, 0.1)
    guarded = _scaler({MIXED.label: 0.2, SPLIT.label: 1.0}, window_s=60, confirmations=1)
    assert guarded.decide(0.0, MIXED, busy, proven=(), served=0.6).reason == "overloaded"
    assert guarded.decide(0.0, MIXED, busy, proven=()).reason == "overloaded"  # unmeasured
    with pytest.raises(ValueError, match="max_served_rescue"):
        AutoscaleConfig(max_served_rescue=-0.1)


def test_misses_are_the_decodes_when_none_missed_ttft_and_tpot_outnumbers_the_unknown():
    slo = SLO(ttft_ms=500, tpot_ms=50)

    def rec(ttft=0.1, tpot=0.04, out=11, done=True):
        return TrafficRecord(0.0, 100, 0, out, ttft_s=ttft if done else None, done=done,
                             e2e_s=ttft + (out - 1) * tpot if done else None)

    met, slow, queued, flight = rec(), rec(tpot=0.08), rec(ttft=0.6), rec(done=False)
    assert tpot_bound([met, slow, slow, flight], slo)  # 2 TPOT misses, 1 in flight
    assert not tpot_bound([met, slow, flight], slo)  # as many in flight: unknown
    assert not tpot_bound([slow, slow, slow, queued], slo)  # one waited for its first token
    assert not tpot_bound([met, met], slo) and not tpot_bound([], slo)  # no miss
    failed = TrafficRecord(0.0, 100, 0, 0)  # ended with no token: unknown
    assert not tpot_bound([slow, failed], slo)
    # a miss past an end-to-end SLO alone is of no known kind
    e2e = SLO(ttft_ms=500, tpot_ms=50, e2el_ms=300)
    assert not tpot_bound([slow, rec(), rec()], e2e)  # 1 TPOT, 2 past e2e (0.5 s) alone
    assert tpot_bound([slow, slow, rec()], e2e)
    assert tpot_bound([slow], SLO(tpot_ms=50)) and not tpot_bound([slow], SLO(ttft_ms=500))


def test_an_overloaded_configuration_whose_misses_were_the_decodes_may_be_left():
    """The guard's setup (two mixed workers predicted 0.5 req/s of 1 offered, the split
    1.0, unproven): measured failing on TPOT alone, the split is entered; the unproven
    margin still holds (a 20% lead: ``unproven``)."""
    busy = [TrafficRecord(float(i), 1536, 0, 16) for i in range(60)]
    s = _scaler({MIXED.label: 0.5, SPLIT.label: 1.0}, window_s=60, min_dwell_s=0,
                confirmations=1)
    assert s.decide(0.0, MIXED, busy, proven={MIXED.label}, served=0.5).reason == "overloaded"
    d = s.decide(5.0, MIXED, busy, proven={MIXED.label}, served=0.5, tpot_bound=True)
    assert (d.reason, d.target, d.served, d.tpot_bound) == ("switch", SPLIT, 0.5, True)
    near = _scaler({MIXED.label: 0.5, SPLIT.label: 0.6}, window_s=60, confirmations=1)
    assert near.decide(0.0, MIXED, busy, proven=(), served=0.5,
                       tpot_bound=True).reason == "unproven"


def test_window_prompts_share_what_the_routers_saw_cached():
    import random

    from planner.window import window_prompts

    records = [TrafficRecord(0.0, 100, 0, 8), TrafficRecord(1.0, 40, 0, 8),
               TrafficRecord(2.0, 300, 96, 8), TrafficRecord(3.0, 50, 80, 8),
               TrafficRecord(4.0, 500, 400, 8), TrafficRecord(5.0, 64, 64, 8)]
    p = window_prompts(records, random.Random(1))
    assert [len(x) for x in p] == [100, 40, 300, 50, 500, 64]
    assert p[2][:96] == p[0][:96]  # the latest earlier prompt of 96+ tokens
    assert p[2][96:100] != p[0][96:100]
    assert p[3][:49] == p[2][:49]  # at most all but one of its own 50 tokens
    assert len(p[2]) == 300 and p[4][:300] != p[2]  # nothing earlier that long: fresh
    assert p[5][:63] == p[4][:63] and len(p[5]) == 64
    plain = [TrafficRecord(r.arrival, r.prompt_tokens, 0, 8) for r in records]
    rng = random.Random(1)
    fresh = window_prompts(plain, random.Random(1))
    assert fresh == [[rng.choice(DEFAULT_IDS) for _ in range(len(x))] for x in fresh]


def test_a_window_with_cached_prefixes_predicts_the_cache_hits():
    """A chat-like window (each conversation's next turn extends its last prompt): with
    the cached tokens the routers logged, the simulated workers compute less of each
    prompt than with fresh prompts, and the first token comes sooner."""
    from planner.scores import simulated
    from planner.synthetic import synthetic_profile

    records, t = [], 0.0
    for turn in range(3):
        for _ in range(8):
            t += 0.4
            prompt = 192 + turn * 256
            records.append(TrafficRecord(t, prompt, max(0, prompt - 256), 64))
    figures = simulated(synthetic_profile("cpu"), 1, slo_ttft_ms=3000, slo_tpot_ms=150)
    fresh = [TrafficRecord(r.arrival, r.prompt_tokens, 0, 64) for r in records]
    for config in (MIXED, SPLIT):
        cached, plain = figures(config, records), figures(config, fresh)
        assert cached["ttft_p90_ms"] < 0.9 * plain["ttft_p90_ms"], (config.label, cached,
                                                                    plain)


def _chat_window(served_x: float, linked: bool = True) -> list[TrafficRecord]:
    """Eight 3-turn conversations 12 s apart, each turn sent the moment the one before
    it ended, as the routers log them: with the parent's key (``linked``), latencies
    ``served_x`` those of an unloaded synthetic-CPU worker."""
    step = synthetic_profile("cpu").step(1)
    records = []
    for c in range(8):
        t, parent = 12.0 * c, ""
        for turn in range(3):
            n = 192 + 256 * turn
            cached = n - 256 if turn else 0
            ttft = step.prefill_seconds(n - cached, cached)
            e2e = served_x * (ttft + 63 * step.decode_seconds(1, n))
            key = f"c{c}t{turn}"
            records.append(TrafficRecord(t, n, cached, 64, key, ttft_s=served_x * ttft,
                                         e2e_s=e2e, parent=parent if linked else ""))
            parent, t = key, t + e2e
    return records


def test_a_window_replays_a_conversations_turns_one_after_another():
    """window_requests: a turn whose parent ended in the window follows it by the pause
    it had, its prompt beginning with the parent's; anything else starts a session at
    its arrival: a parent still running or with no latencies, one that ended after the
    request came, a parent's second continuation, a parent outside the window."""
    import random

    from planner.window import window_requests

    records = [
        TrafficRecord(10.0, 192, 0, 64, "a", ttft_s=0.2, e2e_s=1.0),
        TrafficRecord(11.3, 448, 192, 64, "b", ttft_s=0.2, e2e_s=1.0, parent="a"),
        TrafficRecord(11.5, 448, 192, 64, "c", ttft_s=0.2, e2e_s=1.0, parent="a"),  # 2nd
        TrafficRecord(12.0, 100, 0, 64, "d", done=False),  # in flight
        TrafficRecord(12.5, 300, 96, 64, "e", parent="d"),
        TrafficRecord(13.0, 100, 0, 64, "f", ttft_s=0.2, e2e_s=4.0),
        TrafficRecord(14.0, 300, 96, 64, "g", parent="f"),  # came before f ended
        TrafficRecord(15.0, 300, 0, 64, "h", parent="gone"),  # before the window
    ]
    requests, starts = window_requests(records[::-1], random.Random(3))  # any order in
    assert [r.conversation for r in requests] == [0, 0, 1, 2, 3, 4, 5, 6]
    assert starts == pytest.approx([0.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0])
    assert requests[1].think_s == pytest.approx(0.3)
    assert all(r.think_s is None for i, r in enumerate(requests) if i != 1)
    assert requests[1].prompt[:192] == requests[0].prompt
    assert requests[2].prompt[:191] == requests[0].prompt[:191]  # linked, own session
    assert requests[4].prompt[:100] == requests[3].prompt  # its parent's, not a guess
    assert [len(r.prompt) for r in requests] == [192, 448, 448, 100, 300, 100, 300, 300]


def test_linked_turns_do_not_predict_the_stalls_of_turns_replayed_each_at_its_arrival():
    """A 2-core EPYC's chat headline: turn k+1 comes the moment turn k's reply ended,
    served 10% faster than the simulated worker steps. Replayed each at its arrival,
    turn k+1 reached the worker caching its prefix while turn k still decoded there in
    the simulation, and its prefill stalled turn k's last token: ITL p99 the prefill's
    length (the planner then split two mixed workers at 25% load for an ITL they never
    had). Linked, each turn follows its parent's simulated end: no stall."""
    from planner.scores import simulated

    figures = simulated(synthetic_profile("cpu"), 1, slo_ttft_ms=3000, slo_tpot_ms=150)
    decode_ms = 1000 * synthetic_profile("cpu").step(1).decode_seconds(1, 704)
    linked = figures(MIXED, _chat_window(0.9))
    apart = figures(MIXED, _chat_window(0.9, linked=False))
    assert linked["itl_p99_ms"] < 1.5 * decode_ms < 4 * decode_ms < apart["itl_p99_ms"]
    assert linked["goodput_fraction"] == 1.0
    # served slower than simulated, each turn came after its simulated parent ended
    # anyway: the same either way
    assert (figures(MIXED, _chat_window(1.2))["itl_p99_ms"]
            == figures(MIXED, _chat_window(1.2, linked=False))["itl_p99_ms"])


def _itl_scaler(goodput, itl, **kw):
    cfg = AutoscaleConfig(**{"min_dwell_s": 0, "confirmations": 2, "window_s": 20, **kw})
    return Autoscaler([MIXED, SPLIT], lambda c, r: goodput.get(c.label, 0.0), cfg,
                      itl=lambda c, r: itl[c.label])  # another (moving): serves nothing


def test_equal_goodput_and_a_much_lower_itl_moves_the_workers():
    """The chat headline's case: the split predicted 2% less goodput and 0.4x the ITL p99
    of two mixed workers; it wins on ITL, confirmed twice, and says so."""
    goodput, itl = {MIXED.label: 1.0, SPLIT.label: 0.98}, {MIXED.label: 500, SPLIT.label: 200}
    s = _itl_scaler(goodput, itl)
    first = s.decide(0.0, MIXED, RECORDS, proven=())
    assert (first.target, first.reason) == (None, "confirming")
    assert first.itl_p99_ms == {MIXED.roles_label: 500, SPLIT.roles_label: 200}
    d = s.decide(5.0, MIXED, RECORDS, proven=())
    assert (d.target, d.reason, d.action) == (SPLIT, "lower_itl", "switch")
    # There, the same figures keep it: it is the near-best of lowest ITL, and mixed's
    # 2% more goodput is under the goodput rule's margin.
    assert s.decide(10.0, SPLIT, RECORDS).reason == "gain_below_threshold"
    assert s.decide(15.0, SPLIT, RECORDS).target is None


def test_a_configuration_that_fails_where_its_stalls_are_predicted_is_scored_as_served():
    """The chat headline's 85% point (20 requests in 20 s: 1 req/s): two mixed workers
    predicted 0.8 req/s and the split 0.6, while mixed measurably serves 20% (0.2 req/s)
    and is predicted 500 ms of ITL p99 against the split's 45. Its prediction is not
    held above its measurement: the split, 3x that, is entered at once (``stalled``).
    Not without the ITL prediction, nor where the split is predicted only 0.6x the ITL
    p99, nor where mixed serves 40%: there the prediction stands and mixed is best."""
    goodput = {MIXED.label: 0.8, SPLIT.label: 0.6}
    d = _itl_scaler(goodput, {MIXED.label: 500, SPLIT.label: 45}).decide(
        0.0, MIXED, RECORDS, proven=(), served=0.2)
    assert (d.target, d.reason) == (SPLIT, "stalled")
    assert d.scores == {MIXED.roles_label: pytest.approx(0.2), SPLIT.roles_label: 0.6}
    assert _scaler(goodput, window_s=20).decide(
        0.0, MIXED, RECORDS, proven=(), served=0.2).reason == "current_best"
    for itl, served in (({MIXED.label: 500, SPLIT.label: 300}, 0.2),
                        ({MIXED.label: 500, SPLIT.label: 45}, 0.4)):
        d = _itl_scaler(goodput, itl).decide(0.0, MIXED, RECORDS, proven=(), served=served)
        assert (d.target, d.reason) == (None, "current_best"), (itl, served)


def test_no_rescue_leads_back_to_the_configuration_predicted_to_stall():
    """The split failing at overload (5% served), two mixed workers predicted 4% more
    goodput than the split's prediction and 10x its ITL p99: the split's prediction
    stands (the stalls are mixed's), and 4% moves nothing. Predicted 60% more, the
    rescue is refused (``stalling``: the same stalls, the mirror of ``stalled``); it is
    made without an ITL score, or where mixed is predicted under twice the split's ITL
    p99, or (no rescue then, a switch) where the split serves 30% of its requests."""
    itl = {MIXED.label: 500, SPLIT.label: 45}
    s = _itl_scaler({MIXED.label: 0.26, SPLIT.label: 0.25}, itl, confirmations=1)
    d = s.decide(0.0, SPLIT, RECORDS, proven=(), served=0.05)
    assert (d.target, d.reason) == (None, "gain_below_threshold")
    assert d.scores[SPLIT.roles_label] == 0.25
    goodput = {MIXED.label: 0.4, SPLIT.label: 0.25}
    s = _itl_scaler(goodput, itl, confirmations=1)
    assert s.decide(0.0, SPLIT, RECORDS, proven=(), served=0.05).reason == "stalling"
    blind = _scaler(goodput, window_s=20, min_dwell_s=0, confirmations=1)
    close = _itl_scaler(goodput, {MIXED.label: 80, SPLIT.label: 45}, confirmations=1)
    for scaler in (blind, close):
        d = scaler.decide(0.0, SPLIT, RECORDS, proven=(), served=0.05)
        assert (d.target, d.reason) == (MIXED, "rescue")
    d = _itl_scaler(goodput, itl, confirmations=1).decide(0.0, SPLIT, RECORDS, served=0.3)
    assert (d.target, d.reason) == (MIXED, "switch")  # both proven, not failing


def test_a_stalled_rescue_weighs_only_the_quicker_candidates():
    """Three workers: three mixed (A, failing: 10% served, 100 ms of ITL p99), 1P+2D (B,
    60 ms, the most predicted goodput) and 2P+1D (C, 25 ms). Only C is predicted half
    A's ITL p99, so only C is weighed against A's 0.1 req/s: the move goes to C, not to
    B, whose prediction the stalls set aside as much as A's."""
    a, b, c = reachable(3, 1, 32)
    goodput = {a.label: 0.8, b.label: 0.9, c.label: 0.5}
    itl = {a.label: 100.0, b.label: 60.0, c.label: 25.0}
    s = Autoscaler([a, b, c], lambda cand, r: goodput[cand.label],
                   AutoscaleConfig(min_dwell_s=0, window_s=20),
                   itl=lambda cand, r: itl[cand.label])
    d = s.decide(0.0, a, RECORDS, proven=(), served=0.1)
    assert (d.target, d.reason) == (c, "stalled")
    assert set(d.scores) == {a.roles_label, c.roles_label}


def test_a_configuration_left_for_its_stalls_is_scored_at_most_what_it_served():
    """After the stalled move (two mixed workers serving 20%: 0.2 req/s), the split
    serves 40%: two mixed workers' prediction of 0.8 would take the workers back (both
    proven, 60% more than 0.5), and they would stall again. For ``memory_s`` (10
    windows: 200 s) they are scored at most 0.2; after it, at their prediction."""
    goodput = {MIXED.label: 0.8, SPLIT.label: 0.5}
    itl = {MIXED.label: 500, SPLIT.label: 45}
    s = _itl_scaler(goodput, itl, confirmations=1)
    assert s.decide(0.0, MIXED, RECORDS, served=0.2).reason == "stalled"
    d = s.decide(100.0, SPLIT, RECORDS, served=0.4)
    assert (d.target, d.reason) == (None, "current_best")
    assert d.scores[MIXED.roles_label] == pytest.approx(0.2)
    later = s.decide(300.0, SPLIT, RECORDS, served=0.4)
    assert (later.target, later.reason) == (MIXED, "switch")


def test_no_rule_moves_to_the_stalls_while_the_current_configuration_fails():
    """The split failing (10% served), predicted 1.0 req/s against two mixed workers'
    1.08 (under the goodput rule's 10%) and at twice the load 1.0 against their 2.0:
    rule 2c would take the room; two mixed workers are predicted 10x its ITL p99, so
    the move is refused (``stalling``). With the split serving 80%, 2c moves."""
    s = _roomy_scaler({MIXED.label: 1.08, SPLIT.label: 1.0},
                      {MIXED.label: 2.0, SPLIT.label: 1.0},
                      itl={MIXED.label: 500.0, SPLIT.label: 45.0}, confirmations=1)
    d = s.decide(0.0, SPLIT, RECORDS, served=0.1)
    assert (d.target, d.reason) == (None, "stalling")
    assert s.decide(1.0, SPLIT, RECORDS, served=0.8).reason == "headroom"


def test_no_move_for_itl_without_a_large_gain_or_near_equal_goodput():
    s = _itl_scaler({MIXED.label: 1.0, SPLIT.label: 0.98}, {MIXED.label: 500, SPLIT.label: 400})
    assert all(s.decide(t, MIXED, RECORDS).reason == "current_best" for t in (0.0, 5.0, 10.0))
    # 0.6x the ITL: past the proven margin, not the unproven one.
    s = _itl_scaler({MIXED.label: 1.0, SPLIT.label: 0.98}, {MIXED.label: 500, SPLIT.label: 300})
    assert s.decide(0.0, MIXED, RECORDS, proven={MIXED.roles_label}).reason == "unproven"
    assert s.decide(5.0, MIXED, RECORDS, proven=None).reason == "confirming"
    # 8% less goodput is not near-equal: goodput decides, and stays.
    s = _itl_scaler({MIXED.label: 1.0, SPLIT.label: 0.92}, {MIXED.label: 500, SPLIT.label: 100})
    d = s.decide(0.0, MIXED, RECORDS)
    assert (d.reason, d.itl_p99_ms) == ("current_best", {})
    # Nothing served anywhere: ITL does not decide among equal zeros.
    s = _itl_scaler({MIXED.label: 0.0, SPLIT.label: 0.0}, {MIXED.label: 500, SPLIT.label: 100})
    assert s.decide(0.0, MIXED, RECORDS, proven=None).itl_p99_ms == {}
    # Compared and no move (the current one is the quickest): the figures still shown.
    s = _itl_scaler({MIXED.label: 1.0, SPLIT.label: 1.0}, {MIXED.label: 100, SPLIT.label: 500})
    d = s.decide(0.0, MIXED, RECORDS)
    assert (d.reason, d.itl_p99_ms) == ("current_best", {MIXED.roles_label: 100,
                                                         SPLIT.roles_label: 500})


def test_entered_for_itl_left_only_for_a_goodput_margin():
    """The band between the rules: in the split for its ITL, two mixed workers predicted
    7% more goodput do not bring the workers back (under min_gain 10%), 15% do."""
    itl = {MIXED.label: 500, SPLIT.label: 200}
    s = _itl_scaler({MIXED.label: 1.07, SPLIT.label: 1.0}, itl, confirmations=1)
    assert s.decide(0.0, SPLIT, RECORDS).reason == "gain_below_threshold"
    s = _itl_scaler({MIXED.label: 1.15, SPLIT.label: 1.0}, itl, confirmations=1)
    d = s.decide(0.0, SPLIT, RECORDS)
    assert (d.target, d.reason) == (MIXED, "switch")


def test_an_itl_move_is_made_overloaded_but_not_at_a_goodput_cost():
    itl = {MIXED.label: 900, SPLIT.label: 100}
    # 20 requests in a 20 s window, both predicted to serve 0.5/s: overloaded, yet no
    # gain is asked for, so not refused for it (unlike rule 3's unproven leaps).
    s = _itl_scaler({MIXED.label: 0.5, SPLIT.label: 0.5}, itl, confirmations=1)
    d = s.decide(0.0, MIXED, RECORDS, proven=())
    assert (d.target, d.reason) == (SPLIT, "lower_itl")
    # Two 5 s changes during which nothing is served, over a 20 s horizon: half lost.
    s = _itl_scaler({MIXED.label: 1.0, SPLIT.label: 1.0}, itl, confirmations=1)
    d = s.decide(0.0, MIXED, RECORDS, move_s={"mixed": 5.0})
    assert (d.target, d.reason) == (None, "switch_cost")
    assert (d.net_gain, d.switch_s) == (-0.5, 10.0)


def _moves(s: Autoscaler, current: PoolConfig, decisions: int) -> list[PoolConfig]:
    """The moves ``s`` makes in ``decisions`` decisions a second apart, from ``current``."""
    moved = []
    for t in range(decisions):
        d = s.decide(float(t), current, RECORDS)
        if d.target is not None:
            moved.append(d.target)
            current = d.target
    return moved


def test_steady_load_with_itl_never_flaps():
    """Goodputs that wobble around a tie and ITLs around a 2x gap, for 100 decisions:
    one move to the quicker split, none back."""
    wobble = iter([1.0, 1.04, 0.98, 0.97, 1.02, 1.03] * 40)
    cfg = AutoscaleConfig(min_dwell_s=0, confirmations=2, window_s=20)
    s = Autoscaler([MIXED, SPLIT], lambda c, r: next(wobble) if c == SPLIT else 1.0, cfg,
                   itl=lambda c, r: 200.0 if c == SPLIT else 450.0)
    assert _moves(s, MIXED, 100) == [SPLIT]


def _roomy_scaler(goodput, heavy, itl=None, heavy_itl=None, **kw):
    cfg = AutoscaleConfig(**{"min_dwell_s": 0, "confirmations": 2, "window_s": 20, **kw})
    return Autoscaler([MIXED, SPLIT], lambda c, r: goodput[c.label], cfg,
                      itl=(lambda c, r: itl[c.label]) if itl else None,
                      headroom=lambda c, r: heavy[c.label],
                      headroom_itl=(lambda c, r: heavy_itl[c.label]) if heavy_itl else None)


def test_a_tie_is_broken_toward_the_configuration_with_room_to_grow():
    """Rule 2c, the chat headline's case on a 2-core EPYC: both serve the window whole
    (a tie), and at twice its load the split is predicted 1.7 req/s against 1.1; the
    workers move, confirmed twice, and there the same figures keep them."""
    s = _roomy_scaler({MIXED.label: 1.0, SPLIT.label: 0.98},
                      {MIXED.label: 1.1, SPLIT.label: 1.7})
    first = s.decide(0.0, MIXED, RECORDS, proven=())
    assert (first.target, first.reason) == (None, "confirming")
    assert first.headroom_goodput == {MIXED.roles_label: 1.1, SPLIT.roles_label: 1.7}
    d = s.decide(5.0, MIXED, RECORDS, proven=())
    assert (d.target, d.reason, d.action) == (SPLIT, "headroom", "switch")
    assert all(s.decide(t, SPLIT, RECORDS, proven=()).target is None for t in (10.0, 15.0))
    # Between the rules' margins (7% more now: the goodput rule waits for 10%), room
    # decides too; 12% more now, the goodput rule does (no figures of room taken).
    s = _roomy_scaler({MIXED.label: 1.0, SPLIT.label: 1.07},
                      {MIXED.label: 1.1, SPLIT.label: 1.7}, confirmations=1)
    assert (s.decide(0.0, MIXED, RECORDS).reason) == "headroom"
    s = _roomy_scaler({MIXED.label: 1.0, SPLIT.label: 1.12},
                      {MIXED.label: 1.1, SPLIT.label: 1.7}, confirmations=1)
    d = s.decide(0.0, MIXED, RECORDS)
    assert (d.reason, d.headroom_goodput) == ("switch", {})


def test_no_move_for_headroom_without_a_tie_a_margin_or_against_rule_2b():
    # 8% more room: under min_gain. 20% more, unproven: under min_gain_unproven.
    s = _roomy_scaler({MIXED.label: 1.0, SPLIT.label: 1.0}, {MIXED.label: 1.0, SPLIT.label: 1.08})
    assert all(s.decide(t, MIXED, RECORDS).target is None for t in (0.0, 5.0, 10.0))
    s = _roomy_scaler({MIXED.label: 1.0, SPLIT.label: 1.0}, {MIXED.label: 1.0, SPLIT.label: 1.2})
    assert s.decide(0.0, MIXED, RECORDS, proven={MIXED.roles_label}).reason == "current_best"
    assert s.decide(5.0, MIXED, RECORDS, proven=None).reason == "confirming"
    # Not tied at the window's load (8% less): goodput decides.
    s = _roomy_scaler({MIXED.label: 1.0, SPLIT.label: 0.92}, {MIXED.label: 1.0, SPLIT.label: 2.0})
    assert s.decide(0.0, MIXED, RECORDS).reason == "current_best"
    # Roomier but 2.5x the ITL p99: rule 2b would bring the workers back. No move.
    s = _roomy_scaler({MIXED.label: 1.0, SPLIT.label: 1.0}, {MIXED.label: 1.0, SPLIT.label: 2.0},
                      itl={MIXED.label: 200.0, SPLIT.label: 500.0})
    assert all(s.decide(t, MIXED, RECORDS).target is None for t in (0.0, 5.0, 10.0))
    # Rule 2b first: a much quicker split moves for its ITL, not for its room.
    s = _roomy_scaler({MIXED.label: 1.0, SPLIT.label: 1.0}, {MIXED.label: 1.0, SPLIT.label: 2.0},
                      itl={MIXED.label: 500.0, SPLIT.label: 100.0}, confirmations=1)
    assert s.decide(0.0, MIXED, RECORDS).reason == "lower_itl"
    with pytest.raises(ValueError, match="headroom"):
        AutoscaleConfig(headroom=-0.5)


def test_a_tie_at_the_heavier_load_too_is_broken_on_its_itl():
    """Rule 2c on ITL, the chat headline's seed 0 on a 2-core EPYC: tied at the window's
    load and at twice it (1.33 req/s each), two mixed workers predicted an ITL p99 of
    500 ms there and the split 45 ms. The workers move, confirmed twice; there, nothing
    moves them back."""
    s = _roomy_scaler({MIXED.label: 1.0, SPLIT.label: 1.0}, {MIXED.label: 1.33, SPLIT.label: 1.33},
                      itl={MIXED.label: 30.0, SPLIT.label: 35.0},
                      heavy_itl={MIXED.label: 500.0, SPLIT.label: 45.0})
    first = s.decide(0.0, MIXED, RECORDS, proven=())
    assert (first.target, first.reason) == (None, "confirming")
    assert first.headroom_itl_p99_ms == {MIXED.roles_label: 500.0, SPLIT.roles_label: 45.0}
    d = s.decide(5.0, MIXED, RECORDS, proven=())
    assert (d.target, d.reason) == (SPLIT, "headroom")
    assert all(s.decide(t, SPLIT, RECORDS, proven=()).target is None for t in (10.0, 15.0))


def test_no_move_for_itl_at_the_heavier_load_without_its_goodput_or_a_margin():
    """The mixed workload's windows: the split quicker at twice the load but serving
    less there (0.67 against 1.2 req/s; one prefill worker computes every long prompt);
    or as much, 0.6x the ITL p99 unproven (0.5x asked), or 0.7x proven (0.6x asked)."""
    quick = {MIXED.label: 88.0, SPLIT.label: 44.0}
    s = _roomy_scaler({MIXED.label: 1.0, SPLIT.label: 1.0}, {MIXED.label: 1.2, SPLIT.label: 0.67},
                      heavy_itl=quick)
    d = s.decide(0.0, MIXED, RECORDS, proven=())
    assert (d.target, d.reason, d.headroom_itl_p99_ms) == (None, "current_best",
                                                           {MIXED.roles_label: 88.0})
    tied = {MIXED.label: 1.0, SPLIT.label: 1.0}
    s = _roomy_scaler(tied, tied, heavy_itl={MIXED.label: 100.0, SPLIT.label: 60.0})
    assert s.decide(0.0, MIXED, RECORDS, proven=()).reason == "current_best"
    assert s.decide(1.0, MIXED, RECORDS, proven=None).reason == "confirming"
    s = _roomy_scaler(tied, tied, heavy_itl={MIXED.label: 100.0, SPLIT.label: 70.0})
    assert s.decide(0.0, MIXED, RECORDS, proven=None).reason == "current_best"
    # Quicker at the heavier load but 2.5x the ITL p99 at the window's: rule 2b would
    # bring the workers back. No move.
    s = _roomy_scaler(tied, tied, itl={MIXED.label: 20.0, SPLIT.label: 50.0},
                      heavy_itl={MIXED.label: 500.0, SPLIT.label: 45.0})
    assert all(s.decide(t, MIXED, RECORDS).target is None for t in (0.0, 5.0, 10.0))


def test_itl_at_the_heavier_load_decides_where_room_misses_its_margin():
    """The split 20% roomier, unproven (30% asked), and a tenth the ITL p99 there:
    it moves on ITL. Among three, one just under the current one's room there but
    10% under another's (which 2c's goodput branch would then move to) is left out."""
    s = _roomy_scaler({MIXED.label: 1.0, SPLIT.label: 1.0}, {MIXED.label: 1.0, SPLIT.label: 1.2},
                      heavy_itl={MIXED.label: 500.0, SPLIT.label: 50.0}, confirmations=1)
    assert (s.decide(0.0, MIXED, RECORDS, proven=()).target) == SPLIT
    three = reachable(3, 1, 32)
    a, b, c = three
    heavy = {a.label: 1.0, b.label: 0.955, c.label: 1.051}
    quick = {a.label: 100.0, b.label: 50.0, c.label: 200.0}
    cfg = AutoscaleConfig(min_dwell_s=0, confirmations=1, window_s=20)
    s = Autoscaler(three, lambda cand, _: 1.0, cfg, headroom=lambda cand, _: heavy[cand.label],
                   headroom_itl=lambda cand, _: quick[cand.label])
    d = s.decide(0.0, a, RECORDS, proven=None)
    assert d.target is None and d.headroom_itl_p99_ms == {a.roles_label: 100.0,
                                                          c.roles_label: 200.0}
    # From the roomiest, one 5% less roomy at half its ITL p99 is a move, and final.
    d = s.decide(1.0, c, RECORDS, proven=None)
    assert (d.target, d.reason) == (a, "headroom")
    assert s.decide(2.0, a, RECORDS, proven=None).target is None


def test_an_unproven_gain_between_the_margins_is_seconded_by_the_heavier_load():
    """The chat headline's 50%-load windows on a 2-core EPYC: the split 20% ahead at the
    window's load, unproven (30% asked), and at twice it as much goodput at a tenth of
    the ITL p99. The heavier load seconds the gain: the workers move, confirmed twice,
    and nothing moves them back."""
    s = _roomy_scaler({MIXED.label: 1.0, SPLIT.label: 1.2}, {MIXED.label: 1.33, SPLIT.label: 1.33},
                      heavy_itl={MIXED.label: 500.0, SPLIT.label: 45.0})
    first = s.decide(0.0, MIXED, RECORDS, proven=())
    assert (first.target, first.reason) == (None, "confirming")
    assert first.headroom_goodput == {MIXED.roles_label: 1.33, SPLIT.roles_label: 1.33}
    assert first.headroom_itl_p99_ms == {MIXED.roles_label: 500.0, SPLIT.roles_label: 45.0}
    d = s.decide(5.0, MIXED, RECORDS, proven=())
    assert (d.target, d.reason) == (SPLIT, "seconded")
    assert all(s.decide(t, SPLIT, RECORDS, proven=()).target is None for t in (10.0, 15.0))
    # On goodput there: 30% more seconds it, 25% does not (no ITL score).
    s = _roomy_scaler({MIXED.label: 1.0, SPLIT.label: 1.2}, {MIXED.label: 1.0, SPLIT.label: 1.3},
                      confirmations=1)
    assert s.decide(0.0, MIXED, RECORDS, proven=()).reason == "seconded"
    s = _roomy_scaler({MIXED.label: 1.0, SPLIT.label: 1.2}, {MIXED.label: 1.0, SPLIT.label: 1.25},
                      confirmations=1)
    assert s.decide(0.0, MIXED, RECORDS, proven=()).reason == "unproven"


def test_no_second_witness_without_goodput_there_a_margin_or_past_the_guard():
    """The mixed workload's 85%-load window: the split 14% ahead at the window's load,
    quicker at twice it but serving half as much there (0.27 against 0.53 req/s): no
    move. As much there at 0.6x the ITL p99 (0.5x asked), or a tie at no ITL at all
    (one-token outputs): no move. With the current configuration predicted to serve
    half the window (``overloaded``), or measured failing (a rescue), the heavier load
    is not even simulated. Both proven, the goodput rule's margin is enough."""
    s = _roomy_scaler({MIXED.label: 1.0, SPLIT.label: 1.14}, {MIXED.label: 0.53, SPLIT.label: 0.27},
                      heavy_itl={MIXED.label: 194.0, SPLIT.label: 44.0}, confirmations=1)
    d = s.decide(0.0, MIXED, RECORDS, proven=())
    assert (d.reason, d.headroom_itl_p99_ms) == ("unproven", {})
    s = _roomy_scaler({MIXED.label: 1.0, SPLIT.label: 1.14}, {MIXED.label: 1.0, SPLIT.label: 1.0},
                      heavy_itl={MIXED.label: 100.0, SPLIT.label: 60.0}, confirmations=1)
    assert s.decide(0.0, MIXED, RECORDS, proven=()).reason == "unproven"
    tied = {MIXED.label: 1.0, SPLIT.label: 1.0}  # one-token outputs: no ITL at all
    s = _roomy_scaler({MIXED.label: 1.0, SPLIT.label: 1.14}, tied,
                      heavy_itl={MIXED.label: 0.0, SPLIT.label: 0.0}, confirmations=1)
    assert s.decide(0.0, MIXED, RECORDS, proven=()).reason == "unproven"
    asked = []
    s = _roomy_scaler({MIXED.label: 0.5, SPLIT.label: 0.6}, {MIXED.label: 0.5, SPLIT.label: 1.0},
                      confirmations=1)
    s.headroom = lambda c, r: asked.append(c) or 1.0  # not even simulated
    d = s.decide(0.0, MIXED, RECORDS, proven=())
    assert (d.reason, d.headroom_goodput, asked) == ("unproven", {}, [])
    d = s.decide(0.0, MIXED, RECORDS, proven=None)
    assert (d.reason, d.headroom_goodput) == ("switch", {})
    # A measured failure is a rescue, on min_gain already: no witness asked either.
    assert s.decide(0.0, MIXED, RECORDS, proven=(), served=0.1).reason == "rescue"
    assert asked == []


def test_a_seconded_switch_pays_for_its_role_changes_at_the_smaller_margin():
    """Seconded, the switch's role changes are weighed against ``min_gain``: 20% more
    for the 20 s horizon, one worker serving half as much while both change roles, 1 s
    each, is +13%, a switch; 2 s each, +6%: ``switch_cost``."""
    goodput = {MIXED.label: 1.0, SPLIT.label: 1.2, "1 mixed x1t": 0.5}
    for secs, reason in ((1.0, "seconded"), (2.0, "switch_cost")):
        s = _roomy_scaler(goodput, {MIXED.label: 1.0, SPLIT.label: 1.5}, confirmations=1)
        d = s.decide(0.0, MIXED, RECORDS, {"mixed": secs}, proven=())
        assert (d.reason, d.switch_s) == (reason, 2 * secs)


def test_headroom_never_picks_a_configuration_the_goodput_rule_would_leave():
    """Three candidates (the review's case): the current one, X predicted 9% more, R 4%
    less but twice the room. Moving to R, X would then beat it by 14% and the goodput
    rule would move again: two paid switches. R is left out; X has less room than the
    current one, so nothing moves on room."""
    three = reachable(3, 1, 32)
    current, x, r = three
    goodput = {current.label: 1.0, x.label: 1.09, r.label: 0.96}
    heavy = {current.label: 1.0, x.label: 0.9, r.label: 2.0}
    cfg = AutoscaleConfig(min_dwell_s=0, confirmations=1, window_s=20)
    s = Autoscaler(three, lambda c, _: goodput[c.label], cfg,
                   headroom=lambda c, _: heavy[c.label])
    d = s.decide(0.0, current, RECORDS, proven=None)
    assert d.target is None and d.headroom_goodput == {current.roles_label: 1.0,
                                                       x.roles_label: 0.9}


def test_steady_load_with_headroom_never_flaps():
    """Goodputs that wobble around a tie, room around a 1.5x gap and ITLs within rule
    2b's margin, for 100 decisions: one move to the roomier split, none back."""
    wobble = iter([1.0, 1.04, 0.98, 0.97, 1.02, 1.03] * 40)
    room = iter([1.4, 1.6, 1.5, 1.45, 1.55] * 40)
    cfg = AutoscaleConfig(min_dwell_s=0, confirmations=2, window_s=20)
    s = Autoscaler([MIXED, SPLIT], lambda c, r: next(wobble) if c == SPLIT else 1.0, cfg,
                   itl=lambda c, r: 30.0 if c == SPLIT else 25.0,
                   headroom=lambda c, r: next(room) if c == SPLIT else 1.0)
    assert _moves(s, MIXED, 100) == [SPLIT]


def test_a_heavier_load_starts_sessions_sooner_and_keeps_each_turns_pause():
    import random

    from planner.scores import simulated
    from planner.window import window_requests

    window = _chat_window(0.9)
    at1, starts1 = window_requests(window, random.Random(0))
    at2, starts2 = window_requests(window, random.Random(0), load=2.0)
    assert starts2 == pytest.approx([x / 2 for x in starts1]) and len(starts1) == 8
    assert [r.think_s for r in at2] == [r.think_s for r in at1]
    assert [r.prompt for r in at2] == [r.prompt for r in at1]
    # per second of the window at its load: twice the load, twice the goodput, all served
    f1 = simulated(synthetic_profile("cpu"), 1, 3000, 150, window_s=96.0)(MIXED, window)
    f2 = simulated(synthetic_profile("cpu"), 1, 3000, 150, window_s=96.0, load=2.0)(
        MIXED, window)
    assert f2["goodput"] == pytest.approx(2 * f1["goodput"]) and f1["goodput_fraction"] == 1
    with pytest.raises(ValueError, match="load"):
        simulated(synthetic_profile("cpu"), 1, load=0)


def test_itl_noise_inside_the_margin_or_swapping_each_window_never_moves():
    """Rule 2b against itself: predicted ITLs that trade places by less than the margin,
    or swap by 3x from one window to the next (a long prompt landing in one window's
    decodes), never confirm a move."""
    near = iter([(450.0, 400.0), (400.0, 450.0)] * 50)
    swap = iter([(600.0, 200.0), (200.0, 600.0)] * 50)
    for pairs in (near, swap):
        cfg = AutoscaleConfig(min_dwell_s=0, confirmations=2, window_s=20)
        now: dict = {}

        def itl(c, r, now=now):
            return now["pair"][0 if c == MIXED else 1]

        s = Autoscaler([MIXED, SPLIT], lambda c, r: 1.0, cfg, itl=itl)
        current = MIXED
        for t in range(100):
            now["pair"] = next(pairs)
            assert s.decide(float(t), current, RECORDS).target is None


def test_itl_is_predicted_on_the_span_it_is_handed():
    longer = RECORDS + [TrafficRecord(20.0 + i, 1536, 0, 16) for i in range(5)]
    seen = []

    def itl(c, r):
        seen.append(len(r))
        return 500.0 if c == MIXED else 100.0

    s = Autoscaler([MIXED, SPLIT], lambda c, r: 1.0, AutoscaleConfig(confirmations=1,
                                                                     min_dwell_s=0), itl=itl)
    assert s.decide(0.0, MIXED, RECORDS, itl_records=longer).target == SPLIT
    assert seen == [len(longer)] * 2


def test_an_itl_tolerance_without_a_band_under_min_gain_is_refused_with_an_itl_score():
    loose = AutoscaleConfig(min_gain=0.05)  # 5% / 95% = 5.3%: not under 5%
    Autoscaler([MIXED, SPLIT], lambda c, r: 1.0, loose)  # goodput alone: fine
    with pytest.raises(ValueError, match="no band"):
        Autoscaler([MIXED, SPLIT], lambda c, r: 1.0, loose, itl=lambda c, r: 1.0)
    assert AutoscaleConfig(min_gain=0.06).itl_band
    assert AutoscaleConfig(min_gain=0.0, itl_tolerance=0.0).itl_band


def test_per_window_simulates_each_configuration_once_a_window():
    from planner.scores import goodput_of, itl_of, per_window

    runs = []

    def figures(c, r):
        runs.append((c.label, len(r)))
        return {"goodput": 1.0, "itl_p99_ms": 50.0}

    f = per_window(figures)
    other = list(RECORDS[:5])
    for _ in range(3):
        goodput_of(f)(MIXED, RECORDS), itl_of(f)(MIXED, RECORDS), itl_of(f)(SPLIT, other)
    assert runs == [(MIXED.label, 20), (SPLIT.label, 5)]
    third = list(RECORDS[:7])
    f(MIXED, third)  # a third list: the oldest is forgotten
    f(MIXED, RECORDS)
    assert runs[-2:] == [(MIXED.label, 7), (MIXED.label, 20)]
