"""Sampler logic on hand-made logits (torch, but no model)."""

import math

import torch

from workers.engine.params import SamplingParams
from workers.engine.sampler import Sampler

LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def draws(params: SamplingParams, n: int = 400, seed: int = 0) -> set[int]:
    s = Sampler(seed)
    return {s.sample(LOGITS, ["r"], [params]).token_ids[0] for _ in range(n)}


def test_greedy_takes_the_argmax() -> None:
    out = Sampler().sample(torch.tensor([[0.1, 3.0, 2.0], [5.0, 0.0, 1.0]]), ["a", "b"],
                           [SamplingParams(temperature=0)] * 2)
    assert out.token_ids == [1, 0]


def test_filters_restrict_the_support() -> None:
    assert draws(SamplingParams(temperature=1.0)) == {0, 1, 2, 3}
    assert draws(SamplingParams(top_k=2)) == {0, 1}
    assert draws(SamplingParams(top_p=0.7)) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 covers it
    assert draws(SamplingParams(top_p=0.5)) == {0}
    assert draws(SamplingParams(min_p=0.25)) == {0, 1, 2}  # 0.05 < 0.25 * 0.5


def test_low_temperature_sharpens() -> None:
    assert draws(SamplingParams(temperature=0.05)) == {0}


def test_sampling_frequencies_follow_the_distribution() -> None:
    s = Sampler(1)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[s.sample(LOGITS, ["r"], [SamplingParams()]).token_ids[0]] += 1
    assert torch.allclose(counts / 4000, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)


def test_seeded_request_is_independent_of_its_batch() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(seed=1234)

    def run(batch_first: bool) -> list[int]:
        s = Sampler()
        out = []
        for _ in range(10):
            if batch_first:
                r = s.sample(logits, ["x", "me", "y"], [SamplingParams(), seeded, SamplingParams()])
                out.append(r.token_ids[1])
            else:
                out.append(s.sample(logits[1:2], ["me"], [seeded]).token_ids[0])
        return out

    assert run(True) == run(False)


def test_logprobs_are_of_the_raw_distribution() -> None:
    out = Sampler().sample(LOGITS, ["r"], [SamplingParams(temperature=0, logprobs=2)])
    lp = out.logprobs[0]
    assert lp.token_id == 0 and math.isclose(lp.logprob, math.log(0.5), rel_tol=1e-5)
    assert [t for t, _ in lp.top] == [0, 1]
    assert math.isclose(lp.top[1][1], math.log(0.3), rel_tol=1e-5)
    assert Sampler().sample(LOGITS, ["r"], [SamplingParams()]).logprobs == [None]


def test_tiny_positive_temperature_is_greedy_not_nan() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 9.0, 2.0]])
    for t in (1e-6, 1e-30, 1e-39):
        assert Sampler().sample(logits, ["r"], [SamplingParams(temperature=t)]).token_ids == [3]
