"""Triton MLA backend: the latent writer, the split-latent decode and the ragged prefill.

An all-decode step goes to the split decode kernel (triton_decode.py), also when its rows carry
q > 1 tokens (speculative verification: causal, each row's q x H query rows share each latent
tile). Prefill chunks and mixes of prefill and decode rows go to the ragged kernel
(triton_prefill.py), which serves decode rows as one-token sequences of the batch. Neither
path reads host lists (grids come from static shapes), so any all-decode step can be captured
in a CUDA graph, whatever its q.
"""

from __future__ import annotations

import torch

from deltaserve.forward_context import BatchMetadata
from deltaserve.ops.mla import MLABackend
from deltaserve.ops.mla.triton_decode import mla_decode
from deltaserve.ops.mla.triton_prefill import mla_prefill
from deltaserve.ops.mla.triton_writer import store_latent

MAX_GRAPH_QUERY_LEN = 16


class TritonMLABackend(MLABackend):
    """Absorbed MLA in Triton: split-latent decode (CUDA-graph safe) and ragged prefill."""

    name = "triton"
    supports_cuda_graph = True
    graph_query_lens = tuple(range(1, MAX_GRAPH_QUERY_LEN + 1))

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
        store_latent(c_kv, k_pe, latent_cache, meta.slot_mapping)
        num_seqs = meta.seq_lens.shape[0]  # static shape, not the host list (graph capture)
        if meta.num_decodes >= num_seqs:
            return mla_decode(
                q_lat, q_pe, latent_cache, meta.seq_lens, meta.block_tables, scale,
                query_len=meta.decode_query_len,
            )  # fmt: skip
        return mla_prefill(
            q_lat,
            q_pe,
            latent_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
        )
