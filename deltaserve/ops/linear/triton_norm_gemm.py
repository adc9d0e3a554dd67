"""Residual add + RMSNorm fused into the decode GEMM's prologue: `out = rms_norm(x + residual) @
W.T (+ bias)` in one launch, M <= 16, bf16 / fp16. NOT wired into the engine yet: a standalone
op for `deltaserve bench kernels --only gemm` (impls `triton-norm` against `norm+triton`) to time
against the two kernels it replaces.

Why: at decode batch 1 a Qwen3.5 step is ~420 dependent kernels, and every decoder layer runs a
standalone residual-add + RMSNorm kernel (ops/fused/rmsnorm.py, from `add_norm` in
layers/decoder.py) right before a decode GEMM that is the norm output's only reader (GDN
in_proj, attention qkv, MLP gate_up; not the MoE block, whose norm output also feeds the
experts). Folding the norm into that GEMM removes ~64 launches per step.

Each program owns BLOCK_N output columns (rows of W), as in the base decode GEMM
(triton_gemm.py). After the PDL wait it walks x and residual once, in the rms_norm kernel's own
row tiles ([NORM_R, NORM_N] = `row_tile(M, K)`, at rms_norm's warp count: the same float32
reduction tree, so the same rstd bit for bit), then walks K in BLOCK_K steps forming the
normalised, dtype-rounded activation tile on the fly (rms_norm's math, in its order) and feeding
it to the tensor-core `tl.dot` with the W tile (the base kernel's accumulation). Every program
reads all of x and residual twice (32 KB per program at batch 1 and a hidden size of 4096, from
L2; 16 times that at 16 rows, where the bench may well find the two kernels faster). The
updated residual (x + residual in x's dtype, in place, as
rms_norm writes it) is written by ONE program: the last to finish reading (an atomic arrival
counter, deltaserve.ops.tile_counters), since any program writing it earlier would race the
others' reads.

The warp count is fixed by K and M (rms_norm's `row_tile`; 4 warps at a hidden size of 2048, 8 at
4096, 16 above), and BLOCK_N, BLOCK_K and the pipeline depth are autotuned per (N, K) at that
warp count; under the interpreter one small configuration runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.autotune import autotune
from deltaserve.ops.fused._common import row_tile
from deltaserve.ops.linear import MAX_ROWS, interpreting
from deltaserve.ops.tile_counters import arrival_counters

DTYPES = (torch.bfloat16, torch.float16)


# (BLOCK_N, BLOCK_K, num_stages) tuned at each warp count: those that compile without register
# spills at 16 rows for sm_90 (tests/ops/test_triton_norm_gemm.py; every warp holds the whole
# normalised [16, BLOCK_K] tile as a dot operand, so BLOCK_K stays small). 1 and 2 warps serve
# only K < 1024.
_TILES = {
    1: ((16, 64, 2), (16, 128, 2), (32, 64, 2)),
    2: ((16, 64, 3), (16, 128, 3), (32, 128, 2)),
    4: ((16, 128, 6), (32, 128, 6), (64, 64, 8), (64, 128, 4), (128, 64, 6)),
    8: ((16, 128, 6), (64, 64, 8), (128, 64, 6), (16, 256, 4), (32, 256, 4)),
    16: ((16, 128, 6), (32, 128, 4), (32, 128, 6), (64, 128, 4), (128, 128, 3)),
}


def _configs() -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)
        for warps, tiles in _TILES.items()
        for bn, bk, stages in tiles
    ]


def _at_norm_warps(configs: list, named_args: dict, **kwargs) -> list:
    """The configurations at rms_norm's warp count for this launch (NORM_WARPS)."""
    return [c for c in configs if c.num_warps == kwargs["NORM_WARPS"]]


@triton.jit
def _rstd_tile(x_ptr, res_ptr, rows, M, K, stride_xm, stride_rm, eps, NORM_N: tl.constexpr):
    """rstd [NORM_R] of x + residual's rows `rows`, as `_rms_norm_kernel` computes it (the
    sum in x's dtype, then float32 squares summed over one [NORM_R, NORM_N] tile)."""
    cols = tl.arange(0, NORM_N)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    dtype = x_ptr.dtype.element_ty
    x = tl.load(
        x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0
    )
    r = tl.load(
        res_ptr + rows[:, None].to(tl.int64) * stride_rm + cols[None, :], mask=mask, other=0.0
    )
    x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # the unfused add, in x's dtype
    xf = x.to(tl.float32)
    return tl.rsqrt(tl.sum(xf * xf, axis=1) / K + eps)


@triton.jit
def _norm_tile(x_rows, r_rows, nw_ptr, k, K, m_mask, rstd, ZERO_CENTERED: tl.constexpr):
    """h [16, BLOCK_K] = rms_norm(x + residual)[:, k] in x's dtype (zeros past M and K), by
    `_rms_norm_kernel`'s elementwise math (rstd [16] given)."""
    k_mask = k < K
    mask = m_mask[:, None] & k_mask[None, :]
    x = tl.load(x_rows + k[None, :], mask=mask, other=0.0)
    r = tl.load(r_rows + k[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    xf = (x.to(tl.float32) + r.to(tl.float32)).to(dtype).to(tl.float32)
    w = tl.load(nw_ptr + k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
    xn = xf * rstd[:, None]
    if ZERO_CENTERED:
        y = xn * (1.0 + w)
    else:
        y = w * xn.to(dtype).to(tl.float32)
    return y.to(dtype)


@autotune(
    configs=_configs(),
    key=["N", "K", "NORM_R", "NORM_WARPS"],
    prune=_at_norm_warps,
    restore_value=["res_ptr"],
)
@triton.jit(do_not_specialize=["norm_groups"])
def _add_rms_norm_gemm_kernel(
    x_ptr,  # [M, K]
    res_ptr,  # [M, K], overwritten with x + residual by the last program
    nw_ptr,  # [K] the norm's weight
    w_ptr,  # [N, K]
    b_ptr,  # [N]
    out_ptr,  # [M, N]
    cnt_ptr,  # int32 [1] arrival counter, 0 between calls
    M,
    N,
    K,
    stride_xm,
    stride_rm,
    stride_wn,
    stride_om,
    eps,
    norm_groups,  # cdiv(M, NORM_R)
    HAS_BIAS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
    NORM_R: tl.constexpr,
    NORM_N: tl.constexpr,
    NORM_WARPS: tl.constexpr,  # the autotuning key's; the launch runs at this warp count
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N),)."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, 16)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    r_rows = res_ptr + offs_m[:, None].to(tl.int64) * stride_rm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    if PDL:  # the first W tile is loaded while the previous kernel finishes (ops/pdl.py)
        w0_mask = n_mask[:, None] & (offs_k < K)[None, :]
        w0 = tl.load(w_rows + offs_k[None, :], mask=w0_mask, other=0.0)
    pdl.wait(PDL)
    # pass 1: each row's rstd, in rms_norm's row tiles (tile g: rows g * NORM_R + [0, NORM_R),
    # as its program g), placed in a [16] vector (by adding exact zeros)
    # NOTE: `norm_groups` is not specialised (not even a 1): the compiler must know no more of
    # g than rms_norm's kernel knows of its program id, or it may vectorise the tile's loads
    # differently, and the reduction's order follows the load layout
    rstd = tl.zeros((16,), dtype=tl.float32)
    if INTERPRET:
        # NOTE: the interpreter (with numpy >= 2.4) cannot take `range` over a runtime bound
        g = 0
        while g < norm_groups:
            rows = g * NORM_R + tl.arange(0, NORM_R)
            part = _rstd_tile(x_ptr, res_ptr, rows, M, K, stride_xm, stride_rm, eps, NORM_N)
            sel = offs_m[:, None] == rows[None, :]  # [16, NORM_R]
            rstd += tl.sum(tl.where(sel, part[None, :], 0.0), axis=1)
            g += 1
    else:
        for g in tl.range(0, norm_groups):
            rows = g * NORM_R + tl.arange(0, NORM_R)
            part = _rstd_tile(x_ptr, res_ptr, rows, M, K, stride_xm, stride_rm, eps, NORM_N)
            sel = offs_m[:, None] == rows[None, :]  # [16, NORM_R]
            rstd += tl.sum(tl.where(sel, part[None, :], 0.0), axis=1)
    # pass 2: out = h @ W.T over K, h formed per tile (the base kernel's accumulation)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    k_first = 0
    if PDL:
        h0 = _norm_tile(x_rows, r_rows, nw_ptr, offs_k, K, m_mask, rstd, ZERO_CENTERED)
        acc = tl.dot(h0, tl.trans(w0), acc)
        k_first = BLOCK_K
    if INTERPRET:
        k0 = k_first
        while k0 < K:
            k = k0 + offs_k
            h = _norm_tile(x_rows, r_rows, nw_ptr, k, K, m_mask, rstd, ZERO_CENTERED)
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0)
            acc = acc + tl.dot(h, tl.trans(w))
            k0 += BLOCK_K
    else:
        for k0 in tl.range(k_first, K, BLOCK_K):
            k = k0 + offs_k
            h = _norm_tile(x_rows, r_rows, nw_ptr, k, K, m_mask, rstd, ZERO_CENTERED)
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0)
            acc = acc + tl.dot(h, tl.trans(w))
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += bias[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
    # NOTE: residual is written only once every program has read it: the last to arrive writes
    # it (every thread's reads done before the single-thread release below)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        k0 = 0
        while k0 < K:
            k = k0 + offs_k
            mask = m_mask[:, None] & (k < K)[None, :]
            x = tl.load(x_rows + k[None, :], mask=mask, other=0.0)
            r = tl.load(r_rows + k[None, :], mask=mask, other=0.0)
            tl.store(
                r_rows + k[None, :], (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype), mask=mask
            )
            k0 += BLOCK_K
        tl.atomic_xchg(cnt_ptr, 0)  # ready for the next call


def _check_args(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> None:
    """ValueError naming the argument that is wrong."""
    if x.dim() != 2 or x.dtype not in DTYPES or x.stride(-1) != 1:
        raise ValueError(
            f"x must be [M, K] bf16 / fp16 with a unit last stride, got {tuple(x.shape)} "
            f"{x.dtype} strides {x.stride()}"
        )
    M, K = x.shape
    if M > MAX_ROWS:
        raise ValueError(f"x: add_rms_norm_gemm serves at most {MAX_ROWS} rows, got {M}")
    tensors = dict(residual=residual, norm_weight=norm_weight, weight=weight, bias=bias)
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
        raise ValueError(
            f"residual must be x's shape {tuple(x.shape)} and dtype {x.dtype} with a unit last "
            f"stride, got {tuple(residual.shape)} {residual.dtype} strides {residual.stride()}"
        )
    if norm_weight.shape != (K,) or norm_weight.stride(0) != 1:
        raise ValueError(f"norm_weight must be a contiguous [{K}], got {tuple(norm_weight.shape)}")
    if norm_weight.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"norm_weight must be {x.dtype} or float32, got {norm_weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] != K or weight.stride(-1) != 1:
        raise ValueError(
            f"weight must be [N, {K}] with a unit last stride, got {tuple(weight.shape)} "
            f"strides {weight.stride()}"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"weight must be x's dtype {x.dtype}, got {weight.dtype}")
    N = weight.shape[0]
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype or bias.stride(0) != 1):
        raise ValueError(
            f"bias must be a contiguous [{N}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}"
        )


def add_rms_norm_gemm(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    zero_centered: bool = False,
) -> torch.Tensor:
    """rms_norm(x + residual) @ weight.T (+ bias) in one launch; `residual` updated in place.

    x: [M, K], M <= 16, bf16 / fp16, unit last stride.
    residual: [M, K] in x's dtype, unit last stride (e.g. a column slice); overwritten with
        r = x + residual rounded to x's dtype, as `rms_norm(..., residual=residual)` does.
    norm_weight: [K] contiguous, x's dtype or float32; h = norm(r) * w, or norm(r) * (1 + w)
        when `zero_centered`, rounded to x's dtype (rms_norm's math).
    weight: [N, K] in x's dtype, unit last stride; bias: optional [N] in x's dtype.
    Returns out [M, N] in x's dtype: h @ weight.T (+ bias), accumulated in float32 as the base
    decode GEMM (triton_gemm.decode_gemm_base) accumulates it.
    """
    _check_args(x, residual, norm_weight, weight, bias)
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    # the rows per tile, padded row and warp count rms_norm uses: the fused kernel reduces in these
    norm_r, norm_n, norm_warps = row_tile(M, K)
    counter = arrival_counters("norm_gemm", weight, 1)

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]),)

    _add_rms_norm_gemm_kernel[grid](
        x, residual, norm_weight, weight, bias if bias is not None else weight, out, counter,
        M, N, K, x.stride(0), residual.stride(0), weight.stride(0), out.stride(0), eps,
        triton.cdiv(M, norm_r),
        HAS_BIAS=bias is not None, ZERO_CENTERED=zero_centered, INTERPRET=interpreting(),
        NORM_R=norm_r, NORM_N=norm_n, NORM_WARPS=norm_warps, **pdl.launch_kwargs(x),
    )  # fmt: skip
    return out


def add_rms_norm_gemm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The math of `add_rms_norm_gemm` in float32 torch with its roundings to x's dtype (r,
    the plain form's normalised row, h, out) -> (out [M, N], r [M, K]); changes nothing in
    place."""
    dtype = x.dtype
    r = (x.float() + residual.float()).to(dtype)  # [M, K]
    rf = r.float()
    xn = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)
    w = norm_weight.float()
    h = (xn * (1.0 + w) if zero_centered else w * xn.to(dtype).float()).to(dtype)
    out = h.float() @ weight.float().T  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype), r
