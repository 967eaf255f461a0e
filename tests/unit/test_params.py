import pytest

from common.request import (
    MAX_CACHE_SALT_BYTES,
    MAX_CLIENT_REQUEST_ID_CHARS,
    MAX_REQUEST_ID_CHARS,
    Request,
    check_cache_salt,
)
from common.sampling import (
    LOGIT_BIAS_MAX,
    LOGIT_BIAS_MIN,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STRUCTURED_SPEC_BYTES,
    MAX_TOKENS_LIMIT,
    PENALTY_MAX,
    PENALTY_MIN,
    SEED_MAX,
    SEED_MIN,
    STOP_TOKEN_ID_MAX,
    TOKEN_ID_MAX,
    TOP_K_MAX,
    TOP_K_MIN,
    StructuredOutput,
    check_sampling_vocab,
)
from common.wire import request_from_proto, request_to_proto, sampling_from_proto, sampling_to_proto
from workers.engine.params import InvalidRequestError, SamplingParams, SchedulerConfig

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    ("kwargs", "field", "limit"),
    [
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens", f"<= {MAX_TOKENS_LIMIT}"),
        ({"max_tokens": 16.0}, "max_tokens", "integer"),
        ({"max_tokens": True}, "max_tokens", "integer"),
        ({"temperature": -0.5}, "temperature", ">= 0"),
        ({"temperature": NAN}, "temperature", "finite"),
        ({"temperature": INF}, "temperature", "finite"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_p": NAN}, "top_p", "(0, 1]"),
        ({"top_p": INF}, "top_p", "(0, 1]"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"min_p": NAN}, "min_p", "[0, 1]"),
        ({"min_p": INF}, "min_p", "[0, 1]"),
        ({"top_k": TOP_K_MIN - 1}, "top_k", f">= {TOP_K_MIN}"),
        ({"top_k": TOP_K_MAX + 1}, "top_k", f"<= {TOP_K_MAX}"),
        ({"seed": SEED_MIN - 1}, "seed", f">= {SEED_MIN}"),
        ({"seed": SEED_MAX + 1}, "seed", f"<= {SEED_MAX}"),
        ({"logprobs": 50}, "logprobs", f"<= {MAX_LOGPROBS}"),
        ({"logprobs": -1}, "logprobs", ">= 0"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop", f"at most {MAX_STOP_STRINGS}"),
        ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop",
         f"at most {MAX_STOP_STRING_CHARS} characters"),
        ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids",
         f"at most {MAX_STOP_TOKEN_IDS}"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", f"[0, {STOP_TOKEN_ID_MAX}]"),
        ({"stop_token_ids": [STOP_TOKEN_ID_MAX + 1]}, "stop_token_ids",
         f"[0, {STOP_TOKEN_ID_MAX}]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty", "> 0"),
        ({"repetition_penalty": NAN}, "repetition_penalty", "finite"),
        ({"repetition_penalty": INF}, "repetition_penalty", "finite"),
        ({"frequency_penalty": 2.5}, "frequency_penalty", f"[{PENALTY_MIN}, {PENALTY_MAX}]"),
        ({"frequency_penalty": NAN}, "frequency_penalty", f"[{PENALTY_MIN}, {PENALTY_MAX}]"),
        ({"presence_penalty": -2.01}, "presence_penalty", f"[{PENALTY_MIN}, {PENALTY_MAX}]"),
        ({"presence_penalty": INF}, "presence_penalty", f"[{PENALTY_MIN}, {PENALTY_MAX}]"),
        ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias",
         f"at most {MAX_LOGIT_BIAS}"),
        ({"logit_bias": {5: 101.0}}, "logit_bias", f"[{LOGIT_BIAS_MIN}, {LOGIT_BIAS_MAX}]"),
        ({"logit_bias": {5: NAN}}, "logit_bias", f"[{LOGIT_BIAS_MIN}, {LOGIT_BIAS_MAX}]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias", ">= 0"),
        ({"logit_bias": {TOKEN_ID_MAX + 1: 1.0}}, "logit_bias", f"<= {TOKEN_ID_MAX}"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias", "integer"),
        ({"min_tokens": -1}, "min_tokens", ">= 0"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens", "<= 16"),
        ({"min_tokens": 1.0}, "min_tokens", "integer"),
        ({"allowed_token_ids": [0] * (MAX_ALLOWED_TOKEN_IDS + 1)}, "allowed_token_ids",
         f"at most {MAX_ALLOWED_TOKEN_IDS}"),
        ({"allowed_token_ids": [-3]}, "allowed_token_ids", ">= 0"),
    ],
)
def test_invalid_sampling_params_name_the_field_and_limit(kwargs, field, limit) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:") and limit in str(err.value)


def test_sampling_controls_admit_their_limits_and_survive_the_wire() -> None:
    p = SamplingParams(repetition_penalty=2.0**-20, frequency_penalty=PENALTY_MIN,
                       presence_penalty=PENALTY_MAX, min_tokens=16, max_tokens=16,
                       logit_bias={i: LOGIT_BIAS_MAX if i % 2 else LOGIT_BIAS_MIN
                                   for i in range(MAX_LOGIT_BIAS)},
                       allowed_token_ids=[TOKEN_ID_MAX] * MAX_ALLOWED_TOKEN_IDS)
    assert sampling_from_proto(sampling_to_proto(p)) == p
    plain = sampling_to_proto(SamplingParams())
    assert not plain.HasField("repetition_penalty") and not plain.HasField("min_tokens")
    assert sampling_from_proto(plain) == SamplingParams()


def test_logit_bias_and_allowed_ids_must_be_in_the_vocabulary() -> None:
    check_sampling_vocab(SamplingParams(logit_bias={99: 1}, allowed_token_ids=[99]), 100)
    for kwargs, field in (({"logit_bias": {100: 1.0}}, "logit_bias"),
                          ({"allowed_token_ids": [3, 100]}, "allowed_token_ids")):
        with pytest.raises(InvalidRequestError) as err:
            check_sampling_vocab(SamplingParams(**kwargs), 100)
        assert err.value.field == field and "[0, 100)" in str(err.value)


def test_every_bound_admits_its_limit() -> None:
    SamplingParams(max_tokens=MAX_TOKENS_LIMIT, top_k=TOP_K_MAX, seed=SEED_MAX,
                   logprobs=MAX_LOGPROBS, stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                   stop_token_ids=[STOP_TOKEN_ID_MAX] * MAX_STOP_TOKEN_IDS, temperature=1e6)
    SamplingParams(top_k=TOP_K_MIN, seed=SEED_MIN, logprobs=0, temperature=0.0)
    Request("r" * MAX_REQUEST_ID_CHARS, (1,), SamplingParams(), "é" * (MAX_CACHE_SALT_BYTES // 2))


@pytest.mark.parametrize(
    ("make", "field", "limit"),
    [
        (lambda: Request("r", (1,), SamplingParams(), "s" * 70_000), "cache_salt",
         f"at most {MAX_CACHE_SALT_BYTES} bytes"),
        # 129 two-byte characters: under the limit in characters, over it in bytes.
        (lambda: Request("r", (1,), SamplingParams(), "é" * (MAX_CACHE_SALT_BYTES // 2 + 1)),
         "cache_salt", f"got {MAX_CACHE_SALT_BYTES + 2}"),
        (lambda: Request("r", (1,), SamplingParams(), "\ud800"), "cache_salt", "Unicode"),
        (lambda: Request("r" * (MAX_REQUEST_ID_CHARS + 1), (1,), SamplingParams()),
         "request_id", f"at most {MAX_REQUEST_ID_CHARS}"),
        (lambda: Request("\udfff", (1,), SamplingParams()), "request_id", "Unicode"),
        (lambda: Request("", (1,), SamplingParams()), "request_id", "non-empty"),
    ],
)
def test_invalid_requests_name_the_field_and_limit(make, field, limit) -> None:
    with pytest.raises(InvalidRequestError) as err:
        make()
    assert err.value.field == field and str(err.value).startswith(f"{field}:")
    assert limit in str(err.value), str(err.value)


def test_a_worker_rebuilding_a_request_from_the_wire_checks_the_salt_again() -> None:
    msg = request_to_proto(Request("r", (1, 2), SamplingParams(), "tenant"))
    msg.cache_salt = "s" * (MAX_CACHE_SALT_BYTES + 1)
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        request_from_proto(msg)
    check_cache_salt(None)
    assert MAX_CLIENT_REQUEST_ID_CHARS < MAX_REQUEST_ID_CHARS


def test_stop_lists_become_tuples() -> None:
    p = SamplingParams(stop="###", stop_token_ids=[3, 4])
    assert p.stop == ("###",) and p.stop_token_ids == (3, 4)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


def test_scheduler_config_rejects_a_context_larger_than_the_pool() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(num_blocks=2, block_size=4, max_model_len=9)


def test_the_smallest_top_p_still_samples_the_most_likely_token() -> None:
    """Every value the bound admits must work: 1e-300 is 0 in float32, which once
    dropped every token and sampled token 0."""
    import torch

    from workers.engine.sampler import Sampler

    logits = torch.tensor([[0.0, 5.0, 1.0]])
    for top_p in (1e-300, 1e-9):
        p = SamplingParams(top_p=top_p, seed=1)
        assert Sampler().sample(logits, ["r"], [p]).token_ids == [1], top_p


@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        ("xml", ""),  # unknown kind
        ("json_object", "{}"),  # takes no spec
        ("regex", ""),
        ("json_schema", "{not json"),
        ("json_schema", "[1, 2]"),  # a schema is an object
        ("choice", "[]"),
        ("choice", '["a", 3]'),
        ("choice", '[""]'),
        ("json_schema", '{"description": "' + "x" * MAX_STRUCTURED_SPEC_BYTES + '"}'),
    ],
)
def test_structured_output_refuses_bad_specs_naming_the_field(kind: str, spec: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutput(kind, spec)
    assert e.value.field == "structured"


def test_structured_output_bounds_prior_tokens() -> None:
    with pytest.raises(InvalidRequestError, match="prior_tokens"):
        StructuredOutput("regex", "a+", prior_tokens=-1)


def test_structured_output_round_trips_the_wire_and_migration_counts_prior_tokens() -> None:
    s = StructuredOutput("json_schema", '{"type": "object"}')
    p = SamplingParams(max_tokens=10, structured=s)
    assert sampling_from_proto(sampling_to_proto(p)) == p
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).structured is None
    moved = Request("r", (1, 2), p).continued([3, 4], "r2").continued([], "r3")
    assert moved.sampling.structured == StructuredOutput("json_schema", s.spec, 2)
    again = Request("r", (1, 2), p).continued([3, 4, 5], "r4")
    assert again.sampling.structured.prior_tokens == 3
    assert request_from_proto(request_to_proto(moved)) == moved
