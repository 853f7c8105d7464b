import math

import pytest

from rooflm.errors import InvalidRequest
from rooflm.sampling_params import MAX_LOGPROBS, SamplingParams, resolve_max_tokens

BAD_VALUES = [
    ("n", 0),
    ("n", -1),
    ("n", 1.0),
    ("n", True),
    ("n", "2"),
    ("temperature", -1.0),
    ("temperature", "0.7"),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", None),
    ("top_p", 0),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_p", "1"),
    ("top_k", -2),
    ("top_k", 2.0),
    ("top_k", True),
    ("top_k", None),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("min_p", math.nan),
    ("presence_penalty", -2.5),
    ("presence_penalty", 2.01),
    ("presence_penalty", math.inf),
    ("frequency_penalty", -3),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", "1"),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.nan),
    ("seed", 1.5),
    ("seed", "42"),
    ("seed", True),
    ("seed", 2**64),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", True),
    ("max_tokens", 10.0),
    ("min_tokens", -1),
    ("min_tokens", 1.0),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", 5),
    ("stop", ["ok", 5]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 7),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("include_stop_str_in_output", None),
    ("skip_special_tokens", 0),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", 1.0),
    ("logprobs", True),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 21),
    ("prompt_logprobs", "5"),
]


@pytest.mark.parametrize("field,value", BAD_VALUES)
def test_bad_value_raises_naming_the_field(field, value):
    with pytest.raises(InvalidRequest, match=field) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
    assert isinstance(err.value, ValueError)  # callers catching ValueError keep working


GOOD_VALUES = [
    ("n", 4),
    ("temperature", 0),
    ("temperature", 0.0),
    ("temperature", 2.5),
    ("top_p", 1),
    ("top_p", 1e-6),
    ("top_k", -1),
    ("top_k", 0),
    ("top_k", 1),
    ("top_k", 50),
    ("min_p", 0.0),
    ("min_p", 1.0),
    ("presence_penalty", -2),
    ("presence_penalty", 2.0),
    ("frequency_penalty", 1.5),
    ("repetition_penalty", 0.5),
    ("repetition_penalty", 1.3),
    ("seed", 0),
    ("seed", -7),
    ("seed", 2**64 - 1),
    ("max_tokens", None),
    ("max_tokens", 1),
    ("min_tokens", 16),
    ("stop", None),
    ("stop", "\n\n"),
    ("stop", ["a", "bc"]),
    ("stop_token_ids", None),
    ("stop_token_ids", [0, 2]),
    ("ignore_eos", True),
    ("logprobs", 0),
    ("logprobs", MAX_LOGPROBS),
    ("prompt_logprobs", 0),
    ("prompt_logprobs", 5),
    ("skip_special_tokens", False),
    ("include_stop_str_in_output", True),
]


@pytest.mark.parametrize("field,value", GOOD_VALUES)
def test_good_value_passes(field, value):
    SamplingParams(**{field: value})


def test_min_tokens_must_not_exceed_max_tokens():
    with pytest.raises(InvalidRequest, match="min_tokens") as err:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert err.value.param == "min_tokens"
    SamplingParams(max_tokens=4, min_tokens=4)
    SamplingParams(max_tokens=None, min_tokens=1000)


def test_message_names_the_range():
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1.0"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        SamplingParams(top_p=0)


def test_normalisation():
    params = SamplingParams(stop="###", temperature=1, top_p=1)
    assert params.stop == ["###"]
    assert params.stop_token_ids == []
    assert isinstance(params.temperature, float)
    assert isinstance(params.top_p, float)
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams().stop == []


def test_defaults():
    params = SamplingParams()
    assert params.n == 1
    assert params.temperature == 1.0
    assert params.max_tokens == 16
    assert params.logprobs is None
    assert params.skip_special_tokens is True
    assert not params.greedy


@pytest.mark.parametrize(
    "kwargs,greedy",
    [
        ({"temperature": 0.0}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.0, "top_k": 5}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 0.7, "top_k": 2}, False),
        ({"top_k": -1}, False),
    ],
)
def test_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy


def test_max_tokens_resolves_against_the_context_length():
    assert resolve_max_tokens(None, prompt_len=100, max_model_len=512) == 412
    assert resolve_max_tokens(412, prompt_len=100, max_model_len=512) == 412
    with pytest.raises(InvalidRequest, match=r"plus max_tokens \(413\) is 513, over the context "
                                             r"length of 512") as err:
        resolve_max_tokens(413, prompt_len=100, max_model_len=512)
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequest, match="prompt has 512 tokens, but the context length is 512") as err:
        resolve_max_tokens(None, prompt_len=512, max_model_len=512)
    assert err.value.param == "prompt"
