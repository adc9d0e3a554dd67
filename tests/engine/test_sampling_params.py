"""SamplingParams: vLLM defaults, normalisation, validation, greedy detection, clone."""

from __future__ import annotations

import pytest

from deltaserve.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert p.n == 1
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert p.seed is None
    assert p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.include_stop_str_in_output is False
    assert p.skip_special_tokens is True and p.spaces_between_special_tokens is True
    assert p.detokenize is True
    assert p.sampling_type == SamplingType.RANDOM and not p.is_greedy


def test_stop_normalisation() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]
    assert SamplingParams(stop=("a",)).stop == ["a"]
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == [3, 4]
    assert SamplingParams(stop_token_ids=(7,)).stop_token_ids == [7]


def test_max_tokens_none_allowed() -> None:
    p = SamplingParams(max_tokens=None, min_tokens=100)
    assert p.max_tokens is None and p.min_tokens == 100


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"n": 0}, "n"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 5]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    message = str(err.value)
    assert field in message
    value = kwargs[field]
    if field == "stop" and not isinstance(value, str) and not isinstance(value, list):
        assert "unknown stop type" in message
    assert repr(value) in message or str(value) in message


def test_boundary_values_accepted() -> None:
    SamplingParams(top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0)
    SamplingParams(temperature=0.0, min_tokens=16, max_tokens=16, logprobs=0, prompt_logprobs=-1)
    SamplingParams(top_k=1, repetition_penalty=0.5, seed=0)


def test_greedy_detection() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=5e-6).sampling_type == SamplingType.GREEDY
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0.0, seed=3).sampling_type == SamplingType.GREEDY


def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[1], temperature=0.3)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.stop_token_ids.append(2)
    assert p.stop == ["x"] and p.stop_token_ids == [1]
