"""The one request object (common.request) and its wire form (common.wire)."""

import pytest

from common.request import Request
from common.sampling import InvalidRequestError, SamplingParams
from common.wire import request_from_proto, request_to_proto, sampling_to_proto
from protos.pdserve.v1 import common_pb2, worker_pb2


def test_request_round_trips_through_the_internal_wire_unchanged() -> None:
    r = Request("r1", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0, top_k=3,
                                                 seed=7, stop=("x",), logprobs=2), "tenant")
    back = request_from_proto(worker_pb2.WorkerGenerateRequest.FromString(
        request_to_proto(r).SerializeToString()))
    assert back == r and back.prompt_token_ids == (1, 2, 3)


def test_empty_salt_is_no_salt_on_both_sides_of_the_wire() -> None:
    r = Request("r", (1,), SamplingParams(), "")
    assert r.cache_salt is None
    assert request_to_proto(r).cache_salt == ""
    assert request_from_proto(request_to_proto(r)).cache_salt is None


def test_worker_refuses_a_wire_request_with_a_bad_value_naming_the_field() -> None:
    msg = worker_pb2.WorkerGenerateRequest(request_id="r", prompt_token_ids=[1],
                                           sampling=common_pb2.SamplingParams(top_p=2.0))
    with pytest.raises(InvalidRequestError) as e:
        request_from_proto(msg)
    assert e.value.field == "top_p"
    with pytest.raises(InvalidRequestError) as e:
        request_from_proto(worker_pb2.WorkerGenerateRequest(
            prompt_token_ids=[1], sampling=sampling_to_proto(SamplingParams())))
    assert e.value.field == "request_id"


def test_continued_request_carries_the_tokens_so_far_and_fewer_max_tokens() -> None:
    r = Request("r", (5, 6), SamplingParams(max_tokens=10, seed=3), "s")
    c = r.continued([7, 8, 9], "r#2")
    assert c == Request("r#2", (5, 6, 7, 8, 9), SamplingParams(max_tokens=7, seed=3), "s")
    assert r.continued([], "r#3") == Request("r#3", (5, 6), r.sampling, "s")
    with pytest.raises(ValueError, match="max_tokens 10"):
        r.continued(list(range(10)), "r#4")
    m = Request("m", (5,), SamplingParams(max_tokens=10, min_tokens=4), "")
    assert m.continued([7, 8], "m#2").sampling.min_tokens == 2  # still owed: 2 more
    assert m.continued([7] * 6, "m#3").sampling.min_tokens == 0  # valid: min <= max


def test_default_max_tokens_is_reduced_too_after_a_migration() -> None:
    """An unset max_tokens is the engine default (16): a migration after 4 tokens leaves
    12, where the proto-level reduction used to leave the worker's default of 16."""
    r = request_from_proto(worker_pb2.WorkerGenerateRequest(request_id="r",
                                                            prompt_token_ids=[1]))
    assert r.continued([2, 3, 4, 5], "r#1").sampling.max_tokens == 12


def test_choices_are_bounded_and_each_draws_with_its_own_seed() -> None:
    from common.request import MAX_CHOICES, choice_sampling

    seeded = SamplingParams(temperature=1.0, seed=5)
    r = Request("r", (1, 2), seeded, n=3)
    assert [r.choice_sampling(i).seed for i in range(3)] == [5, 6, 7]
    assert r.choice(2, "r2") == Request("r2", (1, 2), SamplingParams(temperature=1.0, seed=7))
    assert choice_sampling(SamplingParams(), 4).seed is None  # unseeded stays unseeded
    wrapped = choice_sampling(SamplingParams(seed=2**63 - 1), 1).seed
    assert wrapped == -(2**63)  # wraps within int64
    for bad in (0, MAX_CHOICES + 1, True, 1.5):
        with pytest.raises(InvalidRequestError) as e:
            Request("r", (1,), SamplingParams(), n=bad)
        assert e.value.field == "n" and str(MAX_CHOICES) in str(e.value)
    with pytest.raises(ValueError, match="one choice at a time"):
        r.continued([3], "r3")
