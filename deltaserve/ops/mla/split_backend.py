"""The `split` MLA backend: steps that carry prefill rows through FlashInfer's MLA, all-decode
steps (and so every decode CUDA graph) through the Triton split-latent decode.

Why: on one H200 with DeepSeek-V2-Lite (16 heads) FlashInfer's MLA prefill runs 8192 tokens at
2.6x the Triton prefill's rate, while decode at batch 1 ran 333.5 tok/s with FlashInfer's MLA
against 410.0 with the Triton one; with this backend, 51,351 tok/s at prefill 8192 and 405.8
at decode batch 1 (one call, docs/benchmarks.md). Both read the same paged `[c_kv | k_pe]`
cache through the same Triton latent writer, so a step can go to either.

Which half serves a step depends only on its kind, never on its tokens: a step whose
sequences are all decodes (`meta.num_decodes` covers the batch, any decode query length) goes
to the decode half, every other step (prefill only, or mixed) to the prefill half, whole. The
decode graphs are the decode half's: `init_cuda_graph` and `plan_graph` go to it alone, and
`plan` goes to the half that will run the step.

Prefill rows of long queries skip both halves: the layer expands them (deltaserve.ops.mla.
expanded) when the step's longest prefill query has at least `expanded_min_query` tokens, and
a mixed step's decode rows then go to the decode half's `decode_rows`. Measured on V2-Lite
(one H200, prefill of one prompt; docs/benchmarks.md "MLA prefill"): in one call FlashInfer's
prefill took 34.6k / 53.6k / 50.2k tok/s at 2048 / 4096 / 8192 tokens against the expanded
form's 30.8k (absorbed there) / 47.5k / 64.5k; in another, FlashInfer's 56.2k at 6144 tokens,
and the expanded form 63.9k at 6144 in a third (1.14x, more than the few percent calls differ
by). So this backend expands from 6144: below the default token budget of 8192, so that the
chunks of a long prompt that share a step with running decodes (8192 minus their rows) expand
too.

The `mla` family's auto choice wherever both halves serve at <= 32 heads per rank
(deltaserve.backends).
"""

from __future__ import annotations

import torch

from deltaserve.forward_context import BatchMetadata
from deltaserve.ops.mla import MLABackend, all_decode
from deltaserve.ops.mla.triton_head_matmul import TritonHeadMatmul
from deltaserve.ops.mla.triton_writer import store_latent

# the query length from which the layer expands a step's prefill rows under
# DELTASERVE_MLA_PREFILL=auto instead of running FlashInfer's prefill (module docstring)
SPLIT_EXPANDED_MIN_QUERY = 6144


class SplitMLABackend(TritonHeadMatmul, MLABackend):
    """Prefill-carrying steps through `prefill` (default FlashInfer's MLA), all-decode steps
    through `decode` (default the Triton MLA); see the module docstring."""

    name = "split"
    latent_writer = staticmethod(store_latent)
    expanded_min_query = SPLIT_EXPANDED_MIN_QUERY

    def __init__(self, prefill: MLABackend | None = None, decode: MLABackend | None = None):
        if prefill is None:
            from deltaserve.ops.mla.flashinfer_backend import FlashInferMLABackend

            prefill = FlashInferMLABackend()
        if decode is None:
            from deltaserve.ops.mla.triton_backend import TritonMLABackend

            decode = TritonMLABackend()
        self.prefill, self.decode = prefill, decode
        self.supports_cuda_graph = decode.supports_cuda_graph
        self.graph_query_lens = decode.graph_query_lens
        self.decodes_alone = decode.decodes_alone

    def half(self, meta: BatchMetadata) -> MLABackend:
        """The backend that runs the step `meta`."""
        return self.decode if all_decode(meta) else self.prefill

    def setup(self, specs: list, block_size: int, dtype: torch.dtype) -> None:
        self.prefill.setup(specs, block_size, dtype)
        self.decode.setup(specs, block_size, dtype)

    def init_cuda_graph(
        self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device
    ) -> None:
        self.decode.init_cuda_graph(max_batch_size, max_blocks_per_seq, device)

    def plan_graph(self, meta: BatchMetadata, batch_size: int) -> None:
        self.decode.plan_graph(meta, batch_size)

    def plan(self, meta: BatchMetadata) -> None:
        self.half(meta).plan(meta)

    def forward(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        meta: BatchMetadata,
        scale: float,
    ) -> torch.Tensor:
        return self.half(meta).forward(q_lat, q_pe, c_kv, k_pe, latent_cache, meta, scale)

    def decode_rows(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        meta: BatchMetadata,
        scale: float,
    ) -> torch.Tensor:
        """A mixed step's decode rows (beside expanded prefill rows): the decode half's."""
        return self.decode.decode_rows(q_lat, q_pe, latent_cache, meta, scale)

    def forward_out(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        meta: BatchMetadata,
        scale: float,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        return self.half(meta).forward_out(q_lat, q_pe, c_kv, k_pe, latent_cache, meta, scale, w_uv)
