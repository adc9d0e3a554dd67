"""Triton decode GEMM for 17-64 rows fed by the tensor memory accelerator (TMA): out[M, N] =
x[M, K] @ W[N, K].T (+ bias), bf16 / fp16, accumulated in float32.

Why: above 16 rows a decode projection still streams its whole weight once, but the base kernel
(triton_gemm.py) gathers its tiles by pointer, so its loads go through the registers' address
arithmetic and asynchronous copies of 16 bytes. Here W and x are read through tensor
descriptors: one bulk TMA copy per tile into shared memory, pipelined `STAGES` deep, and x's
rows past M are filled with zeros by the copy itself (no masks). On one H200 at 64 rows (scratch
probe, commit fa75ee2) it streamed the 9B's GDN in_proj (12352 x 4096) in 26.9 us against
cuBLAS's 29.7 and its MLP down (4096 x 12288) in 28.6 against 32.0; cuBLAS was level or ahead
on the others. `TritonDecodeGemm` therefore times both on each weight shape and keeps the
faster (triton_gemm.py).

Each program owns BLOCK_N output columns and walks all of K. At 64 rows the product is x tile
[64, BLOCK_K] @ W tile.T (x on the warpgroup MMA's M side); with fewer padded rows (32) the
W tile takes the M side (`SWAP`: W [BLOCK_N, BLOCK_K] @ x tile.T, the accumulator transposed),
as the warpgroup MMA needs 64 rows there.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deltaserve.ops import pdl
from deltaserve.ops.autotune import autotune
from deltaserve.ops.linear import MAX_ROWS, WIDE_MAX_ROWS, interpreting

# shared memory the pipelined W and x tiles may take (an sm_90 block gets 227 KiB)
TMA_SMEM_BYTES = 200 * 1024


def _set_block_shapes(nargs: dict) -> None:
    """A configuration's pre-launch hook: the descriptors' tile shapes follow its blocks."""
    nargs["w_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]
    nargs["x_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]


# The tuner's tiles (BLOCK_N, BLOCK_K, warps, stages): the scratch probe's fastest at 64 rows on
# the 9B's shapes, with one stage fewer where the PDL prologue's tile (held beside the pipeline's
# stages) would not fit: 128 x 128 at 4 stages asked 245,792 bytes on an H200.
TMA_TILES = (
    (128, 64, 4, 6),
    (128, 128, 4, 3),
    (128, 128, 8, 3),
    (64, 128, 4, 5),
    (64, 128, 4, 4),
    (64, 64, 4, 4),
    (64, 64, 4, 6),
    (128, 64, 4, 4),
)


@functools.cache
def tma_configs() -> list[triton.Config]:
    """The tuner's configurations: TMA_TILES, less those whose stages and the PDL prologue's
    tile need more than TMA_SMEM_BYTES at 64 rows. Under the interpreter one small one."""
    if interpreting():
        cfg = triton.Config({"BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)
        cfg.pre_hook = _set_block_shapes
        return [cfg]
    out = []
    for bn, bk, warps, stages in TMA_TILES:
        if (stages + 1) * (bn + WIDE_MAX_ROWS) * bk * 2 <= TMA_SMEM_BYTES:
            out.append(
                triton.Config(
                    {"BLOCK_N": bn, "BLOCK_K": bk},
                    num_warps=warps,
                    num_stages=stages,
                    pre_hook=_set_block_shapes,
                )
            )
    return out


@triton.jit
def _tma_step(acc, x_desc, w_desc, off_n, k, SWAP: tl.constexpr):
    """acc += one K tile's product (acc [BLOCK_N, BLOCK_M] when SWAP, else [BLOCK_M, BLOCK_N])."""
    w = w_desc.load([off_n, k])  # [BLOCK_N, BLOCK_K]
    x = x_desc.load([0, k])  # [BLOCK_M, BLOCK_K], rows past M read as zeros
    if SWAP:
        acc = tl.dot(w, x.T, acc)
    else:  # NOTE: not an early return: Triton compiles the code after a static if's return
        acc = tl.dot(x, w.T, acc)
    return acc


@autotune(configs=tma_configs(), key=["N", "K", "BLOCK_M"])
@triton.jit
def _wide_tma_kernel(
    x_desc,
    w_desc,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_om,
    HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP: tl.constexpr,
):
    off_n = tl.program_id(0) * BLOCK_N
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_first = 0
    if PDL:  # the first W tile is read while the previous kernel finishes (ops/pdl.py)
        w0 = w_desc.load([off_n, 0])
        pdl.wait(PDL)
        x0 = x_desc.load([0, 0])
        if SWAP:
            acc = tl.dot(w0, x0.T, acc)
        else:
            acc = tl.dot(x0, w0.T, acc)
        k_first = BLOCK_K
    if INTERPRET:
        # NOTE: the interpreter (with numpy >= 2.4) cannot take `range` over a runtime bound
        k0 = k_first
        while k0 < K:
            acc = _tma_step(acc, x_desc, w_desc, off_n, k0, SWAP)
            k0 += BLOCK_K
    else:
        for k0 in tl.range(k_first, K, BLOCK_K):
            acc = _tma_step(acc, x_desc, w_desc, off_n, k0, SWAP)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    if SWAP:  # acc [BLOCK_N, BLOCK_M]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
        out = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether a 2-D tensor can back a TMA descriptor: unit last stride, 16-byte aligned base
    and row stride."""
    esize = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * esize) % 16 == 0


def decode_gemm_tma(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """x [M, K] (17 <= M <= 64 in the engine; any M >= 1 up to 64 works) @ weight [N, K].T
    (+ bias [N]) -> [M, N] in x's dtype, by the TMA-fed kernel, autotuned per (N, K, rows padded
    to 32 or 64). K * element size must be a multiple of 16 bytes (ValueError otherwise); an x
    whose base or row stride is not 16-byte aligned is copied first. `config` (benchmarks):
    launch that configuration instead of the tuner's."""
    from deltaserve.ops.linear.triton_gemm import check_decode_gemm_args

    M, K, N = check_decode_gemm_args(x, weight, WIDE_MAX_ROWS)
    if (K * x.element_size()) % 16:
        raise ValueError(f"decode_gemm_tma needs K * element size to be a multiple of 16, K={K}")
    if not _tma_ready(weight):
        raise ValueError("decode_gemm_tma needs a 16-byte aligned weight with unit last stride")
    if not _tma_ready(x):
        x = x.contiguous() if x.data_ptr() % 16 == 0 else x.clone()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    block_m = max(2 * MAX_ROWS, triton.next_power_of_2(M))
    # placeholder tile shapes: each configuration's pre-launch hook sets its own
    x_desc = TensorDescriptor.from_tensor(x, [block_m, 32])
    w_desc = TensorDescriptor.from_tensor(weight, [32, 32])

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]),)

    kernel = _wide_tma_kernel
    fixed = {}
    if config is not None:
        kernel = _wide_tma_kernel.fn
        fixed = config.all_kwargs()
        fixed.pop("pre_hook", None)
        x_desc.block_shape = [block_m, config.kwargs["BLOCK_K"]]
        w_desc.block_shape = [config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]]
    kernel[grid](
        x_desc,
        w_desc,
        bias if bias is not None else weight,
        out,
        M,
        N,
        K,
        out.stride(0),
        HAS_BIAS=bias is not None,
        INTERPRET=interpreting(),
        **pdl.launch_kwargs(x),
        BLOCK_M=block_m,
        SWAP=block_m < 64,
        **fixed,
    )
    return out
