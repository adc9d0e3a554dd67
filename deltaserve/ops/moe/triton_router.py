"""DeepSeek-V2's float32 router logits in one Triton launch: x [T, H] (any float dtype) and the
router weight W [E, H] float32 -> x.float() @ W.T [T, E] float32.

HF computes `F.linear(x.float(), W.float())`; in torch that is two launches on the GPU (x's
upcast, then cuBLAS's float32 GEMV, itself a dot and a reduce kernel at one row) in every MoE
layer of every decode step. Here each program takes BLOCK_E experts' rows of W and BLOCK_T
tokens, upcasts x as it loads it and sums the products in float32 (CUDA-core FMAs: no TF32),
so the logits equal torch's up to float32 summation order. Launched with programmatic
dependent launch (ops/pdl.py): W streams in before the previous kernel finishes.

Served for ROUTER_TRITON_MAX_ROWS = 1 token only (a decode step at batch 1; `router_logits`
sends larger calls to torch). At up to 64 tokens it cost time: `bench throughput
--random-model deepseek-v2-lite`, decode batch 64 with the torch alignment, went from 5,153.6
tok/s without it (04e45fb) to 4,677.7 with it (fa513b7), two H200s measuring 4.22-4.23 TB/s;
its tiles of 16 tokens x 4 experts reduce a [16, 4, BLOCK_H] product across lanes each step.
The single-token form is a plain GEMV (one [1, 2, H] product a program, 32 programs at 64
experts); its gain at batch 1 has not been measured on its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl

ROUTER_TRITON_MAX_ROWS = 1


@triton.jit
def _router_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, H] float32
    out_ptr,  # [T, E] float32
    T,
    E,
    stride_xt,
    stride_we,
    H: tl.constexpr,  # hidden size (one compile per model)
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    e_mask = offs_e < E
    t_mask = offs_t < T
    w_rows = w_ptr + offs_e.to(tl.int64)[:, None] * stride_we  # [BLOCK_E, 1]
    x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_xt  # [BLOCK_T, 1]
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    offs_h = tl.arange(0, BLOCK_H)
    # the first weight tile before the wait (weights only: see ops/pdl.py)
    w = tl.load(w_rows + offs_h[None, :], mask=e_mask[:, None] & (offs_h < H)[None, :], other=0.0)
    pdl.wait(PDL)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + offs_h
        x = tl.load(x_rows + h[None, :], mask=t_mask[:, None] & (h < H)[None, :], other=0.0)
        prod = x.to(tl.float32)[:, None, :] * w[None, :, :]  # [BLOCK_T, BLOCK_E, BLOCK_H]
        acc += tl.sum(prod, axis=2)
        h = h + BLOCK_H  # the next weight tile (none past H)
        w = tl.load(w_rows + h[None, :], mask=e_mask[:, None] & (h < H)[None, :], other=0.0)
    out = out_ptr + offs_t.to(tl.int64)[:, None] * E + offs_e[None, :]
    tl.store(out, acc, mask=t_mask[:, None] & e_mask[None, :])


def router_logits_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H] (unit last stride), weight [E, H] float32 contiguous -> [T, E] float32, in one
    launch (CUDA, or CPU tensors under the interpreter)."""
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    if weight.dtype != torch.float32 or weight.shape[1] != hidden or weight.stride(-1) != 1:
        raise ValueError(
            f"router weight must be [E, H={hidden}] float32 with a unit last stride, got "
            f"{tuple(weight.shape)} {weight.dtype}"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    block_t = min(16, triton.next_power_of_2(num_tokens))
    # [BLOCK_T, BLOCK_E, BLOCK_H] products a step: about 8 K, fewer experts a program at one
    # token (more programs streaming W)
    block_e = 2 if block_t == 1 else 4
    block_h = max(64, 4096 // (block_t * block_e))
    grid = (triton.cdiv(num_experts, block_e), triton.cdiv(num_tokens, block_t))
    _router_kernel[grid](
        x, weight, out, num_tokens, num_experts, x.stride(0), weight.stride(0), H=hidden,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_H=block_h, num_warps=4,
        **pdl.launch_kwargs(x),
    )  # fmt: skip
    return out
