"""Triton decode GEMM: out[M, N] = x[M, K] @ W[N, K].T (+ bias), M <= 16, bf16 / fp16.

Two kernels: the base one here (by default every step of up to 16 rows) and the split-K one
(triton_splitk.py: more programs for few output columns, and the wide tiles of 17-64 rows);
DELTASERVE_DECODE_GEMM_KERNEL=splitk sends it the shapes its configuration splits too
(`decode_gemm` says why that is not the default; `deltaserve bench kernels --only gemm` times
both). In the base kernel each program owns BLOCK_N output columns (rows of W) and walks K in
BLOCK_K steps; the rows of x are padded to 16 inside the tile (masked loads), so one `tl.dot`
per step serves any M <= 16 with the tensor cores while the kernel stays a pure stream of W.
The block sizes are autotuned per (N, K) on the first call (eager, before CUDA-graph capture);
under the interpreter one small configuration runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.autotune import autotune
from deltaserve.ops.linear import MAX_ROWS, interpreting
from deltaserve.ops.linear.prologue import (
    DecodePrologue,
    check_prologue,
    gemm_in_features,
    kernel_args,
    min_block_k,
)
from deltaserve.ops.linear.triton_prologue import load_x

if TYPE_CHECKING:  # triton_splitk imports this module
    from deltaserve.ops.linear.triton_splitk import SplitKConfig

# the tuner's configurations on a GPU: (BLOCK_N, BLOCK_K, warps, stages)
GPU_CONFIGS = (
    (16, 256, 4, 4),
    (16, 512, 4, 3),
    (16, 512, 4, 4),
    (32, 256, 4, 4),
    (32, 256, 4, 5),
    (32, 512, 4, 3),
    (32, 512, 8, 3),
    (64, 128, 4, 4),
    (64, 256, 4, 3),
    (64, 256, 8, 4),
    (16, 1024, 4, 2),
    (32, 128, 4, 6),
    (16, 128, 2, 8),
    (16, 256, 2, 6),
)


def gpu_configs() -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)
        for bn, bk, warps, stages in GPU_CONFIGS
    ]


def _configs() -> list[triton.Config]:
    if interpreting():  # not tuned there: decode_gemm_base launches one tile (one tile)
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    return gpu_configs()


def _prune(configs: list, named_args: dict, **kwargs) -> list:  # noqa: ANN001
    """Configurations whose K tile holds whole heads of a gated_norm prologue (HEAD); with a
    prologue, only those that keep its float32 math in registers: K tiles of at most 256 and
    at most 96 x and W tile elements per thread (compiled for sm_90 without a prologue, these
    and the rest do not spill; with one, the rest did: tests/ops/test_sm90_compile.py)."""
    head = kwargs.get("HEAD", 1) if kwargs.get("PROLOGUE", 0) == 2 else 1
    fits = [c for c in configs if c.kwargs["BLOCK_K"] >= head]
    if not kwargs.get("PROLOGUE", 0):
        return fits

    def per_thread(c) -> float:  # noqa: ANN001
        bn, bk = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        return (16 + bn) * bk / (32 * c.num_warps)

    return [c for c in fits if c.kwargs["BLOCK_K"] <= 256 and per_thread(c) <= 96]


@triton.jit
def _gemm_step(
    acc, x_rows, w_rows, k, K, m_mask, n_mask, z_rows, nw_ptr, eps, stride_zh,
    PROLOGUE: tl.constexpr, HEAD: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """acc [16, BLOCK_N] += x[:, k] @ W[n, k].T for one K tile (x through its prologue)."""
    x = load_x(x_rows, z_rows, nw_ptr, k, K, K, m_mask, eps, stride_zh, PROLOGUE, HEAD, 16, BLOCK_K)
    w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0)
    return acc + tl.dot(x, tl.trans(w))


@autotune(configs=_configs(), key=["N", "K", "PROLOGUE", "HEAD"], prune=_prune)
@triton.jit
def _decode_gemm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    z_ptr,  # the prologue's (ops/linear/prologue.py)
    nw_ptr,
    stride_zm,
    stride_zh,
    eps,
    HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, 16)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    z_rows = z_ptr + offs_m[:, None].to(tl.int64) * stride_zm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    k_first = 0
    if PDL:  # the first W tile is loaded while the previous kernel finishes (ops/pdl.py)
        k_mask = offs_k < K
        w0 = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        pdl.wait(PDL)
        x0 = load_x(
            x_rows,
            z_rows,
            nw_ptr,
            offs_k,
            K,
            K,
            m_mask,
            eps,
            stride_zh,
            PROLOGUE,
            HEAD,
            16,
            BLOCK_K,
        )
        acc = tl.dot(x0, tl.trans(w0), acc)
        k_first = BLOCK_K
    if INTERPRET:
        # NOTE: the interpreter (with numpy >= 2.4) cannot take `range` over a runtime bound
        k0 = k_first
        while k0 < K:
            acc = _gemm_step(
                acc, x_rows, w_rows, k0 + offs_k, K, m_mask, n_mask, z_rows, nw_ptr, eps, stride_zh,
                PROLOGUE, HEAD, BLOCK_K,
            )  # fmt: skip
            k0 += BLOCK_K
    else:
        for k0 in tl.range(k_first, K, BLOCK_K):
            acc = _gemm_step(
                acc, x_rows, w_rows, k0 + offs_k, K, m_mask, n_mask, z_rows, nw_ptr, eps, stride_zh,
                PROLOGUE, HEAD, BLOCK_K,
            )  # fmt: skip
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += bias[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def check_decode_gemm_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    max_rows: int = MAX_ROWS,
    prologue: DecodePrologue | None = None,
) -> tuple[int, int, int]:
    """(M, K, N) of a decode GEMM call (K: the GEMM's input features, after the prologue);
    ValueError naming what is wrong with its shapes."""
    check_prologue(x, prologue)
    M, K = x.shape[0], gemm_in_features(x, prologue)
    if prologue is not None and M > MAX_ROWS:
        raise ValueError(f"a decode GEMM prologue serves at most {MAX_ROWS} rows, got {M}")
    N, K2 = weight.shape
    if K2 != K:
        what = "silu_mul's halves have" if K != x.shape[1] else "x has"
        raise ValueError(f"{what} {K} features but the weight expects {K2}")
    if M > max_rows:
        raise ValueError(f"decode_gemm serves at most {max_rows} rows, got {M}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("decode_gemm needs a unit last stride on x and weight")
    return M, K, N


def decode_gemm_base(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    prologue: DecodePrologue | None = None,
) -> torch.Tensor:
    """The base kernel (one program per column tile, autotuned per (N, K)): x [M, K] (unit
    last stride, M <= 16; through `prologue` first, ops/linear/prologue.py) @ weight [N, K].T
    (+ bias [N]) -> [M, N] in x's dtype, accumulated in float32."""
    M, K, N = check_decode_gemm_args(x, weight, prologue=prologue)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out

    kernel, meta = _decode_gemm_kernel, {}
    if interpreting():  # one tile, of K columns enough for the prologue's heads; no tuning
        kernel = _decode_gemm_kernel.fn
        meta = dict(BLOCK_N=16, BLOCK_K=max(32, min_block_k(prologue)), num_warps=4)

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]),)

    kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        M,
        N,
        K,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        INTERPRET=interpreting(),
        **kernel_args(x, prologue),
        **meta,
        **pdl.launch_kwargs(x),
    )
    return out


KERNELS = ("auto", "splitk", "base")


def decode_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernel: str = "auto",
    prologue: DecodePrologue | None = None,
) -> torch.Tensor:
    """x [M, K] (unit last stride, M <= 16; "auto" and "splitk" up to WIDE_MAX_ROWS) @ weight
    [N, K].T (+ bias [N]) -> [M, N] in x's dtype, accumulated in float32, by `kernel`:

    - "auto" (the default): the base kernel above (autotuned per shape) up to 16 rows, the
      split-K kernel's wide tiles above. At up to 16 rows the base kernel was the faster of the
      two at every shape where the split-K kernel's configuration splits K (one H200, PDL on,
      `bench kernels --only gemm`, docs/results/decode-gemm-norm-fusion-h200.md: 2048 x 4096
      7.6-7.7 against 9.0-10.0 us, 1281 x 2048 4.4-4.7 against 6.0-6.5 us, 2048 x 512 2.4-2.6
      against 3.6-4.0 us) and the same kernel elsewhere;
    - "splitk": the split-K kernel (triton_splitk.py) where its configuration for the shape
      splits K or M > 16, the base kernel elsewhere (the default until that measurement);
    - "base": the base kernel always (at most 16 rows).

    `prologue`: an op applied to x as it is loaded (ops/linear/prologue.py)."""
    cfg = splitk_config(x, weight, kernel, prologue)
    if cfg is None:
        return decode_gemm_base(x, weight, bias, prologue)
    from deltaserve.ops.linear.triton_splitk import decode_gemm_splitk

    return decode_gemm_splitk(x, weight, bias, cfg, prologue)


def splitk_config(
    x: torch.Tensor,
    weight: torch.Tensor,
    kernel: str = "auto",
    prologue: DecodePrologue | None = None,
) -> SplitKConfig | None:
    """The split-K configuration `decode_gemm(x, weight, kernel=kernel)` runs, or None where it
    runs the base kernel."""
    if kernel not in KERNELS:
        raise ValueError(f"decode_gemm kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "base" or (kernel == "auto" and x.shape[0] <= MAX_ROWS):
        return None
    from deltaserve.ops.linear.triton_splitk import config_for, runs_splitk

    cfg = config_for(x, weight, prologue)
    return cfg if runs_splitk(cfg, x.shape[0]) else None


class TritonDecodeGemm:
    """The `decode_gemm` backend object (callable like `TorchDecodeGemm`). Its kernel:
    DELTASERVE_DECODE_GEMM_KERNEL (`decode_gemm`'s choices; auto by default)."""

    name = "triton"
    supports_cuda_graph = True  # grid from the weight's shape; tuned in the warm-up run

    def __init__(self, kernel: str | None = None, max_rows: int | None = None) -> None:
        from deltaserve import env

        self.kernel = kernel or env.decode_gemm_kernel()
        if self.kernel not in KERNELS:
            raise ValueError(f"decode_gemm kernel must be one of {KERNELS}, got {self.kernel!r}")
        # the largest input the layers send it (DELTASERVE_DECODE_GEMM_MAX_ROWS; above 16 rows
        # only the split-K kernel serves)
        self.max_rows = max_rows or env.decode_gemm_max_rows()
        if self.max_rows > MAX_ROWS and self.kernel == "base":
            raise ValueError(f"the base decode GEMM kernel serves at most {MAX_ROWS} rows")
        # whether the layers hand it their op before the GEMM (DELTASERVE_DECODE_GEMM_PROLOGUE)
        self.takes_prologue = env.decode_gemm_prologue()

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        prologue: DecodePrologue | None = None,
    ) -> torch.Tensor:
        return decode_gemm(x, weight, bias, self.kernel, prologue)
