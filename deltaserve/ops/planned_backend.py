"""What the paged-cache kernel families share: the start-up, per-step planning and CUDA-graph
hooks of an attention backend (deltaserve.ops.attention) and an MLA backend (deltaserve.ops.mla).
The model instance calls them on every such backend the model has
(`ModelInstance.planned_backends`)."""

from __future__ import annotations

import torch

from deltaserve.forward_context import BatchMetadata


class PlannedBackend:
    """The lifecycle hooks; the defaults do nothing (a backend without per-step plans)."""

    name: str = "?"
    # True when an all-decode step reads no host lists, so it can be captured in a CUDA graph
    supports_cuda_graph: bool = False
    # the decode query lengths q whose all-decode steps this backend can run inside a CUDA graph
    # (meaningful only with supports_cuda_graph); the runner captures (batch, q) graphs from it
    graph_query_lens: tuple[int, ...] = (1,)

    def setup(self, specs: list, block_size: int, dtype: torch.dtype) -> None:
        """Called once at start-up with the specs of the layers this backend serves
        (`AttentionSpec`s or `MLASpec`s), the page size and the cache dtype."""
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
