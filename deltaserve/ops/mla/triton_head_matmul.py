"""Per-head matmul of a decode step's few rows: out[t, h] = x[t, h] @ W[h] for the MLA layer's
absorbed projections (q_lat = q_nope W_UK, o = out W_UV), in one launch.

Why: the layer's `torch.bmm` over [H, T, K] x [H, K, N] ran cuBLAS at 3.3 us a call on an H200
for DeepSeek-V2-Lite's 2 MB per matrix at batch 1 (two calls per layer, 0.18 ms of a 2.7 ms
step: docs/results/profile-dsv2-lite-b1-no-pdl-h200.txt), plus a copy to bring the result back
to [T, H, N]. Here one program per (head, BLOCK_N output columns) loads its W tile [K, BLOCK_N]
before the wait on the previous kernel (ops/pdl.py: weights only), then x's rows of that head
(any strides: q_nope is a column slice of q) padded to 16-64 rows for one tensor-core dot, and
writes [T, H, N] directly. Block sizes autotuned per (K, N, rows padded); float32 operands run
the dot in IEEE float32 (the parity models), untuned, over K in steps of 64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve import env
from deltaserve.ops import pdl
from deltaserve.ops.autotune import autotune
from deltaserve.ops.fused.mla_prep import check_rope_norm_args, rope_norm_token
from deltaserve.ops.mla import bmm_per_head
from deltaserve.ops.moe.triton_gemm import dot_precision, interpreting

MAX_ROWS = 64  # the most rows (tokens) one launch serves: x padded to 16, 32 or 64


def _configs() -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=1)
        for bn, w in ((16, 2), (32, 4), (64, 4), (64, 8), (128, 8))
    ]


def _prune_tiles(configs: list, named_args: dict, **kwargs) -> list:  # noqa: ANN001
    """Triton's early pruning hook: at most 256 elements of the x and W tiles per thread (the
    ones above spilled registers on sm_90 at K 512: tests/ops/test_mla_sm90_compile.py)."""
    k_pad, t_pad = kwargs["K_PAD"], kwargs.get("T_PAD", 16)

    def per_thread(c) -> float:  # noqa: ANN001
        return (t_pad + c.kwargs["BLOCK_N"]) * k_pad / (32 * c.num_warps)

    kept = [c for c in configs if per_thread(c) <= 256]
    return kept or [min(configs, key=per_thread)]


class TritonHeadMatmul:
    """`MLABackend.head_matmul` through `head_matmul` for steps of at most MAX_ROWS rows (decode
    and short chunks), torch.bmm above (prefill), and `MLABackend.prep` for such steps in one
    launch (`rope_norm_head_matmul`; DELTASERVE_MLA_PREP=separate: two): a mixin for the CUDA
    MLA backends."""

    def head_matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return head_matmul_any_rows(x, w)

    def prep(
        self,
        fused,  # noqa: ANN001
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_a: torch.Tensor,
        weight: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        eps: float,
        w_uk: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if q_nope.shape[0] <= MAX_ROWS and env.mla_prep() == "fused":
            return rope_norm_head_matmul(q_nope, q_pe, kv_a, weight, cos, sin, eps, w_uk)
        return super().prep(fused, q_nope, q_pe, kv_a, weight, cos, sin, eps, w_uk)


@triton.jit
def _head_tile(
    h,
    pid_n,
    x_ptr,
    w_ptr,
    out_ptr,
    T,
    stride_xt,
    stride_xh,
    stride_wh,
    stride_wk,
    stride_ot,
    stride_oh,
    K: tl.constexpr,
    N: tl.constexpr,
    K_PAD: tl.constexpr,
    T_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out[:, h, n block pid_n] = x[:, h] @ W[h][:, n block] (the PDL wait inside, after W's
    first K step is loaded)."""
    h = h.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_t = tl.arange(0, T_PAD)
    t_mask = offs_t < T
    w_base = w_ptr + h * stride_wh + offs_n[None, :]
    x_base = x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + h * stride_xh
    offs_k = tl.arange(0, BLOCK_K)
    # W's first K step: weights only, so before the wait (ops/pdl.py)
    w0_mask = (offs_k < K)[:, None] & n_mask[None, :]
    w0 = tl.load(w_base + offs_k[:, None] * stride_wk, mask=w0_mask, other=0.0)
    pdl.wait(PDL)  # x is the previous kernels' output
    acc = tl.zeros((T_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in tl.static_range(0, K_PAD, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        if k0 == 0:
            w = w0
        else:
            w_mask = k_mask[:, None] & n_mask[None, :]
            w = tl.load(w_base + k[:, None] * stride_wk, mask=w_mask, other=0.0)
        x = tl.load(x_base + k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)  # [T_PAD, BLOCK_N] float32
    out = out_ptr + offs_t[:, None].to(tl.int64) * stride_ot + h * stride_oh + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & n_mask[None, :])


@autotune(configs=_configs(), key=["K", "N", "T_PAD"], prune=_prune_tiles)
@triton.jit
def _head_matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    T,
    stride_xt,
    stride_xh,
    stride_wh,
    stride_wk,
    stride_ot,
    stride_oh,
    K: tl.constexpr,
    N: tl.constexpr,
    K_PAD: tl.constexpr,
    T_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (H, cdiv(N, BLOCK_N)). x [T, H, K] (unit last stride), W [H, K, N] (unit last
    stride), out [T, H, N] (unit last stride). K in steps of BLOCK_K (a power of two dividing
    K_PAD: all of it in 16 bits, where W's whole tile is read before the wait)."""
    _head_tile(
        tl.program_id(0), tl.program_id(1), x_ptr, w_ptr, out_ptr, T, stride_xt, stride_xh,
        stride_wh, stride_wk, stride_ot, stride_oh, K, N, K_PAD, T_PAD, PRECISION, PDL,
        BLOCK_K, BLOCK_N,
    )  # fmt: skip


@autotune(configs=_configs(), key=["K", "N", "T_PAD"], prune=_prune_tiles)
@triton.jit
def _prep_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    T,
    stride_xt,
    stride_xh,
    stride_wh,
    stride_wk,
    stride_ot,
    stride_oh,
    q_ptr,
    qo_ptr,
    kv_ptr,
    lat_ptr,
    nw_ptr,
    cos_ptr,
    sin_ptr,
    H,
    stride_qt,
    stride_qh,
    stride_qot,
    stride_qoh,
    stride_kv,
    stride_lat,
    stride_cos,
    stride_sin,
    eps,
    K: tl.constexpr,
    N: tl.constexpr,
    K_PAD: tl.constexpr,
    T_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
    R: tl.constexpr,
    P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (H * cdiv(N, BLOCK_N) + T,): the first H * cdiv(N, BLOCK_N) programs are
    `_head_matmul_kernel`'s (q_lat = q_nope W_UK), program H * cdiv(N, BLOCK_N) + t is
    mla_rope_norm's program for token t (ops/fused/mla_prep.py)."""
    tiles: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    if pid < H * tiles:
        _head_tile(
            pid // tiles, pid % tiles, x_ptr, w_ptr, out_ptr, T, stride_xt, stride_xh,
            stride_wh, stride_wk, stride_ot, stride_oh, K, N, K_PAD, T_PAD, PRECISION, PDL,
            BLOCK_K, BLOCK_N,
        )  # fmt: skip
    else:
        pdl.wait(PDL)
        rope_norm_token(
            pid - H * tiles, q_ptr, qo_ptr, kv_ptr, lat_ptr, nw_ptr, cos_ptr, sin_ptr, H,
            stride_qt, stride_qh, stride_qot, stride_qoh, stride_kv, stride_lat, stride_cos,
            stride_sin, eps, R, P, BLOCK_H, BLOCK_R, BLOCK_P,
        )  # fmt: skip


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    T, H, K = x.shape
    if w.dim() != 3 or w.shape[0] != H or w.shape[1] != K:
        raise ValueError(f"head_matmul: x {tuple(x.shape)} does not match w {tuple(w.shape)}")
    if T > MAX_ROWS:
        raise ValueError(f"head_matmul serves at most {MAX_ROWS} rows, got {T}")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("head_matmul needs a unit last stride on x and w")


def _matmul_args(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> tuple[list, dict]:
    """The head-matmul part of a launch: (positional arguments, constexprs)."""
    K = x.shape[2]
    k_pad = max(16, triton.next_power_of_2(K))
    # float32 (the parity models): K in steps of 64, as one step at K 512 and 64 rows asked
    # for 256 KB of shared memory on an H200 (the limit is 227 KB)
    block_k = min(k_pad, 64) if x.dtype == torch.float32 else k_pad
    args = [x, w, out, x.shape[0], x.stride(0), x.stride(1), w.stride(0), w.stride(1),
            out.stride(0), out.stride(1)]  # fmt: skip
    meta = dict(K=K, N=w.shape[2], K_PAD=k_pad, T_PAD=max(16, triton.next_power_of_2(x.shape[0])),
                PRECISION=dot_precision(x.dtype), BLOCK_K=block_k)  # fmt: skip
    return args, meta


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H, K] (unit last stride, T <= MAX_ROWS) @ w [H, K, N] (unit last stride) ->
    [T, H, N] contiguous, in x's dtype, accumulated in float32."""
    _check(x, w)
    T, H, _ = x.shape
    N = w.shape[2]
    out = torch.empty(T, H, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    args, meta = _matmul_args(x, w, out)
    _head_matmul_kernel[lambda m: (H, triton.cdiv(N, m["BLOCK_N"]))](
        *args, **meta, **pdl.launch_kwargs(x)
    )
    return out


def head_matmul_any_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`head_matmul` up to MAX_ROWS rows, torch.bmm above (`bmm_per_head`)."""
    if x.shape[0] <= MAX_ROWS:
        return head_matmul(x, w)
    return bmm_per_head(x, w)


def rope_norm_head_matmul(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_a: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    w_uk: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MLA step's preparation in one launch: mla_rope_norm (q_pe rotated, the latent rows
    built; ops/fused/mla_prep.py) and q_lat = q_nope @ W_UK per head (`head_matmul`), whose
    programs share one grid. Arguments as those two take them (q_nope [T, H, N] with T <=
    MAX_ROWS). Returns (q_pe rotated [T, H, P], latent [T, R + P], q_lat [T, H, R])."""
    _check(q_nope, w_uk)
    q_pe_out, latent = check_rope_norm_args(q_pe, kv_a, weight, cos, sin)
    T, H, _ = q_nope.shape
    N = w_uk.shape[2]
    q_lat = torch.empty(T, H, N, dtype=q_nope.dtype, device=q_nope.device)
    if T == 0:
        return q_pe_out, latent, q_lat
    P = q_pe.shape[2]
    R = kv_a.shape[1] - P
    args, meta = _matmul_args(q_nope, w_uk, q_lat)
    _prep_kernel[lambda m: (H * triton.cdiv(N, m["BLOCK_N"]) + T,)](
        *args, q_pe, q_pe_out, kv_a, latent, weight, cos, sin, H, q_pe.stride(0),
        q_pe.stride(1), q_pe_out.stride(0), q_pe_out.stride(1), kv_a.stride(0),
        latent.stride(0), cos.stride(0), sin.stride(0), eps, **meta, R=R, P=P,
        BLOCK_H=triton.next_power_of_2(H), BLOCK_R=triton.next_power_of_2(R),
        BLOCK_P=triton.next_power_of_2(P), **pdl.launch_kwargs(q_nope),
    )  # fmt: skip
    return q_pe_out, latent, q_lat
