"""Triton decode GEMV: out[1, N] = x[1, K] @ W[N, K].T (+ bias), one row, bf16 / fp16.

Why: at one row a projection is a pure stream of W, and on the thin shapes of a 2048-wide model
(2048 x 4096, 1281 x 2048: fewer column tiles of 16 than an H200 has SMs) the base kernel
(triton_gemm.py) keeps too few bytes in flight per SM to reach the copy rate: each program walks
K in 8 KB tiles behind a tensor-core dot whose other 15 rows are padding. Here each program owns
BLOCK_N output columns (as few as 4: more programs) and reads W in chunks of CHUNK_K columns,
large enough to hold 16-64 KB in flight per program, with CUDA-core FMAs (x upcast to float32,
one reduction across the chunk per chunk). Two chunks are in flight at once (the next one's
loads are issued before the current one's math; Triton does not pipeline loads that feed no
dot), and under programmatic dependent launch (ops/pdl.py) both of the first two are issued
before the wait on the previous kernel: a W that fits two chunks is read entirely while the
previous kernel finishes.

Block sizes are autotuned per (N, K) among configurations that keep at most 64 of W's elements
per thread in each chunk (CHUNK_K at most K rounded up to a power of two). The `triton` decode
GEMM backend runs it for every one-row step (kernel `auto`, the default: triton_gemm.decode_gemm
cites the measurements); `deltaserve bench kernels --only gemm` times it (`triton-gemv`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.autotune import autotune
from deltaserve.ops.gdn.triton_conv1d import conv_epilogue
from deltaserve.ops.linear import ConvEpilogue, interpreting
from deltaserve.ops.linear.triton_gemm import check_decode_gemm_args

# (BLOCK_N, CHUNK_K, num_warps): BLOCK_N * CHUNK_K / (32 * warps) <= 64 elements per thread
GEMV_CONFIGS = (
    (4, 1024, 2),
    (4, 2048, 4),
    (8, 512, 2),
    (8, 1024, 4),
    (8, 2048, 8),
    (16, 512, 4),
    (16, 1024, 8),
    (32, 512, 8),
    (2, 2048, 2),
)


def gemv_configs() -> list[triton.Config]:
    """The tuner's list on a GPU (num_stages 1: the kernel prefetches by hand); one small
    configuration under the interpreter."""
    if interpreting():
        return [triton.Config({"BLOCK_N": 4, "CHUNK_K": 32}, num_warps=1, num_stages=1)]
    return [
        triton.Config({"BLOCK_N": bn, "CHUNK_K": ck}, num_warps=w, num_stages=1)
        for bn, ck, w in GEMV_CONFIGS
    ]


def _prune_chunks(configs: list, named_args: dict, **kwargs) -> list:  # noqa: ANN001
    """Triton's early pruning hook: chunks no wider than K rounded up to a power of two (a
    wider one only holds masked lanes)."""
    k = triton.next_power_of_2(int(kwargs["K"]))
    kept = [c for c in configs if c.kwargs["CHUNK_K"] <= max(k, 32)]
    return kept or configs


@triton.jit
def _load_chunk(w_rows, k0, offs_k, n_mask, K: tl.constexpr):
    """W[n, k0 : k0 + CHUNK_K] [BLOCK_N, CHUNK_K] (zeros past K: a chunk wholly past it moves
    no bytes)."""
    k = k0 + offs_k
    return tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0)


@autotune(configs=gemv_configs(), key=["N", "K"], prune=_prune_chunks)
@triton.jit
def _decode_gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    N,
    stride_wn,
    cw_ptr,  # CONV: GDN's conv weight [C, W]
    cs_ptr,  # CONV: the conv-state pool [slots, C, W - 1], shifted in place
    slot_ptr,  # CONV: the row's state slot, one int64
    conv_channels,  # CONV: C, the output columns that are conv channels (the first ones)
    stride_cwc,
    stride_cww,
    stride_csn,
    stride_csc,
    stride_csw,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CONV: tl.constexpr,
    CONV_W: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK_K: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N),). x [K] (one row, unit stride), W [N, K] (unit last stride),
    out [N]; CONV: GDN's conv1d update on the first `conv_channels` columns (`conv_epilogue`)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, CHUNK_K)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    # the first two chunks: weights only, so before the wait (ops/pdl.py)
    w_cur = _load_chunk(w_rows, 0, offs_k, n_mask, K)
    w_nxt = _load_chunk(w_rows, CHUNK_K, offs_k, n_mask, K)
    pdl.wait(PDL)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, CHUNK_K):
        x = tl.load(x_ptr + k0 + offs_k, mask=(k0 + offs_k) < K, other=0.0).to(tl.float32)
        acc += tl.sum(w_cur.to(tl.float32) * x[None, :], axis=1)
        # the chunk after next: issued before the next one's math (two in flight)
        w_cur = w_nxt
        w_nxt = _load_chunk(w_rows, k0 + 2 * CHUNK_K, offs_k, n_mask, K)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    y = acc.to(out_ptr.dtype.element_ty)
    if CONV:
        y = conv_epilogue(
            y, offs_n, n_mask, conv_channels, cw_ptr, cs_ptr, slot_ptr, stride_cwc, stride_cww,
            stride_csn, stride_csc, stride_csw, CONV_W,
        )  # fmt: skip
    tl.store(out_ptr + offs_n, y, mask=n_mask)


def conv_launch_args(conv: ConvEpilogue | None, weight: torch.Tensor) -> tuple[tuple, dict]:
    """The GEMV kernels' conv arguments: the epilogue's tensors and strides (placeholders when
    there is none) and its constexprs."""
    if conv is None:
        return (weight, weight, weight, 0, *(0,) * 5), {"CONV": False, "CONV_W": 1}
    conv.check()
    w, state = conv.weight, conv.state
    args = (w, state, conv.slot, conv.channels, *w.stride(), *state.stride())
    return args, {"CONV": True, "CONV_W": w.shape[1]}


_CONV_CONFIGS: dict[tuple, triton.Config] = {}


def tuned_config(kernel, key: tuple, run_plain) -> triton.Config:  # noqa: ANN001
    """The configuration `kernel`'s tuner chose for a launch without the conv epilogue, at the
    same tuning key (memoised; `run_plain` runs such a launch once, its output unused). The
    epilogue's launch takes it without tuning: a timed run would shift the conv state each
    time."""
    cfg = _CONV_CONFIGS.get(key)
    if cfg is None:
        run_plain()
        cfg = _CONV_CONFIGS[key] = kernel.best_config
    return cfg


def decode_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: triton.Config | None = None,
    conv: ConvEpilogue | None = None,
) -> torch.Tensor:
    """x [1, K] (unit last stride) @ weight [N, K].T (+ bias [N]) -> [1, N] in x's dtype,
    accumulated in float32. `config` (benchmarks): launch that configuration instead of the
    tuner's. `conv`: the first `conv.channels` columns come back as GDN's conv1d + SiLU of
    the product (rounded to the dtype first), the slot's conv state shifted in place, in the
    same launch (the tuner's configuration for the plain product, `tuned_config`)."""
    M, K, N = check_decode_gemm_args(x, weight, 1)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    kernel, fixed = _decode_gemv_kernel, {}
    if conv is not None and config is None:
        key = ("gemv", N, K, x.dtype, weight.dtype, bias is not None, x.device)
        config = tuned_config(_decode_gemv_kernel, key, lambda: decode_gemv(x, weight, bias))
    if config is not None:  # the jitted function under the tuner, with this configuration
        kernel, fixed = _decode_gemv_kernel.fn, config.all_kwargs()
    conv_args, conv_consts = conv_launch_args(conv, weight)
    kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, out, N, weight.stride(0), *conv_args,
        K=K, HAS_BIAS=bias is not None, **conv_consts, **pdl.launch_kwargs(x), **fixed,
    )  # fmt: skip
    return out
