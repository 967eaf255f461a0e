"""planner.search and ``pdserve plan``: the candidates for some cores or GPUs, the
symmetric slice a large configuration is simulated as, the recommendation rule, the
JSON shape, and a 1,000-GPU hour planned in slices. Synthetic profiles; no model."""

from __future__ import annotations

import json
import math
import time

import pytest

from cluster.cli import main
from common.cost_model import save_profile
from loadtest.metrics import SLO
from loadtest.workloads import Request, arrival_times, multi_turn_workload, random_workload
from planner.config import PoolConfig, Resources
from planner.predict import adaptive_available
from planner.search import (
    CandidateResult,
    Slice,
    candidates,
    plan,
    plan_workload,
    recommend,
    slice_of,
)
from planner.synthetic import SyntheticTrace, rate_for, synthetic_profile
from planner.workload import ExplicitWorkload, SyntheticWorkload, from_details

CPU = synthetic_profile("cpu")
GPU = synthetic_profile("gpu")


def test_two_cores_give_every_mixed_and_split_candidate() -> None:
    cands = candidates(CPU, Resources(2), (0, 64, 256, 1024))
    mixed = [c for c in cands if c.kind == "mixed"]
    assert {(c.mixed_workers, c.mixed_threads) for c in mixed} == {(2, 1), (1, 2)}
    disagg = [c for c in cands if c.kind == "disaggregated"]
    assert {c.local_prefill_threshold for c in disagg} == {0, 64, 256, 1024}
    assert all((c.prefill_workers, c.decode_workers, c.prefill_threads, c.decode_threads)
               == (1, 1, 1, 1) for c in disagg)
    assert len([c for c in cands if c.kind == "adaptive"]) == adaptive_available()
    assert all(c.units() <= 2 for c in cands)


def test_more_cores_give_splits_of_mixed_thread_counts() -> None:
    cands = candidates(CPU, Resources(4), (0,), adaptive=False)
    splits = {(c.prefill_workers, c.prefill_threads, c.decode_workers, c.decode_threads)
              for c in cands if c.disaggregated}
    assert {(1, 1, 3, 1), (2, 1, 2, 1), (3, 1, 1, 1), (1, 2, 2, 1), (2, 1, 1, 2),
            (1, 2, 1, 2)} == splits
    assert all(c.units() == 4 for c in cands)


def test_a_thousand_gpus_give_one_split_per_small_ratio() -> None:
    cands = candidates(GPU, Resources(1000, "gpus"), (0,), adaptive=False)
    splits = {(c.prefill_workers, c.decode_workers) for c in cands if c.disaggregated}
    assert splits == {(500, 500), (333, 666), (666, 333), (250, 750), (750, 250)}
    assert [c.mixed_workers for c in cands if c.kind == "mixed"] == [1000]


def test_a_slice_keeps_the_ratio_and_the_share_of_workers() -> None:
    s = slice_of(PoolConfig("disaggregated", prefill_workers=250, decode_workers=750,
                            prefill_threads=1, decode_threads=1))
    assert (s.config.prefill_workers, s.config.decode_workers) == (1, 3)
    assert s.fraction == pytest.approx(4 / 1000) and s.label == "1/250"
    odd = slice_of(PoolConfig("disaggregated", prefill_workers=5, decode_workers=7,
                              prefill_threads=1, decode_threads=1))
    assert odd.config.workers <= 4 and odd.fraction == pytest.approx(odd.config.workers / 12)
    assert (odd.config.prefill_workers, odd.config.decode_workers) == (1, 1)  # 5/12 ~ 1/2
    m = slice_of(PoolConfig("mixed", mixed_workers=1000, mixed_threads=1))
    assert m.config.mixed_workers == 4 and m.fraction == 0.004
    small = PoolConfig("mixed", mixed_workers=2, mixed_threads=1)
    assert slice_of(small) == Slice(small, 1.0)


def test_a_slice_of_an_explicit_workload_is_an_even_share_of_its_sessions() -> None:
    reqs = multi_turn_workload(10, 2, 16, 4)
    w = ExplicitWorkload(reqs, [float(i) for i in range(10)])
    s = w.sample(0.3)
    assert len(s.arrivals) == 3 and len(s.requests) == 6  # whole conversations
    assert s.arrivals == [3.0, 6.0, 9.0]
    assert w.sample(1.0).requests is reqs


def _result(label: int, goodput: float, cost: float, ttft: float) -> CandidateResult:
    cfg = PoolConfig("mixed", mixed_workers=label, mixed_threads=1)
    return CandidateResult(cfg, {"goodput": goodput, "cost_per_mtok": cost,
                                 "ttft_p90_ms": ttft}, Slice(cfg, 1.0))


def test_the_recommendation_is_the_best_goodput_ties_to_cost_then_ttft() -> None:
    assert recommend([_result(1, 10, 5, 100), _result(2, 8, 1, 10)]).config.mixed_workers == 1
    # Within 1% of the best goodput: cheaper wins, then lower TTFT p90.
    tied = [_result(1, 10, 5, 100), _result(2, 9.95, 4, 200), _result(3, 9.95, 4, 150)]
    assert recommend(tied).config.mixed_workers == 3
    assert recommend([_result(1, 10, 5, 100), _result(2, 9.8, 1, 10)]).config.mixed_workers == 1
    # Costs within 1% of the cheapest are equal: TTFT p90 decides.
    close = [_result(1, 10, 4.00, 300), _result(2, 10, 4.03, 100), _result(3, 10, 4.2, 10)]
    assert recommend(close).config.mixed_workers == 2


def test_the_two_core_search_ranks_every_candidate_and_prices_it() -> None:
    reqs = random_workload(60, 128, 32, seed=1)
    t0 = time.perf_counter()
    result = plan(CPU, reqs, arrival_times(60, 1.0, seed=1), Resources(2, "cores", 0.05),
                  SLO(3000, 150))
    print(f"2-core search: {len(result.candidates)} candidates in {result.search_s:.2f} s")
    assert time.perf_counter() - t0 < 60
    assert len(result.candidates) == len(candidates(CPU, Resources(2)))
    assert result.recommended in [c.config for c in result.candidates]
    for c in result.candidates:
        p = c.predicted
        assert c.slice.fraction == 1 and p["completed"] == 60
        hours_per_mtok = 1e6 / (p["throughput"] * 3600)
        assert p["cost_per_mtok"] == pytest.approx(c.config.units() * 0.05 * hours_per_mtok)


def test_pdserve_plan_json_is_one_object_with_candidates_and_the_recommendation(
        tmp_path, capsys) -> None:
    path = tmp_path / "profile.json"
    save_profile(CPU, path)
    png = tmp_path / "plan.png"
    rc = main(["plan", "--profile", str(path), "--cores", "2", "--workload", "random",
               "--num-prompts", "24", "--request-rate", "2", "--input-len", "64",
               "--output-len", "16", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100",
               "--thresholds", "0,256", "--json", "--plot", str(png)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)  # exactly one object: loads would fail else
    assert {"candidates", "recommended", "search_s", "workload", "slice"} <= set(out)
    for c in out["candidates"]:
        assert {"kind", "mixed_workers", "prefill_workers", "decode_workers",
                "local_prefill_threshold"} <= set(c["config"])
        assert {"ttft_p90_ms", "itl_p90_ms", "tpot_p90_ms", "ttft_p50_ms", "itl_p99_ms",
                "goodput", "throughput", "cost_per_mtok"} <= set(c["predicted"])
    assert out["recommended"] in [c["config"] for c in out["candidates"]]
    assert out["slice"] is None and png.stat().st_size > 0


def test_pdserve_plan_kv_offer_reaches_the_split_candidates(tmp_path, capsys) -> None:
    path = tmp_path / "profile.json"
    save_profile(CPU, path)
    args = ["plan", "--profile", str(path), "--cores", "2", "--num-requests", "12",
            "--request-rate", "4", "--input-len", "256", "--output-len", "8",
            "--thresholds", "0", "--json"]
    assert main([*args, "--kv-offer", "after"]) == 0
    out = json.loads(capsys.readouterr().out)
    splits = [c["config"] for c in out["candidates"] if c["config"]["kind"] != "mixed"]
    assert splits and all(c["kv_offer"] == "after" for c in splits)
    assert all("kv_offer" not in c["config"] for c in out["candidates"]
               if c["config"]["kind"] == "mixed")
    assert all(c["label"].endswith("KV offered after") for c in out["candidates"]
               if c["config"]["kind"] != "mixed")
    assert main([*args, "--kv-offer", "after", "--validate"]) == 2
    assert "--kv-offer layers" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_offer"):
        PoolConfig("disaggregated", prefill_workers=1, decode_workers=1, prefill_threads=1,
                   decode_threads=1, kv_offer="later")


def test_pdserve_plan_prefill_caps_try_each_candidate_once_per_cap(tmp_path, capsys) -> None:
    """``--prefill-caps``: each candidate again with every worker's stall-free cap, the
    cap in its config and label; ``auto``: the live planner's caps for the profile."""
    from planner.caps import prefill_caps

    path = tmp_path / "profile.json"
    save_profile(CPU, path)
    args = ["plan", "--profile", str(path), "--cores", "2", "--num-requests", "16",
            "--request-rate", "3", "--workload", "mixed", "--input-len", "128",
            "--output-len", "32", "--long-fraction", "0.25", "--long-input-len", "1024",
            "--long-output-len", "8", "--thresholds", "0", "--no-adaptive", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)["candidates"]
    assert main([*args, "--prefill-caps", "0,64"]) == 0
    capped = json.loads(capsys.readouterr().out)["candidates"]
    assert len(capped) == 2 * len(plain)
    caps = [c["config"].get("prefill_tokens_while_decoding", 0) for c in capped]
    assert sorted(set(caps)) == [0, 64] and caps.count(64) == len(plain)
    assert all(c["label"].endswith("prompts <= 64 tokens a step while decoding")
               for c, cap in zip(capped, caps, strict=True) if cap)
    uncapped = [c["predicted"] for c, cap in zip(capped, caps, strict=True) if not cap]
    assert uncapped == [c["predicted"] for c in plain]  # the same runs as without caps
    assert main([*args, "--prefill-caps", "auto"]) == 0
    auto = json.loads(capsys.readouterr().out)["candidates"]
    assert {c["config"].get("prefill_tokens_while_decoding", 0) for c in auto} == {
        cap for t in CPU.steps for cap in prefill_caps(CPU, t)}
    assert main([*args, "--prefill-caps", "64,x"]) == 2
    assert "--prefill-caps" in capsys.readouterr().err


def test_pdserve_plan_prints_a_table_with_the_recommendation_marked(tmp_path, capsys) -> None:
    path = tmp_path / "profile.json"
    save_profile(CPU, path)
    assert main(["plan", "--profile", str(path), "--cores", "2", "--num-requests", "12",
                 "--request-rate", "4", "--input-len", "32", "--output-len", "8",
                 "--thresholds", "0", "--no-adaptive"]) == 0
    lines = capsys.readouterr().out.splitlines()
    marked = [line for line in lines if line.startswith("* ")]
    assert len(marked) == 1 and "recommended (*)" in "\n".join(lines)


def test_pdserve_plan_refuses_a_missing_profile(tmp_path, capsys) -> None:
    assert main(["plan", "--profile", str(tmp_path / "nope.json"), "--cores", "2"]) == 2
    assert "cannot read the profile" in capsys.readouterr().err


def test_a_recorded_run_replays_its_send_times_and_says_what_it_lacks(tmp_path) -> None:
    rec = tmp_path / "run.json"
    rec.write_text(json.dumps({"completed": 3, "failed": 1, "total_input_tokens": 300,
                               "details": {"sent": [0.5, 0.0, 1.0],
                                           "output_tokens": [4, 8, 2]}}))
    w, notes = from_details(rec)
    assert w.arrivals == [0.0, 0.5, 1.0]
    assert [len(r.prompt) for r in w.requests] == [100] * 3
    assert [r.output_len for r in w.requests] == [8, 4, 2]
    assert any("prompt_tokens" in n for n in notes) and any("failed" in n for n in notes)
    rec.write_text(json.dumps({"details": {"sent": [0.0]}}))
    with pytest.raises(ValueError, match="output_tokens"):
        from_details(rec)


def test_a_thousand_gpus_for_an_hour_are_planned_in_slices() -> None:
    base = SyntheticTrace(1.0, 3600.0)
    trace = SyntheticTrace(rate_for(GPU, 1000, base, 0.6), 3600.0)
    t0 = time.perf_counter()
    result = plan_workload(GPU, SyntheticWorkload(trace), Resources(1000, "gpus", 2.0),
                           SLO(2000, 50), thresholds=(0,), adaptive=False, max_requests=800)
    took = time.perf_counter() - t0
    print(f"1,000 GPUs, 1 h ({trace.rate:g} req/s): {len(result.candidates)} candidates "
          f"planned in {took:.1f} s")
    assert all(c.slice.fraction < 0.01 for c in result.candidates)
    assert any("slice" in n for n in result.notes) and any("window" in n or "first" in n
                                                           for n in result.notes)
    best = result.best.predicted
    assert best["goodput"] == pytest.approx(trace.rate, rel=0.05)  # the whole cluster's
    assert best["simulated_requests"] <= 800
    assert math.isfinite(best["cost_per_mtok"])


def test_the_same_seed_plans_the_same() -> None:
    gpu = synthetic_profile("gpu", num_blocks=2048)
    trace = SyntheticTrace(rate_for(gpu, 6, SyntheticTrace(1.0, 600.0), 0.5), 600.0, seed=4)
    runs = [plan_workload(gpu, SyntheticWorkload(trace), Resources(6, "gpus"), SLO(2000, 50),
                          thresholds=(0,), adaptive=False, max_requests=150)
            for _ in range(2)]
    assert any(c.slice.fraction < 1 for c in runs[0].candidates)
    a, b = (r.as_json() for r in runs)
    a.pop("search_s")
    b.pop("search_s")
    assert a == b


def test_a_request_list_and_its_arrivals_must_match() -> None:
    with pytest.raises(ValueError, match="arrival"):
        plan(CPU, [Request([1, 2, 3], 2)], [0.0, 1.0], Resources(2))
