"""Triton MLA backend: the latent writer, the split-latent decode and the ragged prefill.

An all-decode step goes to the split decode kernel (triton_decode.py), also when its rows carry
q > 1 tokens (speculative verification: causal, each row's q x H query rows share each latent
tile). Prefill chunks go to the ragged kernel (triton_prefill.py); in a mixed step the decode
rows take the split decode kernel and the prefill rows the ragged one (the host int
`num_decodes` splits the batch; mixed steps run eagerly). All-decode steps read no
host lists (grids come from static shapes), so any all-decode step can be captured
in a CUDA graph, whatever its q.
"""

from __future__ import annotations

import torch

from deltaserve import env
from deltaserve.forward_context import BatchMetadata
from deltaserve.ops.mla import MLABackend, all_decode
from deltaserve.ops.mla.triton_decode import mla_decode
from deltaserve.ops.mla.triton_head_matmul import TritonHeadMatmul
from deltaserve.ops.mla.triton_prefill import mla_prefill
from deltaserve.ops.mla.triton_writer import store_latent

MAX_GRAPH_QUERY_LEN = 16
# Prefill-only steps with a query of at least this many tokens run expanded under
# DELTASERVE_MLA_PREFILL=auto (the layer decides; deltaserve.ops.mla.expanded). Measured on
# V2-Lite (one H200, one call, prefill of one prompt; docs/benchmarks.md "MLA prefill"):
# absorbed 19.1k / 30.8k / 40.5k / 37.1k / 29.7k / 19.8k tok/s at 256 / 512 / 1024 / 2048 /
# 4096 / 8192 tokens against expanded 9.4k / 20.1k / 37.0k / 33.4k / 54.0k / 63.0k
EXPANDED_MIN_QUERY = 4096


class TritonMLABackend(TritonHeadMatmul, MLABackend):
    """Absorbed MLA in Triton: split-latent decode (CUDA-graph safe) and ragged prefill."""

    name = "triton"
    latent_writer = staticmethod(store_latent)
    supports_cuda_graph = True
    graph_query_lens = tuple(range(1, MAX_GRAPH_QUERY_LEN + 1))
    expanded_min_query = EXPANDED_MIN_QUERY
    decodes_alone = True

    def __init__(self) -> None:
        super().__init__()
        self.fused_store = env.mla_store() == "fused"

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
        qlen, nd = meta.decode_query_len, meta.num_decodes
        if all_decode(meta):  # from seq_lens' static shape, not the host list (graph capture)
            return mla_decode(
                q_lat, q_pe, latent_cache, meta.seq_lens, meta.block_tables, scale,
                query_len=qlen, new_latents=self._decode_latents(c_kv, k_pe, latent_cache, meta),
            )  # fmt: skip
        self.write_latents(c_kv, k_pe, latent_cache, meta)
        if nd == 0:
            return mla_prefill(
                q_lat, q_pe, latent_cache, meta.query_start_loc, meta.seq_lens,
                meta.block_tables, scale,
            )  # fmt: skip
        # a mixed step (eager): the decode rows split over their latents, the prefill rows
        # (token rows nd * q ..) through the ragged kernel
        out = torch.empty_like(q_lat)
        nt, total = nd * qlen, meta.query_start_loc_cpu[-1]
        self._decode_part(q_lat, q_pe, latent_cache, meta, scale, out[:nt])
        pre = meta.prefill_part()
        mla_prefill(
            q_lat[nt:], q_pe[nt:], latent_cache, pre.query_start_loc, pre.seq_lens,
            meta.block_tables[nd:], scale, out=out[nt:],
        )  # fmt: skip
        if total < out.shape[0]:  # rows no sequence owns
            out[total:].zero_()
        return out

    def decode_rows(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        meta: BatchMetadata,
        scale: float,
    ) -> torch.Tensor:
        return self._decode_part(q_lat, q_pe, latent_cache, meta, scale)

    def _decode_part(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        meta: BatchMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The split decode over a mixed step's decode rows, the latents written (into `out`
        [nd * q, H, R] if given): `forward`'s and `decode_rows`'."""
        nd, nt = meta.num_decodes, meta.num_decode_tokens
        return mla_decode(
            q_lat[:nt], q_pe[:nt], latent_cache, meta.seq_lens[:nd], meta.block_tables[:nd],
            scale, out=out, query_len=meta.decode_query_len,
        )  # fmt: skip

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
        """All-decode steps hand W_UV to the split decode (its merge and the product may run
        as one launch); other steps `forward` then the per-head matmul."""
        if not all_decode(meta):
            return super().forward_out(q_lat, q_pe, c_kv, k_pe, latent_cache, meta, scale, w_uv)
        return mla_decode(
            q_lat, q_pe, latent_cache, meta.seq_lens, meta.block_tables, scale,
            query_len=meta.decode_query_len, w_uv=w_uv,
            new_latents=self._decode_latents(c_kv, k_pe, latent_cache, meta),
        )  # fmt: skip

    def _decode_latents(
        self,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        meta: BatchMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """An all-decode step's latents for the decode kernel to write itself
        (DELTASERVE_MLA_STORE=fused, the default, where they come in the cache's dtype, as
        they do from the layer), or None after writing them here."""
        if self.fused_store and c_kv.dtype == k_pe.dtype == latent_cache.dtype:
            return c_kv, k_pe, meta.slot_mapping
        self.write_latents(c_kv, k_pe, latent_cache, meta)
        return None
