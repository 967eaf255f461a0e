"""Sampler logic on hand-made logits (torch, but no model)."""

import math
from dataclasses import dataclass

import pytest
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


def test_greedy_rows_use_the_given_argmax_where_it_applies() -> None:
    seen: list[tuple[int, ...]] = []

    def argmax(x: torch.Tensor) -> torch.Tensor:  # the native kernel's contract
        seen.append(tuple(x.shape))
        return x.argmax(dim=-1)

    s = Sampler(argmax=argmax)
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0)]
    out = s.sample(logits, ["a", "b", "c"], params)
    # the greedy pass over every row, then the random row's exponential race
    assert seen == [(3, 3), (1, 3)] and out.token_ids[0] == 1 and out.token_ids[2] == 2
    assert out.token_ids[1] == Sampler().sample(logits, ["a", "b", "c"], params).token_ids[1]
    # not float32, or rows not contiguous: torch's argmax
    assert s.sample(logits.double(), ["a"] * 3, [params[0]] * 3).token_ids == [1, 0, 2]
    assert s.sample(logits.t(), ["a"] * 3, [params[0]] * 3).token_ids == [1, 0, 2]
    assert seen == [(3, 3), (1, 3)]


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


# -- penalties, logit_bias, allowed_token_ids, min_tokens ------------------------------


@dataclass
class History:
    token_ids: list[int]
    num_prompt_tokens: int


def reference(logits: torch.Tensor, p: SamplingParams, h: History,
              eos: frozenset[int] = frozenset()) -> torch.Tensor:
    """The processed logits of one row, element by element, straight from the definitions."""
    out = logits.clone().tolist()
    prompt, output = h.token_ids[: h.num_prompt_tokens], h.token_ids[h.num_prompt_tokens:]
    for t in range(len(out)):
        if t in prompt or t in output:
            r = p.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        n = output.count(t)
        out[t] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
    for t, b in p.logit_bias:
        out[t] += b
    for t in range(len(out)):
        if p.allowed_token_ids and t not in p.allowed_token_ids:
            out[t] = -math.inf
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else eos)
        if len(output) < p.min_tokens and t in stops:
            out[t] = -math.inf
    return torch.tensor(out)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.5]])
    h = History([0, 3, 1], num_prompt_tokens=2)  # prompt 0, 3; output 1
    plain = Sampler().sample(logits, ["a"], [SamplingParams(temperature=0)], [h])
    assert plain.token_ids == [0]
    out = Sampler().sample(logits, ["a"], [SamplingParams(temperature=0,
                                                          repetition_penalty=2.0)], [h])
    assert out.token_ids == [2]  # 2.0 / 2 = 1.0 < 1.5, unseen
    low = Sampler().sample(torch.tensor([[1.0, -1.0, 1.5, 0.5]]), ["a"],
                           [SamplingParams(temperature=0, repetition_penalty=0.5)], [h])
    assert low.token_ids == [0]  # 1.0 / 0.5 = 2.0 > 1.5


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0, 0.0]])
    in_prompt = History([0, 0, 0, 2], num_prompt_tokens=4)
    freq = SamplingParams(temperature=0, frequency_penalty=1.0)
    assert Sampler().sample(logits, ["a"], [freq], [in_prompt]).token_ids == [0]
    twice = History([2, 0, 0], num_prompt_tokens=1)  # output: 0 twice
    assert Sampler().sample(logits, ["a"], [freq], [twice]).token_ids == [1]  # 3 - 2 < 2.5
    once = History([2, 0], num_prompt_tokens=1)
    assert Sampler().sample(logits, ["a"], [SamplingParams(temperature=0, frequency_penalty=0.4)],
                            [once]).token_ids == [0]  # 3 - 0.4 > 2.5
    assert Sampler().sample(logits, ["a"], [SamplingParams(temperature=0, presence_penalty=0.6)],
                            [once]).token_ids == [1]  # 3 - 0.6 < 2.5
    assert Sampler().sample(logits, ["a"], [SamplingParams(temperature=0, presence_penalty=-2)],
                            [History([2, 1], 1)]).token_ids == [1]  # 2.5 + 2 > 3


def test_logit_bias_moves_the_argmax_and_logprobs_stay_raw() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0, 0.0]])
    p = SamplingParams(temperature=0, logit_bias={0: -100, 3: 2.9}, logprobs=1)
    out = Sampler().sample(logits, ["a"], [p], [History([1], 1)])
    assert out.token_ids == [3]
    raw = torch.log_softmax(logits[0], dim=-1)
    lp = out.logprobs[0]
    assert lp is not None and lp.logprob == pytest.approx(float(raw[3]))
    assert lp.top[0][0] == 0  # the raw distribution's most likely token


def test_allowed_token_ids_restrict_greedy_and_random_sampling() -> None:
    p = SamplingParams(allowed_token_ids=[2, 3])
    s = Sampler(0)
    drawn = {s.sample(LOGITS, ["r"], [p], [History([1], 1)]).token_ids[0] for _ in range(300)}
    assert drawn == {2, 3}
    greedy = SamplingParams(temperature=0, allowed_token_ids=[1, 3])
    assert Sampler().sample(LOGITS, ["r"], [greedy], [History([1], 1)]).token_ids == [1]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])  # 0 is EOS, 1 a stop token id
    s = Sampler(eos_token_ids=frozenset({0}))
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    assert s.sample(logits, ["a"], [p], [History([3], 1)]).token_ids == [2]
    assert s.sample(logits, ["a"], [p], [History([3, 2], 1)]).token_ids == [2]
    assert s.sample(logits, ["a"], [p], [History([3, 2, 2], 1)]).token_ids == [0]
    no_eos = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert s.sample(logits, ["a"], [no_eos], [History([3], 1)]).token_ids == [0]
    random_p = SamplingParams(min_tokens=1, stop_token_ids=[1], seed=3)
    assert all(s.sample(logits, ["b"], [random_p], [History([3], 1)]).token_ids[0] >= 2
               for _ in range(200))


def test_batched_processing_matches_the_definitions_row_by_row() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, eos = 40, frozenset({7})
    logits = torch.randn(8, vocab, generator=gen) * 3
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=1.7, frequency_penalty=0.8,
                       presence_penalty=-0.5),
        SamplingParams(temperature=0, repetition_penalty=0.6, logit_bias={3: 5.5, 9: -100}),
        SamplingParams(temperature=0, frequency_penalty=2.0, allowed_token_ids=[1, 2, 3, 4, 7]),
        SamplingParams(temperature=0, min_tokens=10, stop_token_ids=[5, 6]),
        SamplingParams(temperature=0, presence_penalty=2.0, min_tokens=1),
        SamplingParams(temperature=0, repetition_penalty=1.3, logit_bias={0: 3.0}),
        SamplingParams(temperature=0, frequency_penalty=-1.0, logit_bias={11: 1.0, 12: -1.0}),
    ]
    histories = []
    for i in range(8):
        tokens = torch.randint(0, vocab, (12,), generator=gen).tolist()
        histories.append(History(tokens, num_prompt_tokens=4 + i % 3))
    s = Sampler(eos_token_ids=eos)
    ids = [f"r{i}" for i in range(8)]
    processed = s._process(logits, ids, params, histories)
    for i, (p, h) in enumerate(zip(params, histories, strict=True)):
        assert torch.allclose(processed[i], reference(logits[i], p, h, eos), atol=1e-5), i
    got = s.sample(logits, ids, params, histories).token_ids
    want = [int(reference(logits[i], p, h, eos).argmax())
            for i, (p, h) in enumerate(zip(params, histories, strict=True))]
    assert got == want


def test_processing_leaves_the_callers_logits_alone_and_stays_finite() -> None:
    logits = torch.tensor([[50.0, -50.0, 1.0, 0.0]])
    before = logits.clone()
    p = SamplingParams(repetition_penalty=2.0**-126, logit_bias={2: 1.0})  # 50 / p > fp32
    s = Sampler(0)
    out = s.sample(logits, ["a"], [p], [History([0, 1], 2)])
    assert torch.equal(logits, before)
    assert torch.isfinite(s._process(logits, ["a"], [p], [History([0, 1], 2)])).all()
    assert out.token_ids == [0]


def test_min_tokens_never_leaves_a_row_with_nothing_to_sample() -> None:
    """allowed_token_ids naming only stop tokens, before min_tokens: the row keeps them
    (the request ends) instead of sampling from all -inf (NaN probabilities)."""
    from workers.engine.sampler import Sampler

    sampler = Sampler(eos_token_ids=frozenset({3}))
    logits = torch.randn(2, 8)
    params = [SamplingParams(max_tokens=8, min_tokens=4, allowed_token_ids=(3,), temperature=1.0,
                             seed=1),
              SamplingParams(max_tokens=8, min_tokens=4, temperature=0.0)]
    histories = [History([1, 2], 2), History([1, 2], 2)]
    out = sampler.sample(logits, ["a", "b"], params, histories)
    assert out.token_ids[0] == 3  # the only token it may sample
    assert out.token_ids[1] != 3  # the other row still holds EOS back


def test_bad_words_ban_a_word_s_last_token_only_after_the_rest_of_it() -> None:
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0], [3.0, 2.5, 2.0, 0.0]])
    p = SamplingParams(temperature=0, bad_words=("x",))
    s = Sampler()
    s.set_bad_words("a", [(0,)])  # a one-token word: never
    s.set_bad_words("b", [(2, 0), (3, 1)])  # two-token words: only after their first
    after_2 = History([5, 2], num_prompt_tokens=1)
    out = s.sample(logits, ["a", "b"], [p, p], [History([1], 1), after_2])
    assert out.token_ids == [1, 1]
    ones = torch.tensor([[2.5, 3.0, 2.0, 0.0]])  # 1 is the argmax
    assert s.sample(ones, ["b"], [p], [History([5, 2], 1)]).token_ids == [1]  # (2, 0) only
    assert s.sample(ones, ["b"], [p], [History([3], 1)]).token_ids == [0]  # prompt counts
    s.release("b")
    assert s.sample(logits[1:], ["b"], [p], [after_2]).token_ids == [0]  # forgotten
