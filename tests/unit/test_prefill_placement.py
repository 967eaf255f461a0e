"""router.adaptive: the per-request local-or-remote prefill rule, on a made-up machine
profile (pure; no model, no processes)."""

import dataclasses

import pytest

from common.cost_model import Profile, StepModel, TransferModel, features
from router.adaptive import PlacementInputs, PrefillPlacement


def _profile() -> Profile:
    """19 ms per step + 1 ms per batched token; attention and sequences free; KV moves
    at 1 GB/s after 5 ms (1 KB per token)."""
    n = len(features([]))
    coef = [0.0] * n
    coef[0], coef[1] = 0.019, 0.001  # 19 ms + 1 ms per batched token
    step = StepModel(tuple(coef), 0.020)
    return Profile("m", "float32", {}, 16, 1024, 4096, 2048, 256, 4096, {1: step, 2: step},
                   TransferModel(0.005, 1e9))


def test_without_a_profile_only_the_static_threshold_decides():
    rule = PrefillPlacement(None, static_threshold=32)
    assert rule.decide(PlacementInputs(uncached_tokens=31)) == (True, "short")
    assert rule.decide(PlacementInputs(uncached_tokens=32, prefill_queued_tokens=10**6)) == (
        False, "remote")


def test_an_idle_decode_worker_takes_the_prompt_when_the_prefill_queue_is_long():
    rule = PrefillPlacement(_profile(), static_threshold=0)
    x = PlacementInputs(uncached_tokens=512, prefill_queued_tokens=4096)
    assert rule.decide(x) == (True, "idle")
    e = rule.estimate(x)
    assert e.local_s < e.remote_s and e.stall_s == 0.0


def test_with_an_idle_prefill_pool_remote_wins_unless_local_is_clearly_sooner():
    rule = PrefillPlacement(_profile(), static_threshold=0)
    # Same compute either way; remote adds only the transfer: local is not 20% sooner.
    assert rule.decide(PlacementInputs(uncached_tokens=512)) == (False, "remote")
    eager = PrefillPlacement(_profile(), static_threshold=0, local_gain=0.0)
    assert eager.decide(PlacementInputs(uncached_tokens=512))[0] is True


def test_running_decodes_keep_a_long_prompt_off_the_decode_worker_beyond_the_budget():
    rule = PrefillPlacement(_profile(), static_threshold=0, itl_budget_s=0.1)
    busy = dict(decode_running=8, decode_context_tokens=8 * 300, prefill_queued_tokens=8192)
    # 1024 tokens in one step: ~1 s stall > 100 ms budget, though local would be sooner.
    assert rule.decide(PlacementInputs(uncached_tokens=1024, **busy)) == (False, "queue")
    # 40 tokens ride along within the budget (a ~50 ms step).
    assert rule.decide(PlacementInputs(uncached_tokens=40, **busy)) == (True, "spare")


def test_a_ttft_target_keeps_a_prompt_remote_that_the_prefill_pool_serves_in_time():
    """Local would be sooner (a 256-token queue on the prefill worker), and its stall
    fits the budget; with a TTFT target whose share remote's estimate meets, the prompt
    still goes remote and spares the running decodes that stall."""
    busy = dict(decode_running=4, decode_context_tokens=4 * 300, prefill_queued_tokens=256)
    x = PlacementInputs(uncached_tokens=200, **busy)
    rule = PrefillPlacement(_profile(), static_threshold=0, itl_budget_s=0.5)
    e = rule.estimate(x)  # remote ~0.50 s (queue 0.28 + prefill 0.22), local ~0.25 s
    assert e.local_s < 0.8 * e.remote_s and e.stall_s <= 0.5
    assert rule.decide(x) == (True, "spare")
    lenient = PrefillPlacement(_profile(), static_threshold=0, itl_budget_s=0.5,
                               ttft_slo_s=2 * e.remote_s)  # remote within half of it
    assert lenient.decide(x) == (False, "slo")
    # a target remote would miss (by its share): local, as without one
    tight = PrefillPlacement(_profile(), static_threshold=0, itl_budget_s=0.5,
                             ttft_slo_s=1.5 * e.remote_s)
    assert tight.decide(x) == (True, "spare")
    # an idle decode worker delays nobody: still local, whatever the target
    idle = PlacementInputs(uncached_tokens=200, prefill_queued_tokens=256)
    assert lenient.decide(idle) == (True, "idle")


def test_the_remote_estimate_follows_when_the_prefill_workers_send_the_kv():
    """Under ``layers`` (the default) the KV moves while the prefill computes it: remote
    pays the longer of the two; offered after the step, it pays both."""
    # 512 tokens of KV: 0.26 s on this link; their prefill 0.55 s
    slow = dataclasses.replace(_profile(), transfer=TransferModel(0.005, 2e6))
    x = PlacementInputs(uncached_tokens=512)
    step = slow.step(1)
    prefill, move = step.prefill_seconds(512), 512 * 1024 / 2e6
    layers = PrefillPlacement(slow, static_threshold=0).estimate(x).remote_s
    after = PrefillPlacement(slow, static_threshold=0, kv_offer="after").estimate(x).remote_s
    assert layers == pytest.approx(max(prefill, move) + 0.005)
    assert after == pytest.approx(prefill + move + 0.005)
    assert PrefillPlacement(slow, static_threshold=0, kv_offer="step").estimate(x).remote_s \
        == pytest.approx(after)
    # the same prompt: kept remote when its KV streams, computed locally when it would
    # follow the prefill (local 0.55 s is more than 20% sooner than 0.82 s, not than 0.56)
    assert PrefillPlacement(slow, static_threshold=0).decide(x) == (False, "remote")
    assert PrefillPlacement(slow, static_threshold=0, kv_offer="after").decide(x)[0] is True


def test_a_chunked_prompts_kv_moves_during_its_last_chunk_only():
    """A prompt over the step budget (2,048 tokens here) is prefilled in chunks, and the
    early offer goes before the last one: all the KV moves during that step."""
    slow = dataclasses.replace(_profile(), transfer=TransferModel(0.005, 2e6))
    step = slow.step(1)
    x = PlacementInputs(uncached_tokens=5000, cached_tokens=100)
    earlier, last = 4096, 5000 - 4096
    move = 5000 * 1024 / 2e6  # 2.56 s, longer than the last chunk's step
    before = step.prefill_seconds(earlier, 100)
    last_s = step.prefill_seconds(last, 100 + earlier)
    layers = PrefillPlacement(slow, static_threshold=0).estimate(x).remote_s
    after = PrefillPlacement(slow, static_threshold=0, kv_offer="after").estimate(x).remote_s
    assert layers == pytest.approx(before + max(last_s, move) + 0.005)
    assert after == pytest.approx(before + last_s + move + 0.005)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="kv_offer"):
        PrefillPlacement(_profile(), kv_offer="never")
    with pytest.raises(ValueError, match="itl_budget_s"):
        PrefillPlacement(_profile(), itl_budget_s=0)
    with pytest.raises(ValueError, match="local_gain"):
        PrefillPlacement(_profile(), local_gain=1.0)
    with pytest.raises(ValueError, match="ttft_slo_s"):
        PrefillPlacement(_profile(), ttft_slo_s=0)
    with pytest.raises(ValueError, match="ttft_share"):
        PrefillPlacement(_profile(), ttft_slo_s=1.0, ttft_share=0)
    with pytest.raises(KeyError, match="thread"):
        PrefillPlacement(_profile(), decode_threads=4)
