"""``pdserve up --autoscale``'s loop on real processes: the routers' traffic log in Redis,
the planner's decisions carried out as role changes (2 mixed workers -> 1 prefill + 1
decode -> 2 mixed, then a stall-free cap on both) while greedy requests stream, none
lost, every block free after.

The decisions' hysteresis and the simulator's scores are tested without processes
(tests/unit/test_autoscale.py, test_planner_*.py); here the score is scripted, so the
test says when the planner should move and checks that the cluster follows."""

from __future__ import annotations

import dataclasses
import time
import urllib.request

import pytest
from cluster_helpers import Load, assert_cluster_idle, start
from conftest import hf_greedy

from cluster.autoscale import KEEP_FIT_WINDOWS, AutoscaleLoop
from common import served_fit
from common.cost_model import save_profile
from common.stream_log import StreamLog
from planner.autoscale import AutoscaleConfig
from planner.scores import simulated, simulated_goodput
from planner.synthetic import synthetic_profile

MAX_TOKENS = 6
PROMPTS = [[(11 * i + j) % 240 + 5 for j in range(10 + 4 * i)] for i in range(6)]
PROMPTS[5] = PROMPTS[3] + PROMPTS[5][:8]  # a conversation's next turn (router/lineage.py)


@pytest.fixture(scope="module")
def scaled(tiny_checkpoints, tmp_path_factory):
    logs = tmp_path_factory.mktemp("autoscale")
    profile = logs / "profile.json"
    save_profile(synthetic_profile("cpu"), profile)
    c = start(tiny_checkpoints["llama"], logs, mixed=2, threads_per_worker=1, block_size=4,
              profile=str(profile), autoscale=True,  # the workers publish their steps
              autoscale_prefill_cap=True, autoscale_itl=True)
    yield c
    c.stop()


def _roles(c) -> list[str]:  # noqa: ANN001
    return sorted(role for _, role in c.workers)


def test_the_planner_moves_roles_under_load_and_loses_nothing(scaled, tiny_checkpoints,
                                                              monkeypatch):
    c = scaled
    # No rescue: what share the workers serve within the profile's SLOs depends on the
    # machine's speed (a loaded CI runner served under 30% and the first tick rescued);
    # the scripted scores alone say when to move here.
    loop = AutoscaleLoop(c, AutoscaleConfig(interval_s=3600, window_s=300, min_requests=3,
                                            min_dwell_s=0, confirmations=2,
                                            max_served_rescue=0.0))
    prefer = {"split": 2.0, "mixed": 1.0}
    loop.recalibrate = lambda now: None  # type: ignore[method-assign] - scripted scores
    loop.autoscaler.score = lambda cfg, records: prefer["mixed" if cfg.kind == "mixed"
                                                        else "split"]
    loop.autoscaler.refine = loop.autoscaler.score  # scripted with or without a cap
    itl = {0: 100.0, 64: 200.0}  # the stall-free cap's scripted ITL p99, by cap
    loop.caps.caps = (0, 64)
    loop.caps.predict = lambda cfg, records: {
        "goodput": 1.0, "itl_p99_ms": itl[cfg.prefill_tokens_while_decoding]}
    load = Load(c.target, PROMPTS, MAX_TOKENS)
    try:
        deadline = time.monotonic() + 30
        while len(loop.traffic.recent(time.time() - 300)) < 3:  # flushed every second
            assert time.monotonic() < deadline, "no traffic reached the log"
            time.sleep(0.2)
        records = loop.traffic.recent(time.time() - 300)
        assert {r.prompt_tokens for r in records} <= {len(p) for p in PROMPTS}
        assert all(r.output_tokens == MAX_TOKENS for r in records)  # admitted or ended

        first = loop.tick(time.time())
        assert (first.action, first.reason) == ("stay", "confirming")
        assert first.scores == {"2 mixed x1t": 1.0, first.scores and next(
            k for k in first.scores if k != "2 mixed x1t"): 2.0}
        second = loop.tick(time.time())
        assert (second.action, second.reason) == ("switch", "switch")
        assert _roles(c) == ["decode", "prefill"]
        # Weighed with its two changes' seconds (a prior: none measured yet), then each
        # change timed by the role it left.
        assert (second.switch_s, second.net_gain) == (0.0, 1.0), second  # mixed: no drain
        assert set(loop.moves) == {"mixed"} and 0 < loop.moves["mixed"] < 1.0, loop.moves
        decode = c.worker_addresses[[r for _, r in c.workers].index("decode")]
        load.wait_routed("decode_worker", decode, len(load.results))

        prefer["mixed"] = 3.0
        third = loop.tick(time.time())
        assert third.reason == "confirming" and third.switch_s > 2 * 2.0  # the grace, twice
        assert loop.tick(time.time()).action == "switch"
        assert _roles(c) == ["mixed", "mixed"]
        assert set(loop.moves) == {"mixed", "prefill", "decode"}
        # Decided after the roles (none while they changed): no cap was best so far.
        assert [d and d.reason for d in loop.cap_decisions] == [
            "current_best", None, "current_best", None]
        # Now a cap of 64 halves ITL p99 at the same goodput: after two decisions in a
        # row every worker has it (SetRole to the role it has), and so do the candidates.
        itl[64] = 40.0
        before_cap = time.time()
        assert [loop.tick(time.time()).reason for _ in range(2)] == ["current_best"] * 2
        assert [(d.reason, d.target) for d in loop.cap_decisions[-2:]] == [
            ("confirming", None), ("switch", 64)]
        assert loop.autoscaler.candidates[0].prefill_tokens_while_decoding == 64
        # What the workers served before the cap is not the new cap's: the served floor
        # waits a window from the cap's change, as from a role change.
        assert loop._cap_set_at >= before_cap > loop._settled_at
        assert all(c.set_role(w, "mixed").prefill_tokens_while_decoding == 64
                   for w in c.worker_addresses)  # the workers' own answer
        assert 'planner_prefill_cap{component="planner"} 64.0' in loop.metrics.text(
            ).replace("pdserve:", "")
        mark = len(load.results)
        deadline = time.monotonic() + 20
        while len(load.results) < mark + 6:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # The workers published their steps, each in the role it had then (prompts under
        # the decode worker's local threshold: the prefill worker only finishes the
        # requests it ran as mixed), and the planner refits its step model from them.
        # (The load is over first: the fits below see the same steps.)
        load.finish()
        time.sleep(1.5)  # the last second's steps, flushed
        # Each request the routers served is in the traffic log twice, under one key:
        # admitted, then ended with the output it had, at the same arrival time.
        entries = StreamLog.recent(loop.traffic, time.time() - 300)
        admitted = {r.key: r for r in entries if not r.done}
        ended = {r.key: r for r in entries if r.done}
        assert len(admitted) + len(ended) == len(entries) and "" not in admitted
        assert set(ended) == set(admitted) and len(ended) >= len(load.results)
        assert all((r.arrival, r.prompt_tokens, r.output_tokens) == (
            admitted[k].arrival, admitted[k].prompt_tokens, MAX_TOKENS)
            for k, r in ended.items())
        # ... the ended one with its first and last token's latencies (measured goodput)
        assert all(0 < r.ttft_s <= r.e2e_s < 300 for r in ended.values())
        # ... and a prompt that begins with another (a next turn) with the key of the
        # latest one before it (router/lineage.py): the planner replays it after that.
        turns = [r for r in ended.values() if r.prompt_tokens == len(PROMPTS[5])]
        assert sum(bool(r.parent) for r in turns) >= len(turns) - 1 > 0
        assert all(ended[r.parent].prompt_tokens == len(PROMPTS[3]) for r in turns if r.parent)
        assert not any(r.parent for r in ended.values() if r.prompt_tokens != len(PROMPTS[5]))
        assert loop.traffic.recent(time.time() - 300) == sorted(ended.values(),
                                                                key=lambda r: r.arrival)
        steps = loop.steps.recent(time.time() - 300)
        assert {s.threads for s in steps} == {1}
        assert {"mixed", "decode"} <= {s.role for s in steps} <= {"mixed", "decode",
                                                                 "prefill"}
        del loop.recalibrate  # the real one again
        before = loop.autoscaler.score
        engine = loop.profile.steps[1]
        # A profile whose engine is 100x this one's: the fit says so and is refused, and
        # the planner keeps the profile's calibration.
        loop.profile = dataclasses.replace(loop.profile,
                                           steps={1: engine.scaled_parts(100.0, 100.0)})
        assert loop.recalibrate(time.time()) is None and loop.autoscaler.score is before
        # Any factors allowed (the synthetic profile is not this tiny model's engine): the
        # planner takes the fit of the very steps the workers published.
        loop.profile = dataclasses.replace(loop.profile, steps={1: engine})
        monkeypatch.setattr(served_fit, "FACTOR_RANGE", (1e-9, 1e9))
        fit = loop.recalibrate(time.time())
        assert fit is not None and fit.pooled.steps == len(steps) >= 100, fit
        assert fit == served_fit.fit_served_roles(engine, 1, [(s.role, s.seconds, s.sums)
                                                              for s in steps])
        assert set(fit.roles) <= {"mixed", "decode", "prefill"}
        assert len(loop.step_models) == len(loop.decisions) == 6
        assert set(loop.step_models) == {"the profile's"}  # the scripted decisions'
        assert loop.autoscaler.score is not before and loop.calibration == fit
        # Its window holds the switches: no configuration's own calibration. A window
        # that begins after the last switch is the current configuration's own.
        assert loop.memory.proven(time.time()) == set()
        loop._settled_at -= loop.config.window_s + 60  # as if the switch were older
        now = time.time()
        refit = loop.recalibrate(now)
        assert refit == fit and loop.memory.own("2 mixed x1t", now) is refit
        fit = refit
        assert "own calibration: 2 mixed x1t" in loop._describe(loop.memory.proven(now))
        assert f"planner_served_steps{{component=\"planner\"}} {float(fit.pooled.steps)}" in \
            loop.metrics.text().replace("pdserve:", "")
        top = max(fit.pooled.decode_factors, default=0.0)  # the decode table's range
        assert f'planner_served_factor{{component="planner",term="decode_max"}} {top}' in \
            loop.metrics.text().replace("pdserve:", "")
        # A window refused after it (its factors out of range) keeps that fit, and its
        # score, while it is at most KEEP_FIT_WINDOWS windows old; past that (a window
        # with no steps), the profile's own.
        scored, predict = loop.autoscaler.score, loop.caps.predict  # set together
        monkeypatch.setattr(served_fit, "FACTOR_RANGE", (1e3, 1e4))
        assert loop.recalibrate(time.time()) is fit and loop.autoscaler.score is scored
        later = time.time() + KEEP_FIT_WINDOWS * loop.config.window_s + 1
        on_profile = simulated_goodput(loop.profile, 1, *loop._slo,
                                       window_s=loop.config.window_s)
        mixed = loop.autoscaler.candidates[0]
        # its own fit: latencies unlike the profile's (goodput may tie: all served)
        own_ttft = predict(mixed, records)["ttft_p90_ms"]
        assert own_ttft != simulated(loop.profile, 1, *loop._slo)(mixed, records)["ttft_p90_ms"]
        assert loop.recalibrate(later) is None and loop.autoscaler.score is not scored
        assert loop.autoscaler.score(mixed, records) == on_profile(mixed, records)
        # Rule 2b's ITL score (--autoscale-itl) reads the same simulation.
        figures = simulated(loop.profile, 1, *loop._slo)(mixed, records)
        assert loop.autoscaler.itl is not None
        assert loop.autoscaler.itl(mixed, records) == figures["itl_p99_ms"] > 0
    finally:
        load.finish()
        loop.stop()

    errors = [r for _, r in load.results if isinstance(r, Exception)]
    assert not errors, errors[:3]
    reference = hf_greedy(tiny_checkpoints["llama"], PROMPTS, MAX_TOKENS)
    wrong = [p for p, r in load.results if r.token_ids != reference[p]]  # type: ignore[attr-defined]
    assert not wrong, f"{len(wrong)} of {len(load.results)} requests differ from HF"
    assert_cluster_idle(c)
    text = loop.metrics.text()
    assert 'planner_decisions_total{action="switch",component="planner",reason="switch"} 2.0' \
        in text.replace("pdserve:", "")
    assert "planner_role_changes_total" in text
    assert 'planner_move_seconds{component="planner",role="decode"}' in text.replace(
        "pdserve:", "")
    workers = urllib.request.urlopen(c.metrics_urls["worker-0"], timeout=5).read().decode()
    assert "worker_role_changes_total" in workers
