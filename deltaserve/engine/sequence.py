"""One sequence of a request: its tokens, progress, cache blocks, state slot and outputs."""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING, Any

from deltaserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from deltaserve.outputs import PositionLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_counter = itertools.count()


class Sequence:
    """A prompt plus the tokens generated so far for one of a request's `n` completions.

    `num_computed_tokens` counts tokens whose KV / recurrent state is in the caches; each step
    the scheduler advances it toward `num_tokens` (docs/architecture.md, "One step").
    """

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        generator: torch.Generator | None = None,
        detokenizer: Any = None,
    ) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index
        self.prompt = prompt
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        # the last num_draft_tokens of token_ids are speculative drafts, to be verified by the
        # next step that computes them (rejected ones are rolled back by Scheduler.advance)
        self.num_draft_tokens = 0
        # [num_draft_tokens, vocab] the draft distributions the drafts were sampled from, or
        # None (deterministic drafts); read by speculative sampling (engine/logits.py)
        self.draft_probs: torch.Tensor | None = None
        # tokens sampled on the device by an overlapped step whose values the host has not read
        # yet (engine/async_step.py): they follow token_ids and count in num_tokens
        self.num_pending_tokens = 0
        self.status = SequenceStatus.WAITING
        self.block_ids: list[int] = []
        self.host_block_table: Any = None  # the model runner's host copy (engine/host_tables.py)
        self.state_slot = 0  # 0 = none (the null slot)
        self.generator = generator
        self.detokenizer = detokenizer
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        wants_prompt_lp = params.prompt_logprobs is not None and index == 0
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if wants_prompt_lp else None
        )
        self.num_preemptions = 0
        # images of the prompt (deltaserve.multimodal.inputs.MultiModalRecord), or None
        self.mm: Any = None

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, including those still pending on the device."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens the host knows (pending ones are not included)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, including those still pending on the device."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}/{self.index}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )
