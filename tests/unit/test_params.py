import pytest

from workers.engine.params import InvalidRequestError, SamplingParams, SchedulerConfig


@pytest.mark.parametrize(
    ("kwargs", "field", "limit"),
    [
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"temperature": -0.5}, "temperature", ">= 0"),
        ({"temperature": float("nan")}, "temperature", ">= 0"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"logprobs": 50}, "logprobs", "[0, 20]"),
        ({"stop": [""]}, "stop", "non-empty"),
    ],
)
def test_invalid_sampling_params_name_the_field_and_limit(kwargs, field, limit) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:") and limit in str(err.value)


def test_stop_lists_become_tuples() -> None:
    p = SamplingParams(stop="###", stop_token_ids=[3, 4])
    assert p.stop == ("###",) and p.stop_token_ids == (3, 4)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


def test_scheduler_config_rejects_a_context_larger_than_the_pool() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(num_blocks=2, block_size=4, max_model_len=9)
