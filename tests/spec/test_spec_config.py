"""speculative_config: vLLM's shape, validated once with errors that name the key; the ngram
lookup; the --speculative-config flag."""

from __future__ import annotations

import argparse

import pytest

from deltaserve.engine_flags import add_engine_args, engine_kwargs
from deltaserve.spec.config import SpeculativeConfig, parse_speculative_config
from deltaserve.spec.ngram import lookup_ngram


def test_ngram_defaults_follow_vllm():
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.query_len) == (5, 5, 4)
    c = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}'
    )
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
         "prompt_lookup_max": 3}
    )  # fmt: skip
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 3)
    assert parse_speculative_config(None) is None
    assert parse_speculative_config(c) is c


def test_dflash_needs_a_drafter():
    c = parse_speculative_config({"method": "dflash", "model": "/x", "num_speculative_tokens": 15})
    assert isinstance(c, SpeculativeConfig) and c.model == "/x" and c.query_len == 16


@pytest.mark.parametrize(
    "value,match",
    [
        ([1], "must be a dict"),
        ("{oops", "not valid JSON"),
        ({"num_speculative_tokens": 2}, "needs a method"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "unknown method 'eagle'"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "more than 64"),
        ({"method": "ngram", "num_speculative_tokens": 2, "foo": 1}, "unknown key.*foo"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}, "takes no model"),
        ({"method": "dflash", "num_speculative_tokens": 2}, "needs model"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
             "prompt_lookup_max": 2},
            "prompt_lookup_min \\(4\\) must be <= prompt_lookup_max \\(2\\)",
        ),
    ],
)  # fmt: skip
def test_bad_configs_name_what_is_wrong(value, match):
    with pytest.raises(ValueError, match=match):
        parse_speculative_config(value)


def test_the_flag_reaches_the_engine_keywords():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram"}'])
    assert engine_kwargs(args)["speculative_config"] == '{"method": "ngram"}'
    assert "speculative_config" not in engine_kwargs(parser.parse_args([]))


def test_ngram_lookup():
    #            0  1  2  3  4  5  6  7
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]
    assert lookup_ngram(tokens, 1, 3, 2) == [7, 1]  # the most recent earlier "1 2 3"
    assert lookup_ngram(tokens, 1, 3, 10) == [7, 1, 2, 3]  # stops at the end
    assert lookup_ngram([4, 5, 6], 1, 3, 2) == []  # no earlier match
    assert lookup_ngram([5, 6, 5], 1, 3, 2) == [6, 5]  # n = 1
    assert lookup_ngram([5, 6, 5], 2, 3, 2) == []  # n >= 2: none
    assert lookup_ngram([7, 7, 7], 1, 2, 3) == [7]  # overlapping match
