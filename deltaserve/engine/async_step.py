"""Overlapped decode ("async scheduling"): the host prepares step k+1 while the GPU runs step k.

In a pure decode step the host work between two forwards (scheduling, batch preparation,
sampling set-up, detokenizing and stop checks) leaves the GPU idle unless it overlaps the
forward. With overlap on, `LLMEngine.step()`

  1. schedules step k, whose input tokens (sampled by step k-1) are still on the device: each
     sequence counts its newest token as pending (`Sequence.num_pending_tokens`), and the step
     stages a `PLACEHOLDER` id for it;
  2. launches step k's forward and sampling (`ModelRunner.execute_async`): the placeholders are
     replaced on the device by step k-1's sampled ids, and the new ids are copied to pinned host
     memory behind an event;
  3. waits for step k-1's ids (done by now: the GPU is running step k), appends them in place of
     the pending counts, checks stops and builds the outputs;
  4. advances step k's sequences and counts the token step k samples as pending.

A sequence that step k-1 finished still ran in step k: that row's result is dropped, and its
blocks and state slot, freed in 3, are reused only by work queued after step k.

Only steps that need nothing from the host's copy of the newest tokens overlap: every running
sequence decoding, nothing waiting, no penalties (they read the token history), no logprobs,
no sequence about to end by length. Any other step first drains the step in flight and runs
synchronously.

Under tensor parallelism rank 0 sends each overlapped step's description to the other ranks
before launching it, and broadcasts its sampled ids on the device group right after sampling
(stream-ordered: no host wait); the other ranks take the next step's pending tokens from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.engine.sampler import has_penalties
from deltaserve.engine.sequence import Sequence
from deltaserve.engine.step_prep import PLACEHOLDER

__all__ = ["PLACEHOLDER", "AsyncStep", "SampledIdBuffers", "can_overlap"]


@dataclass
class AsyncStep:
    """A launched decode step whose sampled ids have not been read on the host yet."""

    seqs: list[Sequence]  # row i of the sampled ids belongs to seqs[i]
    device_ids: torch.Tensor  # [B] int64 on the device: the next step's input tokens
    host_ids: torch.Tensor  # [B] int64, pinned on CUDA: filled by an asynchronous copy
    event: torch.cuda.Event | None  # recorded after the copy (None on CPU)

    def row_of(self) -> dict[int, int]:
        """seq_id -> row of the sampled ids."""
        return {seq.seq_id: i for i, seq in enumerate(self.seqs)}

    def token_ids(self) -> list[int]:
        """The sampled ids on the host (waits for this step's copy, not for later work)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host_ids.tolist()


class SampledIdBuffers:
    """Two alternating host buffers (pinned on CUDA) for the sampled ids: step k writes one
    while the engine still reads step k - 1's from the other."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size = size
        self.pin = device.type == "cuda"
        self.buffers: list[torch.Tensor] = []  # allocated on first use
        self.turn = 0

    def next(self, n: int) -> torch.Tensor:
        """The next buffer's first n entries (n <= size: a batch holds at most max_num_seqs)."""
        if not self.buffers:
            self.buffers = [
                torch.empty(self.size, dtype=torch.int64, pin_memory=self.pin) for _ in range(2)
            ]
        self.turn ^= 1
        return self.buffers[self.turn][:n]


def can_overlap(seq: Sequence, max_model_len: int) -> bool:
    """Whether `seq` can take part in an overlapped decode step (see the module docstring)."""
    p = seq.params
    return (
        seq.num_computed_tokens > 0
        and seq.num_draft_tokens == 0
        and seq.num_tokens - seq.num_computed_tokens == 1
        and p.logprobs is None
        and seq.prompt_logprobs is None
        and not has_penalties(p)
        and seq.num_output_tokens < p.max_tokens
        and seq.num_tokens < max_model_len
        # an image prompt's tokens may need vision embeddings: only its decode overlaps
        and (seq.mm is None or seq.num_computed_tokens >= seq.num_prompt_tokens)
    )
