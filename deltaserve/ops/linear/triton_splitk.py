"""Triton decode GEMM with split-K in one launch: out[M, N] = x[M, K] @ W[N, K].T (+ bias),
M <= 64, bf16 / fp16.

Why: at a hidden size of 2048 many projections have few output columns (a MoE block's fused
in_proj, N = 1281: 81 tiles of 16 columns; o_proj / out_proj, N = 2048: 128 tiles), fewer
programs than an H200 has SMs, so one program per column tile leaves SMs idle and keeps too few
bytes in flight to stream W at the copy rate. Here the grid is (column tiles, SPLIT_K): each
program streams its columns over one K slice and writes a float32 partial to a workspace
[SPLIT_K, M, N]; the last program of a column tile to arrive (a per-tile arrival counter,
atomic, deltaserve.ops.tile_counters) sums the SPLIT_K partials in split order (a fixed order:
the result does not depend on which program finishes last), adds the bias, writes the output
and resets its counter to 0, so the counters are ready for the next call (and a CUDA-graph
replay) without a memset launch.

Each program's inner step is either a tensor-core `tl.dot` with x's rows padded to 16 (the base
kernel's step) or, for M <= 4, CUDA-core FMAs into a [M, BLOCK_N, BLOCK_K] float32 tile summed
over K once at the end (`fma`). The configuration is chosen once per (M, N, K) from the shape
and the SM count (`choose_config`, cached: no autotuning per call); `deltaserve bench kernels
--only gemm --gemm-sweep` times the alternatives on the GPU. The `triton` decode GEMM backend
runs this kernel only with DELTASERVE_DECODE_GEMM_KERNEL=splitk, where the chosen
configuration splits K or x has more than 16 rows (the autotuned base kernel measured faster:
triton_gemm.decode_gemm).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.linear import WIDE_MAX_ROWS, interpreting
from deltaserve.ops.linear.triton_gemm import check_decode_gemm_args
from deltaserve.ops.tile_counters import arrival_counters

SPLIT_K_MAX = 8


@dataclass(frozen=True)
class SplitKConfig:
    """One configuration of the split-K decode GEMM."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    fma: bool = False  # CUDA-core FMA tile (M <= 4) instead of a tensor-core dot
    prefetch: bool = False  # (FMA) the next K tile's loads issued before the current's math

    def describe(self) -> str:
        kind = ("fma" if self.fma else "dot") + (" prefetch" if self.prefetch else "")
        return (
            f"BLOCK_N {self.block_n}, BLOCK_K {self.block_k}, SPLIT_K {self.split_k}, "
            f"{kind}, warps {self.num_warps}, stages {self.num_stages}"
        )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """The device's SM count (132 on an H200 / H100 SXM; 8 stands in on CPU)."""
    if device.type != "cuda":
        return 8
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def choose_config(m: int, n: int, k: int, sms: int) -> SplitKConfig:
    """The configuration for x [m, k] @ W [n, k].T on a device of `sms` SMs: 16 columns per
    program (32 from N = 8192), K in steps of 256, and, only where there are fewer column tiles
    than SMs, the K axis split in two, four or eight until there are at least 2 programs per
    SM, while every split keeps at least one full K step. Above 16 rows (the wide tiles), the
    fastest of `scripts/probe_wide_gemm.py --sweep` at 64 rows on an H100: K in steps of 128,
    not split (the float32 partials grow with the rows: splits of 2 and 4 were 5-40% slower),
    32 columns per program, 64 from N = 8192 (each program reads all of x's rows over K: wider
    tiles read them fewer times)."""
    block_n = 16 if n < 8192 else 32
    block_k = 256 if k >= 256 else max(16, triton.next_power_of_2(k))
    if m > 16:  # measured (probe_wide_gemm.py; docs/results/wide-gemm-h100.json): no split wins
        block_k = 128 if k >= 128 else max(16, triton.next_power_of_2(k))
        return SplitKConfig(64 if n >= 8192 else 32, block_k, 1)
    tiles = triton.cdiv(n, block_n)
    split = 1
    if tiles < sms:
        while split < SPLIT_K_MAX and tiles * split < 2 * sms and k // (2 * split) >= block_k:
            split *= 2
    return SplitKConfig(block_n, block_k, split)


def runs_splitk(cfg: SplitKConfig, m: int) -> bool:
    """Whether the `splitk` decode GEMM runs this kernel for m rows with `cfg` (it splits K,
    or m is past the base kernel's 16 rows), else the base kernel."""
    return cfg.split_k > 1 or m > 16


_cached_config = functools.cache(choose_config)


def config_for(x: torch.Tensor, weight: torch.Tensor) -> SplitKConfig:
    """`choose_config` for x [M, K] @ weight [N, K].T on x's device (cached per shape)."""
    return _cached_config(x.shape[0], weight.shape[0], weight.shape[1], num_sms(x.device))


# Shared memory a swept configuration may ask for: an H100 / H200 block gets 227 KiB; this
# leaves room for Triton's own scratch.
SWEEP_SMEM_BYTES = 200 * 1024


def smem_estimate(cfg: SplitKConfig, itemsize: int = 2, m: int = 16) -> int:
    """Bytes of shared memory the pipelined loads of `cfg` need for m rows: num_stages - 1
    buffers of a W tile [block_n, block_k] and an x tile padded to 16, 32 or 64 rows (the FMA
    tile keeps x in registers). On sm_90 Triton asked 245,760 bytes for BLOCK_N 64, BLOCK_K 512,
    4 stages: this formula."""
    rows = cfg.block_n + (0 if cfg.fma else dot_rows(m))
    return max(1, cfg.num_stages - 1) * rows * cfg.block_k * itemsize


def sweep_configs(m: int, n: int, k: int) -> list[SplitKConfig]:
    """The alternatives `bench kernels --gemm-sweep` times for one shape (FMA tiles, with
    PREFETCH, only for m <= 4; splits that leave every slice at least one K step; tiles whose
    pipelined loads fit SWEEP_SMEM_BYTES)."""
    out = []
    for fma in (False, True) if m <= 4 else (False,):
        for block_n in (16, 32, 64):
            for block_k in (128, 256, 512):
                for split in (1, 2, 4, 8):
                    if k // split < block_k or (fma and block_n * block_k > 8192):
                        continue
                    cfg = SplitKConfig(block_n, block_k, split, 4, 4, fma, prefetch=fma)
                    if smem_estimate(cfg, m=m) <= SWEEP_SMEM_BYTES:
                        out.append(cfg)
    return out


def dot_rows(m: int) -> int:
    """The rows x is padded to in the dot step: 16, 32 or 64."""
    return max(16, triton.next_power_of_2(m))


@triton.jit
def _load_tiles(x_rows, w_rows, k, k_hi, m_mask, n_mask):
    """x[:, k] [M_PAD, BLOCK_K] and W[n, k] [BLOCK_N, BLOCK_K] (zeros past k_hi: a tile wholly
    past it moves no bytes)."""
    k_mask = k < k_hi
    x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    return x, w


@triton.jit
def _accumulate(acc, x, w, FMA: tl.constexpr):
    """acc += x * W over one K tile (FMA: into a [M, BLOCK_N, BLOCK_K] tile summed over K
    later; else a tensor-core dot into [16, BLOCK_N])."""
    if FMA:
        acc = acc + x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    else:
        acc = acc + tl.dot(x, tl.trans(w))
    return acc


@triton.jit
def _decode_gemm_splitk_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    K_SPLIT,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
    FMA: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
    M_PAD: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N), SPLIT_K). M_PAD: M rounded up to a power of two, at least 16
    for the dot step (`dot_rows`), at most 4 for FMA. K_SPLIT: a multiple of BLOCK_K,
    SPLIT_K * K_SPLIT >= K."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, M_PAD)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    if FMA:
        acc = tl.zeros((M_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    # NOTE: Triton (3.6, sm_90) pipelines the dot step's loads through shared memory (async
    # copies, num_stages deep) but not the FMA step's (checked in the compiled IR), so one K
    # tile per program would be all an FMA program has in flight; with PREFETCH the next tile's
    # loads are issued before the current tile's math (two in flight; it also turns the dot
    # step's async pipeline off, so it is for the FMA step). The last prefetch lies past k_hi:
    # fully masked, no traffic. The interpreter (numpy >= 2.4) cannot take `range` over a
    # runtime bound: while loops there.
    k_start = k_lo
    if PDL:  # the first W tile is loaded while the previous kernel finishes (ops/pdl.py)
        k0_mask = (k_lo + offs_k) < k_hi
        w_first = tl.load(
            w_rows + (k_lo + offs_k)[None, :], mask=n_mask[:, None] & k0_mask[None, :], other=0.0
        )
        pdl.wait(PDL)
        x_first = tl.load(
            x_rows + (k_lo + offs_k)[None, :], mask=m_mask[:, None] & k0_mask[None, :], other=0.0
        )
        if not PREFETCH:
            acc = _accumulate(acc, x_first, w_first, FMA)
            k_start = k_lo + BLOCK_K
    if PREFETCH:
        if PDL:
            x_cur, w_cur = x_first, w_first
        else:
            x_cur, w_cur = _load_tiles(x_rows, w_rows, k_lo + offs_k, k_hi, m_mask, n_mask)
        if INTERPRET:
            k0 = k_lo + BLOCK_K
            while k0 < k_hi + BLOCK_K:
                x_nxt, w_nxt = _load_tiles(x_rows, w_rows, k0 + offs_k, k_hi, m_mask, n_mask)
                acc = _accumulate(acc, x_cur, w_cur, FMA)
                x_cur, w_cur = x_nxt, w_nxt
                k0 += BLOCK_K
        else:
            for k0 in tl.range(k_lo + BLOCK_K, k_hi + BLOCK_K, BLOCK_K):
                x_nxt, w_nxt = _load_tiles(x_rows, w_rows, k0 + offs_k, k_hi, m_mask, n_mask)
                acc = _accumulate(acc, x_cur, w_cur, FMA)
                x_cur, w_cur = x_nxt, w_nxt
    else:
        if INTERPRET:
            k0 = k_start
            while k0 < k_hi:
                x, w = _load_tiles(x_rows, w_rows, k0 + offs_k, k_hi, m_mask, n_mask)
                acc = _accumulate(acc, x, w, FMA)
                k0 += BLOCK_K
        else:
            for k0 in tl.range(k_start, k_hi, BLOCK_K):
                x, w = _load_tiles(x_rows, w_rows, k0 + offs_k, k_hi, m_mask, n_mask)
                acc = _accumulate(acc, x, w, FMA)
    if FMA:
        part = tl.sum(acc, axis=2)  # [M_PAD, BLOCK_N]
    else:
        part = acc
    mask = m_mask[:, None] & n_mask[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            part += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out, part.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws = ws_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(ws, part, mask=mask)
        # NOTE: every thread's partial is stored before the (single-thread) release below
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last of this tile: sum the partials in split order
            total = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                row = (s * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
                total += tl.load(ws_ptr + row, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next call


def decode_gemm_splitk(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SplitKConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (unit last stride, M <= WIDE_MAX_ROWS) @ weight [N, K].T (+ bias [N]) -> [M, N]
    in x's dtype, accumulated in float32. `config`: None chooses it from the shape
    (`choose_config`); tests and the sweep pass one."""
    M, K, N = check_decode_gemm_args(x, weight, WIDE_MAX_ROWS)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    cfg = config or config_for(x, weight)
    if cfg.fma and M > 4:
        raise ValueError(f"the FMA tile serves at most 4 rows, got {M}")
    if cfg.block_n < 16 or cfg.split_k < 1 or cfg.split_k > SPLIT_K_MAX:
        raise ValueError(f"bad split-K configuration: {cfg}")
    k_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_split)  # every slice non-empty
    ws = out
    if split > 1:
        ws = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    m_pad = triton.next_power_of_2(M) if cfg.fma else dot_rows(M)
    counters = arrival_counters("splitk", weight, triton.cdiv(N, 16)) if split > 1 else out
    _decode_gemm_splitk_kernel[(triton.cdiv(N, cfg.block_n), split)](
        x, weight, bias if bias is not None else weight, out, ws, counters, M, N, K, k_split,
        x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        INTERPRET=interpreting(),
        FMA=cfg.fma, PREFETCH=cfg.prefetch, M_PAD=m_pad, SPLIT_K=split, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.launch_kwargs(x),
    )  # fmt: skip
    return out
