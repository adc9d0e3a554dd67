"""Sampling parameters of one request, with vLLM's names, defaults and checks."""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass

# Temperatures below this are treated as greedy (argmax), as in vLLM.
SAMPLING_EPS = 1e-5


class SamplingType(enum.IntEnum):
    """How a request's next token is chosen."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to sample the completions of one request (vLLM's `SamplingParams`).

    `stop` is normalised to `list[str]` and `stop_token_ids` to `list[int]`; `max_tokens=None`
    means "up to the model's context length" and is resolved by the engine. `top_k` of 0 or -1
    disables top-k. `logprobs` is the number of top logprobs returned per generated token besides
    the sampled one; `prompt_logprobs` the same per prompt token, -1 meaning the whole vocabulary.
    A temperature below 1e-5 (0 included) means greedy decoding.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        self._verify()

    def _verify(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if self.logprobs < 0:
                raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs)
            if self.prompt_logprobs < -1:
                raise ValueError(
                    "prompt_logprobs must be non-negative, or -1 (whole vocabulary), "
                    f"got {self.prompt_logprobs}."
                )

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY below temperature 1e-5; otherwise RANDOM, or RANDOM_SEED with a seed."""
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    def clone(self) -> SamplingParams:
        """A deep copy, safe to change per request."""
        return copy.deepcopy(self)


def _check_int(name: str, value: object) -> None:
    # NOTE: bool is a subclass of int; `n=True` is a caller bug, not a count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}.")


def _normalise_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        stop = list(stop)
    else:
        raise ValueError(f"unknown stop type: stop must be a str or a list of str, got {stop!r}.")
    if any(s == "" for s in stop):
        raise ValueError(f"stop cannot contain an empty string, got {stop!r}.")
    return stop


def _normalise_stop_token_ids(stop_token_ids: object) -> list[int]:
    if stop_token_ids is None:
        return []
    if isinstance(stop_token_ids, int) and not isinstance(stop_token_ids, bool):
        return [stop_token_ids]
    if isinstance(stop_token_ids, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in stop_token_ids
    ):
        return list(stop_token_ids)
    raise ValueError(f"stop_token_ids must be a list of int, got {stop_token_ids!r}.")
