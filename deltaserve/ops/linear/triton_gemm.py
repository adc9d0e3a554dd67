"""Triton decode GEMM: out[M, N] = x[M, K] @ W[N, K].T (+ bias), M <= 64, bf16 / fp16.

Two kernels: the base one here (by default every step the backend serves) and the split-K one
(triton_splitk.py: more programs for few output columns, and wide tiles of its own for 17-64
rows), which DELTASERVE_DECODE_GEMM_KERNEL=splitk sends the shapes its configuration splits
and every step above 16 rows (`decode_gemm` says why that is not the default; `deltaserve
bench kernels --only gemm` times both). In the base kernel each program owns BLOCK_N output
columns (rows of W) and walks K in BLOCK_K steps; the rows of x are padded to BLOCK_M (16, 32
or 64) inside the tile (masked loads), so one `tl.dot` per step serves any M <= BLOCK_M with
the tensor cores while the kernel stays a pure stream of W. The block sizes are autotuned per
(N, K, BLOCK_M) on the first call (eager, before CUDA-graph capture), from one list for 16 rows
and one for the wide tiles (whose x tile takes more shared memory per stage); under the
interpreter one small configuration runs.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.autotune import autotune
from deltaserve.ops.linear import (
    MAX_ROWS,
    WIDE_MAX_ROWS,
    ConvEpilogue,
    NormedInput,
    interpreting,
)

if TYPE_CHECKING:  # triton_splitk imports this module
    from deltaserve.ops.linear.triton_splitk import SplitKConfig


def _configs() -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    return base_configs() + list(wide_base_configs())


def _config(bn: int, bk: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)


def base_configs() -> list[triton.Config]:
    """The base kernel's tuner configurations for up to 16 rows on a GPU (`bench kernels
    --gemm-sweep` times each one against the tuner's choice)."""
    return [
        _config(*c)
        for c in (
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
    ]


# shared memory the pipelined loads of a wide configuration may ask for (an H100 / H200 block
# gets 227 KiB; this leaves room for Triton's scratch)
WIDE_SMEM_BYTES = 200 * 1024
_WIDE_IDS: set[int] = set()  # the wide list's Config objects (Triton's disk cache rebuilds a
# Config from its attributes: a marker attribute on it would break that)


@functools.cache
def wide_base_configs(block_m: int = WIDE_MAX_ROWS) -> list[triton.Config]:
    """The tuner's configurations for 17-64 rows (x padded to 32 or 64 rows): wider column
    tiles read x's rows fewer times; those whose pipelined W and x tiles need more than
    WIDE_SMEM_BYTES at `block_m` rows are left out. The same objects on every call."""
    out = []
    for bn, bk, warps, stages in (
        (32, 128, 4, 4),
        (32, 128, 4, 6),
        (32, 256, 4, 4),
        (64, 128, 4, 4),
        (64, 128, 8, 4),
        (64, 128, 4, 6),
        (64, 256, 8, 3),
        (128, 64, 8, 4),
        (128, 128, 8, 3),
        (16, 256, 4, 4),
    ):
        if (stages - 1) * (bn + block_m) * bk * 2 <= WIDE_SMEM_BYTES:
            out.append(_config(bn, bk, warps, stages))
    _WIDE_IDS.update(id(c) for c in out)
    return out


def _is_wide(config: triton.Config) -> bool:
    return id(config) in _WIDE_IDS


def _prune_by_rows(configs: list, named_args: dict, **kwargs) -> list:  # noqa: ANN001
    """Triton's early pruning hook: the 16-row list at BLOCK_M 16, the wide list above (all
    of them under the interpreter, which has one configuration)."""
    wide = kwargs.get("BLOCK_M", 16) > 16
    kept = [c for c in configs if _is_wide(c) == wide]
    return kept or configs


@triton.jit
def _gemm_step(acc, x_rows, w_rows, k, K, m_mask, n_mask):
    """acc [BLOCK_M, BLOCK_N] += x[:, k] @ W[n, k].T for one K tile."""
    k_mask = k < K
    x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    return acc + tl.dot(x, tl.trans(w))


@autotune(configs=_configs(), key=["N", "K", "BLOCK_M"], prune=_prune_by_rows)
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
    HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_first = 0
    if PDL:  # the first W tile is loaded while the previous kernel finishes (ops/pdl.py)
        k_mask = offs_k < K
        w0 = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        pdl.wait(PDL)
        x0 = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x0, tl.trans(w0), acc)
        k_first = BLOCK_K
    if INTERPRET:
        # NOTE: the interpreter (with numpy >= 2.4) cannot take `range` over a runtime bound
        k0 = k_first
        while k0 < K:
            acc = _gemm_step(acc, x_rows, w_rows, k0 + offs_k, K, m_mask, n_mask)
            k0 += BLOCK_K
    else:
        for k0 in tl.range(k_first, K, BLOCK_K):
            acc = _gemm_step(acc, x_rows, w_rows, k0 + offs_k, K, m_mask, n_mask)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += bias[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def check_decode_gemm_args(
    x: torch.Tensor, weight: torch.Tensor, max_rows: int = MAX_ROWS
) -> tuple[int, int, int]:
    """(M, K, N) of a decode GEMM call; ValueError naming what is wrong with its shapes."""
    M, K = x.shape
    N, K2 = weight.shape
    if K2 != K:
        raise ValueError(f"x has {K} features but the weight expects {K2}")
    if M > max_rows:
        raise ValueError(f"decode_gemm serves at most {max_rows} rows, got {M}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("decode_gemm needs a unit last stride on x and weight")
    return M, K, N


def decode_gemm_base(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """The base kernel (one program per column tile, autotuned per (N, K, rows padded to 16, 32
    or 64)): x [M, K] (unit last stride, M <= 64) @ weight [N, K].T (+ bias [N]) -> [M, N] in
    x's dtype, accumulated in float32. `config` (benchmarks): launch that configuration
    instead of the tuner's."""
    M, K, N = check_decode_gemm_args(x, weight, WIDE_MAX_ROWS)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]),)

    kernel = _decode_gemm_kernel
    fixed = {}
    if config is not None:  # the jitted function under the tuner, with this configuration
        kernel = _decode_gemm_kernel.fn
        fixed = config.all_kwargs()
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
        **pdl.launch_kwargs(x),
        BLOCK_M=max(16, triton.next_power_of_2(M)),
        **fixed,
    )
    return out


KERNELS = ("auto", "splitk", "base")


def decode_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """x [M, K] (unit last stride, M <= WIDE_MAX_ROWS) @ weight
    [N, K].T (+ bias [N]) -> [M, N] in x's dtype, accumulated in float32, by `kernel`:

    - "auto" (the default): the base kernel above (autotuned per shape, its wide tiles above
      16 rows). At up to 16 rows the base kernel was the faster of the
      two at every shape where the split-K kernel's configuration splits K (one H200, PDL on,
      `bench kernels --only gemm`, docs/results/decode-gemm-norm-fusion-h200.md: 2048 x 4096
      7.6-7.7 against 9.0-10.0 us, 1281 x 2048 4.4-4.7 against 6.0-6.5 us, 2048 x 512 2.4-2.6
      against 3.6-4.0 us) and the same kernel elsewhere; at 64 rows its wide tiles beat the
      split-K kernel's on the shapes where either beats cuBLAS (`TritonDecodeGemm`): 2048 x 4096
      9.2 against 11.1 us, 1281 x 2048 6.3 against 6.6 (one H200, 3043586);
    - "splitk": the split-K kernel (triton_splitk.py) where its configuration for the shape
      splits K or M > 16, the base kernel elsewhere (the default until that measurement);
    - "base": the base kernel always (its wide tiles above 16 rows), one row included.

    "auto" runs one-row steps through the GEMV kernel (triton_gemv.py: CUDA-core FMAs, narrow
    column tiles, W's first two chunks read before the PDL wait): on an H200 (5f989e9,
    `bench throughput --random-model qwen3.5-35b-a3b`, decode batch 1, one machine) 392.0
    against 349.7 tok/s with the base kernel, and in `bench kernels --only gemm` at one row
    2048 x 4096 6.4 against 7.7 us, 1281 x 2048 2.8 against 4.5, 9B shapes within 4%."""
    if kernel == "auto" and x.shape[0] == 1:
        from deltaserve.ops.linear.triton_gemv import decode_gemv

        return decode_gemv(x, weight, bias)
    cfg = splitk_config(x, weight, kernel)
    if cfg is None:
        return decode_gemm_base(x, weight, bias)
    from deltaserve.ops.linear.triton_splitk import decode_gemm_splitk

    return decode_gemm_splitk(x, weight, bias, cfg)


def splitk_config(
    x: torch.Tensor, weight: torch.Tensor, kernel: str = "auto"
) -> SplitKConfig | None:
    """The split-K configuration `decode_gemm(x, weight, kernel=kernel)` runs, or None where it
    runs the base kernel."""
    if kernel not in KERNELS:
        raise ValueError(f"decode_gemm kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel != "splitk":  # "auto" and "base": the base kernel (one row aside for auto)
        return None
    from deltaserve.ops.linear.triton_splitk import config_for, runs_splitk

    cfg = config_for(x, weight)
    return cfg if runs_splitk(cfg, x.shape[0]) else None


# Above 16 rows the Triton kernels serve only weights of at most this many output rows; cuBLAS
# the rest. At 64 rows (one H200, `bench kernels --only gemm`, 3043586) the base kernel's wide
# tiles beat cuBLAS on every measured shape of N <= 2048 (1281 x 2048 6.3 against 14.8 us,
# 2048 x 4096 9.2 against 10.2, 2048 x 512 3.5 against 3.8) and cuBLAS won or tied on all but
# one of N >= 4096 (10240 x 4096 23.5 against 31.2 us; 4096 x 12288 32.5 against 31.2).
WIDE_TRITON_MAX_N = 2048


# The residual add + RMSNorm runs in the GEMV's launch only up to this hidden size. Decode
# batch 1, one H200, one call each way (de272fb; docs/benchmarks.md): at hidden 2048 it gained
# (qwen3.5-35b-a3b 396.7 against 386.6 tok/s, deepseek-v2-lite 460.0 against 440.7); at 4096 it
# lost (qwen3.5-9b 216.2 against 223.5): every program re-reads the row (h, residual, the norm's
# weight) for the statistics and again per chunk, about as many bytes from L2 as its W slice.
NORM_GEMV_MAX_K = 2048


class TritonDecodeGemm:
    """The `decode_gemm` backend object (callable like `TorchDecodeGemm`). Its kernel:
    DELTASERVE_DECODE_GEMM_KERNEL (`decode_gemm`'s choices; auto by default). Steps of 17 to
    `max_rows` rows (DELTASERVE_DECODE_GEMM_MAX_ROWS) run the Triton kernel where the weight
    has at most WIDE_TRITON_MAX_N output rows (any, with kernel "base" or "splitk"), F.linear
    elsewhere (`uses_cublas`): a choice by the weight's shape, the same at every call of a
    layer."""

    name = "triton"
    supports_cuda_graph = True  # grid from the weight's shape; tuned in the warm-up run

    def __init__(self, kernel: str | None = None, max_rows: int | None = None) -> None:
        from deltaserve import env

        self.kernel = kernel or env.decode_gemm_kernel()
        if self.kernel not in KERNELS:
            raise ValueError(f"decode_gemm kernel must be one of {KERNELS}, got {self.kernel!r}")
        # the largest input the layers send it (DELTASERVE_DECODE_GEMM_MAX_ROWS)
        self.max_rows = max_rows or env.decode_gemm_max_rows()
        self.norm_gemv = env.norm_gemv() == "fused"
        self.conv_gemv = env.gdn_conv_gemv() == "fused"

    def uses_cublas(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether a call on x and weight runs F.linear: above 16 rows, kernel "auto", a
        weight of more than WIDE_TRITON_MAX_N output rows."""
        wide = x.shape[0] > MAX_ROWS
        return wide and self.kernel == "auto" and weight.shape[0] > WIDE_TRITON_MAX_N

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.uses_cublas(x, weight):
            return torch.nn.functional.linear(x, weight, bias)
        return decode_gemm(x, weight, bias, self.kernel)

    def fuses_add_norm(self, rows: int, k: int) -> bool:
        """Whether a layer should hand its residual add and norm to `add_norm`: one-row steps
        of hidden size k <= NORM_GEMV_MAX_K under kernel "auto" (the GEMV's), unless
        DELTASERVE_NORM_GEMV=separate."""
        return rows == 1 and k <= NORM_GEMV_MAX_K and self.kernel == "auto" and self.norm_gemv

    def fuses_conv(self, rows: int) -> bool:
        """Whether a GDN layer should hand its conv1d update to `conv`: one-row steps under
        kernel "auto" (the GEMV's epilogue) with DELTASERVE_GDN_CONV_GEMV=fused."""
        return rows == 1 and self.kernel == "auto" and self.conv_gemv

    def conv(
        self,
        x: torch.Tensor | NormedInput,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv: ConvEpilogue,
    ) -> torch.Tensor:
        """One row's projection (with the residual add and norm for a `NormedInput`) and GDN's
        conv1d update on its first `conv.channels` columns, in one launch."""
        if isinstance(x, NormedInput):
            return self.add_norm(x, weight, bias, conv)
        from deltaserve.ops.linear.triton_gemv import decode_gemv

        return decode_gemv(x, weight, bias, conv=conv)

    def add_norm(
        self,
        x: NormedInput,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        conv: ConvEpilogue | None = None,
    ) -> torch.Tensor:
        """rms_norm(x.h + x.residual) @ weight.T (+ bias) for one row, in one launch
        (triton_gemv_norm.py), filling x.residual_out (and x.normed_out); `conv`: with GDN's
        conv1d update on the first columns (`conv`)."""
        from deltaserve.ops.linear.triton_gemv_norm import decode_gemv_add_norm

        return decode_gemv_add_norm(
            x.h, x.residual, x.norm_weight, x.eps, x.zero_centered, weight, bias,
            residual_out=x.residual_out, normed_out=x.normed_out, conv=conv,
        )  # fmt: skip
