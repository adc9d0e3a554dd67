"""Paged attention over the KV cache: the interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from deltaserve.forward_context import BatchMetadata
from deltaserve.ops.planned_backend import PlannedBackend


class AttentionBackend(PlannedBackend, ABC):
    """Writes a step's new keys / values into the paged cache and attends over it.

    Shapes: q [T, Hq, D], k and v [T, Hkv, D] (the step's new tokens, rotary already applied),
    k_cache and v_cache [num_blocks, block_size, Hkv, D]. Returns [T, Hq, D] in q's dtype.
    Query token i of sequence b sits at absolute position `context_lens[b] + i` and, when
    `causal`, sees cached keys 0 .. that position; otherwise all `seq_lens[b]` keys.
    Hq must be a multiple of Hkv (GQA group Hq / Hkv).

    Decode rows: the first `meta.num_decodes` sequences each carry `meta.decode_query_len` (q)
    tokens (rows b * q .. b * q + q - 1); q = 1 is a plain decode, q = 1 + k verifies k drafts.
    Every backend serves any q eagerly; `graph_query_lens` says which q it can run inside a
    CUDA graph.

    New K/V go through `kv_writer.write_kv`, where slot_mapping -1 means "skip this token".
    Start-up, per-step planning and CUDA-graph hooks: `PlannedBackend` (`setup` gets the
    `AttentionSpec`s, softmax scale head_dim ** -0.5).
    """

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
