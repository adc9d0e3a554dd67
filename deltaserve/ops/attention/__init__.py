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

    Decode rows: the first `meta.num_decodes` sequences each carry `meta.decode_query_len` (q)
    tokens (rows b * q .. b * q + q - 1); q = 1 is a plain decode, q = 1 + k verifies k drafts.
    Every backend serves any q eagerly; `graph_query_lens` says which q it can run inside a
    CUDA graph.

    New K/V go through `kv_writer.write_kv`, where slot_mapping -1 means "skip this token".
    """

    name: str = "?"
    # True when an all-decode step reads no host lists, so it can be captured in a CUDA graph
    supports_cuda_graph: bool = False
    # the decode query lengths q whose all-decode steps this backend can run inside a CUDA graph
    # (meaningful only with supports_cuda_graph); the runner captures (batch, q) graphs from it
    graph_query_lens: tuple[int, ...] = (1,)

    def setup(self, specs: list, block_size: int, dtype: torch.dtype) -> None:
        """Called once at start-up with the model's attention shapes (`AttentionSpec`s, softmax
        scale head_dim ** -0.5), the page size and the KV dtype. Default: nothing."""
        return None

    def init_cuda_graph(
        self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device
    ) -> None:
        """Called once before decode graphs are captured: static buffers, if any."""
        return None

    def plan_graph(self, meta: BatchMetadata, batch_size: int) -> None:
        """Plan the all-decode step `meta` padded to `batch_size` rows, before its graph is
        captured and before each replay (outside capture). Default: `plan(meta)`."""
        self.plan(meta)

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
