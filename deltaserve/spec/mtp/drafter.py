"""The MTP head on the device: its paged K / V (deltaserve/spec/draft_kv.py), insertion of
exact positions, and the draft chain.

Position p of a sequence enters the MTP cache once its target hidden state h_p (after the
target's final norm) and its next token t_{p+1} are known (`insert`, a ragged batch through the
target's attention backend, like a prefill). Drafting for a row whose target computed
0 .. n - 1 and whose last token is t_n runs the chain (`chain`): step 0 at position n - 1 with
(t_n, h_{n - 1}) -> draft 1; step j at n - 1 + j with (draft j, the head's output of step
j - 1) -> draft j + 1 (deltaserve/spec/mtp/attention.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from deltaserve.cache.planner import CachePlan, allocate_caches
from deltaserve.cache.spec import AttentionSpec
from deltaserve.config import EngineConfig
from deltaserve.forward_context import BatchMetadata, ForwardContext, Kernels, LayerCache
from deltaserve.models.mtp import MTPHead
from deltaserve.spec.mtp.attention import ChainAttention


def ragged_meta(
    query_lens: list[int],
    context_lens: list[int],
    slots: torch.Tensor,
    block_tables: torch.Tensor,
) -> BatchMetadata:
    """BatchMetadata of R rows run as prefill rows: row r has `query_lens[r]` new tokens at
    positions `context_lens[r] ..` whose K / V go to `slots` [T]."""
    device = slots.device
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
    R = len(query_lens)

    def ints(values: list[int], dtype=torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return BatchMetadata(
        slot_mapping=slots,
        query_start_loc=ints(qsl),
        seq_lens=ints(seq_lens),
        context_lens=ints(context_lens),
        block_tables=block_tables,
        state_slots=torch.zeros(R, dtype=torch.long, device=device),
        has_initial_state=ints(context_lens) > 0,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        context_lens_cpu=list(context_lens),
        state_slots_cpu=[0] * R,
    )


class MTPDrafter:
    """A target's MTP head bound to the target's embedding and lm_head.

    Args:
        head: the loaded head (`target.model.mtp`).
        embed: token ids [N] -> the target's embeddings [N, H].
        compute_logits: hidden [N, H] -> the target lm_head's float32 logits [N, vocab].
        kernels: the target's kernels (attention backend for insertion, fused ops, MoE).
    """

    def __init__(
        self,
        head: MTPHead,
        embed: Callable[[torch.Tensor], torch.Tensor],
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        kernels: Kernels,
    ) -> None:
        self.head = head
        self.embed = embed
        self.compute_logits = compute_logits
        self.kernels = kernels
        self.caches: list[LayerCache] = []

    def layer_specs(self) -> list[AttentionSpec]:
        """The head's one paged K / V spec."""
        return [self.head.layer.mixer.cache_spec]

    def allocate(self, plan: CachePlan, config: EngineConfig) -> None:
        """The head's cache tensors for `plan` (planned over target + head specs)."""
        self.caches = allocate_caches(self.layer_specs(), plan, config)

    def _check_allocated(self) -> None:
        if not self.caches:
            raise RuntimeError("MTPProposer.allocate(plan, config) must run before drafting")

    @torch.inference_mode()
    def insert(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        meta: BatchMetadata,
    ) -> None:
        """Write the MTP K / V of exact positions (ragged rows, `ragged_meta`).

        Args:
            tokens: [T] t_{p+1} of each position p.
            hidden: [T, H] the target's final-normed h_p.
            positions: [T] p.
            meta: the rows' layout, slots and block tables.
        """
        self._check_allocated()
        attention = self.kernels.attention
        if attention is None:
            raise RuntimeError("the MTP head needs an attention backend (Kernels.attention)")
        attention.plan(meta)
        ctx = ForwardContext(meta=meta, caches=self.caches, kernels=self.kernels)
        self.head(self.embed(tokens), hidden, positions, ctx)

    @torch.inference_mode()
    def chain(
        self,
        last_tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        num_drafts: int,
        meta: BatchMetadata | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafts of R rows: (tokens [R, k] int64, logits [R, k, vocab] float32).

        Args:
            last_tokens: [R] t_n, each row's last (accepted) token.
            hidden: [R, H] h_{n - 1}, the target's final-normed hidden state before it.
            positions: [R] n - 1 (the MTP cache holds 0 .. n - 2 of each row).
            slots: [R] the cache slot of position n - 1 (step 0's K / V are written there;
                -1: nowhere, e.g. a graph's padding row).
            block_tables: [R, nb] the rows' blocks (covering n - 1).
            num_drafts: k >= 1.
            meta: the layout the layers see (the chain's attention ignores it); None: built
                here (a host sync). Given, the chain reads only device tensors with fixed
                shapes: CUDA-graph safe (spec/mtp/graphs.py).
        """
        self._check_allocated()
        if num_drafts < 1:
            raise ValueError(f"num_drafts must be >= 1, got {num_drafts}")
        if meta is None:
            meta = ragged_meta([1] * len(slots), positions.tolist(), slots, block_tables)
        attention = ChainAttention(block_tables, positions, slots)
        kernels = dataclasses.replace(self.kernels, attention=attention)
        tokens, logits = [], []
        tok, h = last_tokens, hidden
        for j in range(num_drafts):
            ctx = ForwardContext(meta=meta, caches=self.caches, kernels=kernels)
            h = self.head(self.embed(tok), h, positions + j, ctx)  # [R, H]
            step_logits = self.compute_logits(h)  # [R, vocab] float32
            tok = step_logits.argmax(dim=-1)
            tokens.append(tok)
            logits.append(step_logits)
        return torch.stack(tokens, 1), torch.stack(logits, 1)
