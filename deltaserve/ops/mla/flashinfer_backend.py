"""FlashInfer MLA over deltaserve's paged latent cache (flashinfer-python 0.7.2's
`BatchMLAPagedAttentionWrapper`).

Our cache holds `[c_kv | k_pe]` rows in one tensor [num_blocks, page, R + P]; FlashInfer's run
takes the compressed and rope caches as two tensors and reads their page and row strides, so
they are passed as views `cache[..., :R]` and `cache[..., R:]` (no copy). Its kernels are built
for R = 512, P = 64 (the check refuses other widths). New latents go through the Triton writer
(slot -1: skip the token).

One causal plan serves every MLA layer of a step, decode rows (q tokens each, causal at
`context_len + i`) and prefill chunks alike: the wrapper is ragged over `qo_indptr`. FlashInfer
plans on the host (it copies the index arrays to the CPU), so `plan(meta)` runs before the
forward, outside any CUDA graph; `forward` only runs the kernels.

CUDA graphs (all-decode steps of one token per row): `init_cuda_graph` allocates fixed index
buffers; `plan_graph(meta, bs)` plans the graph wrapper of padded size bs (created with
`use_cuda_graph=True` over those buffers) before its capture and before every replay.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from flashinfer.mla import BatchMLAPagedAttentionWrapper

from deltaserve.forward_context import BatchMetadata
from deltaserve.host_copy import pinned
from deltaserve.ops.attention.flashinfer_backend import PageTable, build_page_table
from deltaserve.ops.mla import MLABackend
from deltaserve.ops.mla.triton_head_matmul import TritonHeadMatmul
from deltaserve.ops.mla.triton_writer import store_latent

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (split partials)


@dataclass(frozen=True)
class MLAPlanKey:
    """What a FlashInfer MLA plan depends on besides the batch layout."""

    num_heads: int
    rank: int  # head_dim_ckv
    rope_dim: int  # head_dim_kpe
    page_size: int
    dtype: torch.dtype
    scale: float  # baked into the plan


@dataclass
class _GraphBuffers:
    qo_indptr: torch.Tensor  # [max_batch_size + 1] int32
    kv_indptr: torch.Tensor  # [max_batch_size + 1] int32
    kv_indices: torch.Tensor  # [max_batch_size * max_blocks_per_seq] int32
    kv_len: torch.Tensor  # [max_batch_size] int32
    max_batch_size: int


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class FlashInferMLABackend(TritonHeadMatmul, MLABackend):
    """Absorbed MLA through FlashInfer's MLA wrapper; plans once per step (see the module)."""

    name = "flashinfer"
    latent_writer = staticmethod(store_latent)
    supports_cuda_graph = True
    graph_query_lens = (1,)

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self.workspace_bytes = workspace_bytes
        self._workspace: torch.Tensor | None = None
        self._keys: list[MLAPlanKey] = []
        self._eager: dict[MLAPlanKey, Any] = {}
        self._graph_wrappers: dict[tuple[MLAPlanKey, int], Any] = {}
        self._graph: _GraphBuffers | None = None
        # the metadata object last planned, its padded graph size (None: eager), keys planned
        self._meta: BatchMetadata | None = None
        self._graph_batch: int | None = None
        self._planned: set[MLAPlanKey] = set()
        self._table: PageTable | None = None  # the step's page table, built once

    # ---- set-up --------------------------------------------------------------------------
    def setup(self, specs: list, block_size: int, dtype: torch.dtype) -> None:
        """Declare the model's MLA shapes. NOTE: the softmax scale is not in the spec; it is
        learned from the first forward, which replans (outside capture) if it differs."""
        for s in specs:
            self.configure(s.num_heads, s.kv_lora_rank, s.rope_dim, block_size, dtype, None)

    def configure(
        self,
        num_heads: int,
        rank: int,
        rope_dim: int,
        page_size: int,
        dtype: torch.dtype,
        scale: float | None,
    ) -> MLAPlanKey:
        """Declare a shape (and scale) up front so `plan` / `plan_graph` can plan it."""
        key = MLAPlanKey(num_heads, rank, rope_dim, page_size, dtype, float(scale or 0.0))
        if key not in self._keys:
            self._keys.append(key)
        return key

    def init_cuda_graph(
        self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device
    ) -> None:
        device = torch.device(device)

        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        self._graph = _GraphBuffers(
            zeros(max_batch_size + 1),
            zeros(max_batch_size + 1),
            zeros(max_batch_size * max_blocks_per_seq),
            zeros(max_batch_size),
            max_batch_size,
        )
        self._graph_wrappers.clear()

    def _workspace_on(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
        return self._workspace

    # ---- planning ------------------------------------------------------------------------
    def plan(self, meta: BatchMetadata) -> None:
        graph_batch = None
        if self._graph is not None and meta.num_prefills == 0 and meta.decode_query_len == 1:
            if any((key, meta.num_seqs) in self._graph_wrappers for key in self._keys):
                graph_batch = meta.num_seqs
        self._start(meta, graph_batch)

    def plan_graph(self, meta: BatchMetadata, batch_size: int) -> None:
        if self._graph is None:
            raise RuntimeError("call init_cuda_graph() before plan_graph()")
        if meta.num_prefills or meta.decode_query_len not in self.graph_query_lens:
            raise ValueError("FlashInfer MLA graphs run all-decode steps of one token per row")
        if batch_size > self._graph.max_batch_size:
            raise ValueError(f"batch {batch_size} > max_batch_size {self._graph.max_batch_size}")
        self._start(meta, batch_size)

    def _start(self, meta: BatchMetadata, graph_batch: int | None) -> None:
        self._meta, self._graph_batch, self._planned = meta, graph_batch, set()
        self._table = None
        for key in self._keys:
            if key.scale:  # shapes whose scale is known
                self._wrapper(key)

    def _wrapper(self, key: MLAPlanKey) -> Any:
        meta, bs = self._meta, self._graph_batch
        assert meta is not None
        wrapper = self._graph_wrappers.get((key, bs)) if bs is not None else self._eager.get(key)
        if key in self._planned:
            return wrapper
        if _capturing():
            raise RuntimeError(
                "FlashInfer MLA plan missing inside CUDA-graph capture: call plan_graph(meta, "
                "batch_size) (after a forward or configure() with the scale) before capturing"
            )
        device = meta.block_tables.device
        if wrapper is None:
            if bs is not None:
                g = self._graph
                wrapper = BatchMLAPagedAttentionWrapper(
                    self._workspace_on(device),
                    use_cuda_graph=True,
                    qo_indptr=g.qo_indptr[: bs + 1],
                    kv_indptr=g.kv_indptr[: bs + 1],
                    kv_indices=g.kv_indices,
                    kv_len_arr=g.kv_len[:bs],
                )
                self._graph_wrappers[(key, bs)] = wrapper
            else:
                wrapper = BatchMLAPagedAttentionWrapper(self._workspace_on(device))
                self._eager[key] = wrapper
        if self._table is None:
            self._table = build_page_table(meta, 0, meta.num_seqs, key.page_size, bs)
        table = self._table
        pad = 0 if bs is None else bs - meta.num_seqs
        kv_len = pinned(torch.tensor(meta.seq_lens_cpu + [1] * pad, dtype=torch.int32), device)
        wrapper.plan(
            table.qo_indptr,
            table.kv_indptr,
            table.kv_indices,
            kv_len,
            key.num_heads,
            key.rank,
            key.rope_dim,
            key.page_size,
            True,  # causal
            key.scale,
            key.dtype,
            key.dtype,
        )
        self._planned.add(key)
        return wrapper

    # ---- the forward ---------------------------------------------------------------------
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
        self.write_latents(c_kv, k_pe, latent_cache, meta)
        out = torch.empty_like(q_lat)
        if q_lat.shape[0] == 0:
            return out
        if self._meta is not meta:
            if _capturing():
                raise RuntimeError(
                    "FlashInfer MLA: this batch was not planned before CUDA-graph capture"
                )
            self.plan(meta)
        num_heads, r = q_lat.shape[1:]
        page = latent_cache.shape[1]
        key = MLAPlanKey(num_heads, r, q_pe.shape[-1], page, q_lat.dtype, float(scale))
        if key not in self._keys:  # replaces the spec's placeholder without a scale
            placeholder = dataclasses.replace(key, scale=0.0)
            self._keys = [k for k in self._keys if k != placeholder] + [key]
        if q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1:
            q_lat, q_pe = q_lat.contiguous(), q_pe.contiguous()
        total = meta.query_start_loc_cpu[-1] if self._graph_batch is None else q_lat.shape[0]
        ckv = latent_cache[..., :r]  # [num_blocks, page, R] view
        kpe = latent_cache[..., r:]  # [num_blocks, page, P] view
        self._wrapper(key).run(q_lat[:total], q_pe[:total], ckv, kpe, out=out[:total])
        if total < q_lat.shape[0]:  # rows no sequence owns
            out[total:].zero_()
        return out
