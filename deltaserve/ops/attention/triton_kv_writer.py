"""Triton kernel behind `kv_writer.write_kv`: one program per token stores its K and V rows.

Slot -1 skips the token (the program returns before any store), so the cache is untouched for
it. Reads no host lists: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl


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
    D_PAD: tl.constexpr,  # HEAD_DIM padded to a power of two
    PAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T,): token t's [Hkv, D] key and value rows into slot `slot_mapping[t]`."""
    pdl.wait(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // PAGE
    offset = slot % PAGE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    if D_PAD == HEAD_DIM:
        mask = (offs_h < NUM_HEADS)[:, None]
    else:
        mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
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
    """The Triton path of `deltaserve.ops.attention.kv_writer.write_kv` (same contract).

    Args:
        k, v: [T, Hkv, D]; rows past `slot_mapping`'s length are ignored.
        k_cache, v_cache: [num_blocks, page, Hkv, D], unit stride in D.
        slot_mapping: [T'] int64 `block * page + offset` per token (T' <= T); -1 skips it.
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, page, num_heads, head_dim = k_cache.shape
    assert k.shape[0] >= num_tokens and k.shape[1:] == (num_heads, head_dim)
    assert v.shape[0] >= num_tokens and v.shape[1:] == (num_heads, head_dim)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, H_PAD=triton.next_power_of_2(num_heads), HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), PAGE=page,
        num_warps=4 if num_heads * head_dim >= 1024 else 1,
        **pdl.launch_kwargs(k),
    )  # fmt: skip
