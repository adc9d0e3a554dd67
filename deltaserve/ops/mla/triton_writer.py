"""Triton latent writer of the `mla` family: one program per token stores `[c_kv | k_pe]`.

Slot -1 skips the token (the program returns before any store), so the cache is untouched for
it. Reads no host lists: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl


@triton.jit
def _store_latent_kernel(
    c_kv_ptr,  # [T, R]
    k_pe_ptr,  # [T, P]
    cache_ptr,  # [num_blocks, PAGE, R + P]
    slot_mapping_ptr,  # [T] int64; -1 skips the token
    stride_ct,
    stride_pt,
    stride_cb,
    stride_cs,
    R: tl.constexpr,
    P: tl.constexpr,
    R_PAD: tl.constexpr,
    P_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T,): token t's latent row into slot `slot_mapping[t]`."""
    pdl.wait(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    dst = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
    src = t.to(tl.int64)
    offs_r = tl.arange(0, R_PAD)
    offs_p = tl.arange(0, P_PAD)
    c = tl.load(c_kv_ptr + src * stride_ct + offs_r, mask=offs_r < R)
    pe = tl.load(k_pe_ptr + src * stride_pt + offs_p, mask=offs_p < P)
    tl.store(dst + offs_r, c.to(cache_ptr.dtype.element_ty), mask=offs_r < R)
    tl.store(dst + R + offs_p, pe.to(cache_ptr.dtype.element_ty), mask=offs_p < P)


def store_latent(
    c_kv: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The Triton twin of `deltaserve.ops.mla.reference.write_latent` (same contract).

    Args:
        c_kv: [T, R]; k_pe: [T, P]; rows past `slot_mapping`'s length are ignored.
        latent_cache: [num_blocks, page, R + P], unit stride in the last dim.
        slot_mapping: [T'] int64 `block * page + offset` per token (T' <= T); -1 skips it.
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, page, width = latent_cache.shape
    r, p = c_kv.shape[1], k_pe.shape[1]
    if r + p != width:
        raise ValueError(f"c_kv width {r} + k_pe width {p} != latent cache width {width}")
    assert c_kv.shape[0] >= num_tokens and k_pe.shape[0] >= num_tokens
    assert latent_cache.stride(-1) == 1
    if c_kv.stride(-1) != 1:
        c_kv = c_kv.contiguous()
    if k_pe.stride(-1) != 1:
        k_pe = k_pe.contiguous()
    _store_latent_kernel[(num_tokens,)](
        c_kv, k_pe, latent_cache, slot_mapping,
        c_kv.stride(0), k_pe.stride(0), latent_cache.stride(0), latent_cache.stride(1),
        R=r, P=p, R_PAD=triton.next_power_of_2(r), P_PAD=triton.next_power_of_2(p), PAGE=page,
        num_warps=2,
        **pdl.launch_kwargs(c_kv),
    )  # fmt: skip
