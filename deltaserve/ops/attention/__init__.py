"""Paged attention over the KV cache: the interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from deltaserve.forward_context import BatchMetadata


class AttentionBackend(ABC):
    """Writes a step's new keys / values into the paged cache and attends over it.

    Shapes: q [T, Hq, D], k and v [T, Hkv, D] (the step's new tokens, rotary already applied),
    k_cache and v_cache [num_blocks, block_size, Hkv, D]. Returns [T, Hq, D] in q's dtype.
    Query token i of sequence b sits at absolute position `context_lens[b] + i` and, when
    `causal`, sees cached keys 0 .. that position; otherwise all `seq_lens[b]` keys.
    Hq must be a multiple of Hkv (GQA group Hq / Hkv).
    """

    name: str = "?"
    # True when an all-decode step reads no host lists, so it can be captured in a CUDA graph
    supports_cuda_graph: bool = False

    def plan(self, meta: BatchMetadata) -> None:
        """Called by the model runner once per step, before the forward (and before each CUDA
        graph replay, with the graph's static metadata), outside graph capture. Backends that
        precompute per-step work (FlashInfer's plan) do it here; the default does nothing."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: BatchMetadata,
        scale: float,
        causal: bool = True,
    ) -> torch.Tensor: ...
