"""planner.sim: the discrete-event simulator runs the real scheduler and routing policies
on a synthetic cost model. Pure and fast; every run ends with every KV block free (the
simulator itself raises otherwise, and the tests check the block managers again)."""

from __future__ import annotations

import dataclasses

import pytest

from loadtest.metrics import SLO, compute_metrics
from loadtest.workloads import (
    Request,
    arrival_times,
    mixed_workload,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
)
from planner.config import PoolConfig
from planner.predict import adaptive_available, predicted, run, simulate
from planner.sim import SimResult, Simulation, SimulationError
from planner.synthetic import synthetic_profile

PROFILE = synthetic_profile("cpu")
MIXED = PoolConfig("mixed", mixed_workers=1, mixed_threads=2)
TWO_MIXED = PoolConfig("mixed", mixed_workers=2, mixed_threads=1)
DISAGG = PoolConfig("disaggregated", prefill_workers=1, decode_workers=1, prefill_threads=1,
                    decode_threads=1)


def assert_no_leak(result: SimResult) -> None:
    for w in result.workers:
        s, bm = w.sched, w.sched.block_manager
        assert s.num_unfinished == 0 and not s.held and not s.reserved, w.name
        assert bm.num_free_blocks == bm.num_blocks, w.name
        assert all(b.ref_count == 0 for b in bm.blocks), w.name


def lone(prompt_len: int = 100, output_len: int = 6) -> list[Request]:
    return [Request(list(range(1000, 1000 + prompt_len)), output_len)]


def test_a_lone_mixed_request_takes_one_prefill_step_then_one_decode_step_per_token() -> None:
    r = run(PROFILE, MIXED, lone(), [0.5])
    rec, step = r.records[0], PROFILE.step(2)
    assert rec.ttft == pytest.approx(step.seconds([(100, 0)]))
    assert rec.output_tokens == 6 and len(rec.token_times) == 6
    assert rec.itls == pytest.approx([step.seconds([(1, 100 + i)]) for i in range(5)])
    assert_no_leak(r)


def test_a_lone_disaggregated_request_relays_the_first_token_before_the_transfer() -> None:
    r = run(PROFILE, DISAGG, lone(), [0.0])
    rec, step = r.records[0], PROFILE.step(1)
    # TTFT is the prefill worker's step: the first token never waits for the KV.
    assert rec.ttft == pytest.approx(step.seconds([(100, 0)]))
    link = PROFILE.transfer
    assert 100 * PROFILE.kv_bytes_per_token / link.bytes_per_s < rec.ttft  # hidden
    gaps = rec.itls
    # The first gap: the transfer's fixed latency (its bytes moved during the prefill's
    # step, layer by layer), then the decode worker's first step (commit, then the
    # first token's KV and the second token); then one decode step per token.
    assert gaps[0] == pytest.approx(link.latency_s + step.seconds([(1, 100)]))
    assert gaps[1:] == pytest.approx([step.seconds([(1, 101 + i)]) for i in range(4)])
    assert r.remote_prefills == 1 and r.local_prefills == 0
    assert_no_leak(r)


def test_a_short_uncached_prompt_is_prefilled_on_the_decode_worker() -> None:
    cfg = PoolConfig("disaggregated", prefill_workers=1, decode_workers=1, prefill_threads=1,
                     decode_threads=1, local_prefill_threshold=128)
    r = run(PROFILE, cfg, lone(100), [0.0])
    assert r.local_prefills == 1 and r.remote_prefills == 0
    assert r.records[0].ttft == pytest.approx(PROFILE.step(1).seconds([(100, 0)]))
    assert r.workers[0].steps == 0  # the prefill worker never ran
    assert_no_leak(r)


def test_a_one_token_request_ends_at_the_prefill_worker_and_its_reservation_is_freed() -> None:
    r = run(PROFILE, DISAGG, lone(64, 1), [0.0])
    assert r.records[0].output_tokens == 1 and len(r.records[0].token_times) == 1
    assert r.workers[1].steps == 0
    assert_no_leak(r)


def test_transfers_into_one_decode_worker_go_one_at_a_time() -> None:
    slow = synthetic_profile("cpu", bytes_per_s=5e6, latency_s=0.0)  # ~0.37 s per 100 tokens
    reqs = [Request(list(range(i * 1000, i * 1000 + 100)), 3) for i in range(2)]
    cfg = PoolConfig("disaggregated", prefill_workers=2, decode_workers=1, prefill_threads=1,
                     decode_threads=1)
    r = run(slow, cfg, reqs, [0.0, 0.0])
    transfer = slow.transfer.seconds(100 * slow.kv_bytes_per_token)
    a, b = r.records
    assert a.ttft == pytest.approx(b.ttft)  # two prefill workers, side by side
    second = sorted([a.token_times[1], b.token_times[1]])
    assert second[1] - second[0] >= transfer * 0.99  # the second waited for the link
    # the first started moving when the prefill's step began: landed at transfer, not
    # at the step's end + transfer
    assert second[0] == pytest.approx(transfer + slow.step(1).seconds([(1, 100)]))
    assert_no_leak(r)


@pytest.mark.parametrize("offer", ["step", "after"])
def test_kv_offered_after_the_step_moves_once_it_ended(offer) -> None:
    """Under ``--kv-offer step`` or ``after`` the bytes start when the prefill's step
    ends: the first -> second token gap pays the whole transfer (under ``layers`` only
    the part the step did not cover, and the latency)."""
    slow = synthetic_profile("cpu", bytes_per_s=5e6, latency_s=0.002)
    transfer = slow.transfer.seconds(100 * slow.kv_bytes_per_token)
    prefill, decode = slow.step(1).seconds([(100, 0)]), slow.step(1).seconds([(1, 100)])
    late = run(slow, PoolConfig("disaggregated", prefill_workers=1, decode_workers=1,
                                prefill_threads=1, decode_threads=1, kv_offer=offer),
               lone(), [0.0])
    early = run(slow, DISAGG, lone(), [0.0])
    assert late.records[0].ttft == pytest.approx(early.records[0].ttft)
    assert late.records[0].itls[0] == pytest.approx(transfer + decode)
    moved = slow.transfer.landed_s(100 * slow.kv_bytes_per_token, prefill, "layers")
    assert early.records[0].itls[0] == pytest.approx(moved - prefill + decode)
    assert early.records[0].itls[0] < late.records[0].itls[0]
    assert_no_leak(late)


def test_a_reservation_waits_for_blocks_a_step_frees() -> None:
    tiny = synthetic_profile("cpu", num_blocks=20, max_model_len=300)  # 320 tokens of KV
    reqs = [Request(list(range(i * 1000, i * 1000 + 200)), 8) for i in range(3)]
    r = run(tiny, DISAGG, reqs, [0.0, 0.0, 0.0])
    assert all(rec.ok and rec.output_tokens == 8 for rec in r.records)
    finished = sorted(rec.token_times[-1] for rec in r.records)
    starts = sorted(rec.token_times[1] for rec in r.records)
    assert starts[1] >= finished[0]  # only one 200-token prompt fits at a time
    assert_no_leak(r)


def test_a_saturating_load_makes_ttft_grow() -> None:
    reqs = random_workload(60, 256, 32, seed=3)
    light = predicted(run(PROFILE, MIXED, reqs, arrival_times(60, 0.2, seed=3)), None)
    heavy = predicted(run(PROFILE, MIXED, reqs, arrival_times(60, 20.0, seed=3)), None)
    assert heavy["ttft_p90_ms"] > 5 * light["ttft_p90_ms"]


def test_cache_aware_routing_beats_round_robin_on_shared_prefixes() -> None:
    small = synthetic_profile("cpu", num_blocks=160, max_model_len=1024)
    reqs = shared_prefix_workload(120, 8, 512, 32, 8, seed=1)
    arrivals = arrival_times(120, 2.0, seed=1)
    out = {}
    for policy in ("cache_aware", "round_robin"):
        result = run(small, PoolConfig("mixed", mixed_workers=2, mixed_threads=1,
                                       policy=policy), reqs, arrivals)
        assert_no_leak(result)
        out[policy] = predicted(result, None)
    ca, rr = out["cache_aware"], out["round_robin"]
    assert ca["cached_token_ratio"] > rr["cached_token_ratio"]
    assert ca["ttft_mean_ms"] < 0.7 * rr["ttft_mean_ms"]


def test_disaggregation_keeps_itl_p99_low_where_long_prefills_stall_mixed_decodes() -> None:
    reqs = mixed_workload(120, 128, 64, 0.25, 1536, 16, seed=0)
    arrivals = arrival_times(120, 1.0, seed=0)
    mixed = simulate(PROFILE, TWO_MIXED, reqs, arrivals, SLO(5000, 100))
    disagg = simulate(PROFILE, DISAGG, reqs, arrivals, SLO(5000, 100))
    assert disagg["itl_p99_ms"] < 0.5 * mixed["itl_p99_ms"]


@pytest.mark.parametrize("table", [(), (0.7, 1.0, 1.3)], ids=["engine", "decode-table"])
def test_fast_forward_is_the_same_run_as_stepping_one_step_at_a_time(table) -> None:
    profile = dataclasses.replace(PROFILE, serving_decode={1: table})
    reqs = mixed_workload(80, 64, 48, 0.2, 700, 24, range_ratio=0.5, seed=5)
    arrivals = arrival_times(80, 3.0, seed=5)
    for cfg in (TWO_MIXED, DISAGG):
        fast = run(profile, cfg, reqs, arrivals)
        slow = run(profile, cfg, reqs, arrivals, fast_forward=False)
        assert sum(w.steps for w in fast.workers) == sum(w.steps for w in slow.workers)
        for a, b in zip(fast.records, slow.records, strict=True):
            assert a.token_times == pytest.approx(b.token_times, abs=1e-9)
            assert a.cached_tokens == b.cached_tokens


def test_preemption_under_a_small_pool_still_completes_every_request() -> None:
    tiny = synthetic_profile("cpu", num_blocks=24, max_model_len=256)
    reqs = random_workload(12, 60, 120, seed=2)
    r = run(tiny, MIXED, reqs, [0.0] * 12)
    assert r.preemptions > 0
    assert all(rec.ok and rec.output_tokens == 120 for rec in r.records)
    assert_no_leak(r)


def test_multi_turn_sends_a_turn_after_the_reply_and_reuses_the_history() -> None:
    reqs = multi_turn_workload(2, 3, 64, 16, seed=4)
    r = run(PROFILE, TWO_MIXED, reqs, [0.0, 0.01], think_time_s=0.05)
    recs = r.records  # in the order they were sent
    assert len(recs) == 6 and all(x.ok for x in recs)
    assert [x.sent for x in recs[:2]] == [0.0, 0.01]
    ends = [x.token_times[-1] for x in recs]
    for later in recs[2:]:  # each later turn left 50 ms after an earlier reply ended
        assert any(later.sent == pytest.approx(e + 0.05) for e in ends if e < later.sent)
        assert later.cached_tokens >= 64  # its history's first blocks were cached
    assert_no_leak(r)


def test_a_turns_own_think_time_replaces_the_runs() -> None:
    """A replay of logged turns (planner.window.window_requests) gives each turn the
    pause it had: turn 2 leaves 0.3 s after turn 1's reply, turn 3 at once after turn
    2's, whatever the run's think time."""
    a, b, c = multi_turn_workload(1, 3, 64, 16, seed=5)
    reqs = [a, dataclasses.replace(b, think_s=0.3), dataclasses.replace(c, think_s=0.0)]
    r = run(PROFILE, TWO_MIXED, reqs, [0.0], think_time_s=5.0)
    first, second, third = r.records
    assert second.sent == pytest.approx(first.token_times[-1] + 0.3)
    assert third.sent == pytest.approx(second.token_times[-1])
    assert_no_leak(r)


def test_a_prompt_longer_than_the_context_fails_alone() -> None:
    reqs = [Request(list(range(PROFILE.max_model_len + 5)), 4), *lone()]
    r = run(PROFILE, MIXED, reqs, [0.0, 0.0])
    assert r.records[0].error and not r.records[0].ok and r.records[1].ok
    assert compute_metrics(r.records, r.duration_s)["failed"] == 1


def test_a_placement_hook_moves_prompts_to_the_decode_worker() -> None:
    seen: list[dict] = []

    def always_local(**inputs: int) -> bool:
        seen.append(inputs)
        return True

    reqs = random_workload(10, 200, 8, seed=6)
    sim = Simulation(PROFILE, DISAGG, placement=always_local)
    r = sim.run(reqs, arrival_times(10, 5.0, seed=6))
    assert r.local_prefills == 10 and r.workers[0].steps == 0
    assert set(seen[0]) == {"uncached_tokens", "cached_tokens", "decode_running",
                            "decode_context_tokens", "prefill_queued_tokens"}
    assert_no_leak(r)


@pytest.mark.skipif(not adaptive_available(), reason="router.adaptive not installed")
def test_the_adaptive_candidate_runs_the_routers_rule() -> None:
    cfg = PoolConfig("adaptive", prefill_workers=1, decode_workers=1, prefill_threads=1,
                     decode_threads=1, local_prefill_threshold=32, itl_budget_ms=1000.0)
    reqs = random_workload(30, 300, 16, seed=7)
    r = run(PROFILE, cfg, reqs, arrival_times(30, 2.0, seed=7))
    assert r.local_prefills + r.remote_prefills == 30
    assert_no_leak(r)


@pytest.mark.skipif(not adaptive_available(), reason="router.adaptive not installed")
def test_the_adaptive_candidates_ttft_target_sends_prompts_remote() -> None:
    """The router's TTFT target is the simulated rule's too: a target every remote
    estimate meets leaves local only the prompts an idle decode worker takes."""
    cfg = PoolConfig("adaptive", prefill_workers=1, decode_workers=1, prefill_threads=1,
                     decode_threads=1, local_prefill_threshold=0, itl_budget_ms=1000.0)
    reqs = random_workload(40, 300, 16, seed=8)
    arrivals = arrival_times(40, 6.0, seed=8)
    plain = run(PROFILE, cfg, reqs, arrivals)
    targeted = run(PROFILE, dataclasses.replace(cfg, ttft_slo_ms=600_000.0), reqs, arrivals)
    assert plain.local_prefills > targeted.local_prefills
    assert targeted.local_prefills + targeted.remote_prefills == 40
    assert_no_leak(plain)
    assert_no_leak(targeted)
    with pytest.raises(ValueError, match="ttft_slo_ms"):
        dataclasses.replace(MIXED, ttft_slo_ms=500.0)


def test_a_leak_is_reported_as_a_simulator_bug() -> None:
    sim = Simulation(PROFILE, MIXED)
    w = sim.workers[0]
    w.sched.add("stray", list(range(40)), sim._params_of(Request([1], 2)))
    with pytest.raises(SimulationError, match="1 unfinished"):
        sim.run([], [])


def test_the_same_inputs_give_the_same_prediction() -> None:
    reqs = shared_prefix_workload(60, 4, 128, 32, 16, seed=9)
    arrivals = arrival_times(60, 4.0, seed=9)
    a = simulate(PROFILE, DISAGG, reqs, arrivals, SLO(2000, 100))
    b = simulate(PROFILE, DISAGG, reqs, arrivals, SLO(2000, 100))
    assert a == b


def test_a_profile_with_a_spread_of_served_steps_stretches_steps_repeatably() -> None:
    from dataclasses import replace

    spread = {2: ((0.005, 0.8), (0.5, 1.0), (0.995, 1.5))}
    noisy = replace(PROFILE, serving_jitter=spread)
    requests = random_workload(6, 64, 40, 0.0, seed=1)
    arrivals = arrival_times(len(requests), 4.0, 1.0, seed=1)
    a, b = run(noisy, MIXED, requests, arrivals), run(noisy, MIXED, requests, arrivals)
    assert [r.token_times for r in a.records] == [r.token_times for r in b.records]
    assert_no_leak(a)
    plain = run(PROFILE, MIXED, requests, arrivals)
    gaps = [g for r in a.records for g in r.itls]
    exact = [g for r in plain.records for g in r.itls]
    assert min(gaps) < 0.95 * min(exact)  # some steps drew a factor below 1
    lone_gaps = run(noisy, MIXED, lone(100, 30), [0.0]).records[0].itls
    step = PROFILE.step(2)
    ratios = [g / step.seconds([(1, 100 + i)]) for i, g in enumerate(lone_gaps)]
    assert 0.8 - 1e-9 <= min(ratios) and max(ratios) <= 1.5 + 1e-9
    assert len({round(r, 6) for r in ratios}) > 10  # drawn, not one factor
