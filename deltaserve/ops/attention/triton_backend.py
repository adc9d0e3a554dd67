"""Triton paged-attention backend: a cache-store kernel, split-KV decode and ragged prefill.

An all-decode step (every sequence has one new token) goes to the split-KV decode kernel, which
reads only device tensors and static shapes, so it can be captured in a CUDA graph. Any other
batch (prefill chunks, possibly mixed with decodes) goes to the prefill kernel, whose grid uses
the step's token count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.forward_context import BatchMetadata
from deltaserve.ops.attention import AttentionBackend
from deltaserve.ops.attention.triton_decode import paged_decode
from deltaserve.ops.attention.triton_prefill import paged_prefill


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    v_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    slot_mapping_ptr,  # [T] int64; -1 skips the token
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // PAGE
    offset = slot % PAGE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < NUM_HEADS)[:, None]
    src = t.to(tl.int64)
    k = tl.load(k_ptr + src * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + src * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kct
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vct
    k_dst = k_dst + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = v_dst + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the step's new keys / values into the paged cache, in place (no host sync).

    Args:
        k, v: [T, Hkv, D]; rows past `slot_mapping`'s length are ignored.
        k_cache, v_cache: [num_blocks, page, Hkv, D].
        slot_mapping: [T'] int64 `block * page + offset` per token (T' <= T); -1 skips it.
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, page, num_heads, head_dim = k_cache.shape
    assert k.shape[0] >= num_tokens and k.shape[1:] == (num_heads, head_dim)
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, H_PAD=triton.next_power_of_2(num_heads), HEAD_DIM=head_dim,
        PAGE=page, num_warps=4 if num_heads * head_dim >= 1024 else 1,
    )  # fmt: skip


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton: split-KV decode (CUDA-graph safe) and ragged prefill."""

    name = "triton"
    supports_cuda_graph = True

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
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_seqs = meta.seq_lens.shape[0]  # static shape, not the host list (graph capture)
        if meta.num_decodes >= num_seqs:
            # NOTE: one query at the last position sees every key whether causal or not, so
            # non-causal all-decode steps take this path too. It reads no host lists.
            return paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale)
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
