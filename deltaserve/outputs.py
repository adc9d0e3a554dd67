"""Request outputs, with vLLM's names and shapes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """Log-probability of one token, its rank in the distribution (1 = most likely), its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the sampled / actual token plus the top k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt, and what the engine emits per step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    # prompt_logprobs[0] is None (no logprob for the first token), then one dict per prompt token.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
