"""Triton paged-attention backend: the shared KV writer, split-KV decode and ragged prefill.

An all-decode step goes to the split-KV decode kernel, also when its rows carry q > 1 tokens
(speculative verification: causal, query token i of row b at position `context_lens[b] + i`
sees keys 0 .. that position; its q x group query rows share each K / V tile read). Prefill
chunks, mixes of prefill and decode rows, and non-causal multi-token rows go to the ragged
prefill kernel, which handles a cached context under causal masking. Neither path reads host
lists (grids come from static shapes), so any all-decode step can be captured in a CUDA graph,
whatever its q.
"""

from __future__ import annotations

import torch

from deltaserve.forward_context import BatchMetadata
from deltaserve.ops.attention import AttentionBackend
from deltaserve.ops.attention.kv_writer import write_kv
from deltaserve.ops.attention.triton_decode import paged_decode
from deltaserve.ops.attention.triton_prefill import paged_prefill

MAX_GRAPH_QUERY_LEN = 16
MAX_DECODE_QLEN = 16  # longer all-decode rows take the prefill kernel (q x group rows per tile)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton: split-KV decode (CUDA-graph safe) and ragged prefill."""

    name = "triton"
    supports_cuda_graph = True
    # the prefill kernel serves decode rows of q > 1 from device tensors only
    graph_query_lens = tuple(range(1, MAX_GRAPH_QUERY_LEN + 1))

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
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, impl="triton")
        num_seqs = meta.seq_lens.shape[0]  # static shape, not the host list (graph capture)
        qlen = meta.decode_query_len
        if meta.num_decodes >= num_seqs and (qlen == 1 or (causal and qlen <= MAX_DECODE_QLEN)):
            # NOTE: one query at the last position sees every key whether causal or not, so
            # non-causal one-token steps take this path too. It reads no host lists.
            return paged_decode(
                q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale, query_len=qlen
            )
        return paged_prefill(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            causal,
        )
