"""A mixer's output gate fused into the decode GEMM's x loads: `out = gate(o, z) @ W.T` in one
launch instead of an elementwise kernel and the GEMM, for the projection that ends each mixer.

Two gates (`GATES`), both per row and per head, so a program computes them on the x tiles it
loads, with no reduction across programs (unlike a residual RMSNorm, whose statistics span the
whole row: ops/linear/triton_norm_gemm.py re-reduces it in every program):

- "gated_norm", GDN's output norm before out_proj: `w * rmsnorm(o) * silu(z)` over each head of
  `head` channels (ops/fused/gated_norm.py's math and roundings: float32 statistics, `w *
  norm(o)` rounded to o's dtype, times silu(z) in float32, rounded). Every K tile holds whole
  heads (BLOCK_K a multiple of the head size), so the tile's per-head sums of squares are the
  head's;
- "sigmoid", gated attention's output gate before o_proj: `o * sigmoid(z)`, the sigmoid rounded
  to z's dtype (ops/fused/activation.py's `sigmoid_gate_mul`).

Why: at decode batch 1 each of these elementwise kernels is a launch of a few microseconds
between the mixer's core and its last projection, one per layer (40 a step on the 35B-A3B, 32 on
the 9B).

The kernel is the base decode GEMM's (triton_gemm.py: one program per BLOCK_N output columns,
K walked in BLOCK_K steps, x padded to BLOCK_M rows inside the tile, one tensor-core dot per
step, the first W tile loaded before the PDL wait). o and z are read through row and head
strides (o [T, H, head] from the core; z a strided view of the mixer's input projection), and
the output has `rows` >= T rows: rows past T are zero, as the padded rows of the unfused path
(`ForwardContext.padded_out`). Every program reads all of o and z (16 KB per program at batch 1
on the 35B-A3B's out_proj, from L2).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.autotune import autotune
from deltaserve.ops.fused._common import silu_f32
from deltaserve.ops.linear import WIDE_MAX_ROWS, interpreting

GATES = {"gated_norm": 1, "sigmoid": 2}
DTYPES = (torch.bfloat16, torch.float16)
# the widest head a gated-norm tile holds (BLOCK_K of the configurations below reaches 512)
MAX_NORM_HEAD = 256


# (BLOCK_N, BLOCK_K, num_warps, num_stages): those that compile for sm_90 without spills at
# both gates (tests/ops/test_gated_gemm_sm90_compile.py). The gate math holds the [BLOCK_M,
# BLOCK_K] o and z tiles in float32 registers, so BLOCK_K stays at 128-256 (8 warps at 256; the
# base kernel goes to 1024).
_TILES_16 = (
    (16, 128, 4, 4),
    (16, 128, 4, 6),
    (32, 128, 4, 4),
    (32, 128, 4, 6),
    (64, 128, 4, 4),
    (64, 128, 8, 4),
    (16, 256, 8, 4),
    (32, 256, 8, 3),
    (16, 128, 2, 6),
)
_TILES_WIDE = (
    (16, 128, 4, 4),
    (32, 128, 4, 4),
    (32, 128, 8, 4),
    (64, 128, 8, 3),
    (32, 256, 8, 3),
)
# one token (ONE_ROW: the gate computed on its row only): the base kernel's choices at one row
# on these shapes (2 warps, deep pipelines) and their neighbours
_TILES_1 = (
    (16, 256, 2, 6),
    (16, 256, 2, 4),
    (16, 128, 2, 6),
    (16, 512, 2, 3),
    (16, 256, 4, 4),
    (32, 256, 4, 4),
    (16, 512, 4, 3),
)
TILE_LISTS = {"one_row": 0, "16_rows": 1, "wide": 2}


def _config(bn: int, bk: int, warps: int, stages: int, tiles: str) -> triton.Config:
    meta = {"BLOCK_N": bn, "BLOCK_K": bk, "TILE_LIST": TILE_LISTS[tiles]}
    return triton.Config(meta, num_warps=warps, num_stages=stages)


@functools.cache
def _configs() -> list[triton.Config]:
    if interpreting():  # one configuration (the tuner then runs it untimed), any rows and head
        return [_config(16, MAX_NORM_HEAD, 4, 1, "16_rows")]
    return (
        [_config(*t, "one_row") for t in _TILES_1]
        + [_config(*t, "16_rows") for t in _TILES_16]
        + [_config(*t, "wide") for t in _TILES_WIDE]
    )


def _prune(configs: list, named_args: dict, **kwargs) -> list:  # noqa: ANN001
    """Triton's early pruning hook: the one-row list for one token, the 16-row list at BLOCK_M
    16, the wide one above; for the gated norm, only tiles of whole heads."""
    if len(configs) == 1:  # the interpreter's
        return configs
    if kwargs["ONE_ROW"]:
        tiles = "one_row"
    else:
        tiles = "wide" if kwargs["BLOCK_M"] > 16 else "16_rows"
    head = kwargs["HEAD"]
    norm = kwargs["GATE"] == GATES["gated_norm"]
    return [
        c
        for c in configs
        if c.kwargs["TILE_LIST"] == TILE_LISTS[tiles]
        and (not norm or (c.kwargs["BLOCK_K"] >= head and c.kwargs["BLOCK_K"] % head == 0))
    ]


@triton.jit
def _gate(
    of, zf, nw_ptr, cols, eps, dtype, GATE: tl.constexpr, HEAD: tl.constexpr, AXIS: tl.constexpr
):
    """The gate on float32 o and z tiles whose last axis (AXIS) is `cols` of one head (the
    whole head for the gated norm), rounded to `dtype`."""
    if GATE == 1:
        rstd = tl.rsqrt(tl.sum(of * of, axis=AXIS, keep_dims=True) / HEAD + eps)
        on = (of * rstd).to(dtype).to(tl.float32)
        y = (tl.load(nw_ptr + cols).to(tl.float32) * on).to(dtype).to(tl.float32)
        return (y * silu_f32(zf)).to(dtype)
    else:
        sg = (1.0 / (1.0 + tl.exp(-zf))).to(dtype).to(tl.float32)
        return (of * sg).to(dtype)


@triton.jit
def _gated_row(
    o_ptr,
    z_ptr,
    nw_ptr,
    k0,
    K,
    stride_oh,
    stride_zh,
    eps,
    GATE: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Row 0's gated x [BLOCK_K] of columns k0 .. k0 + BLOCK_K in o's dtype (columns from K on
    zero): `_gated_tile`'s loads and math on one row."""
    dtype = o_ptr.dtype.element_ty
    if BLOCK_K <= HEAD:
        cols = (k0 // BLOCK_K) % (HEAD // BLOCK_K) * BLOCK_K + tl.arange(0, BLOCK_K)
        head = k0 // HEAD
        ok = (k0 < K) & (cols < HEAD)
        of = tl.load(o_ptr + head * stride_oh + cols, mask=ok, other=0.0).to(tl.float32)
        zf = tl.load(z_ptr + head * stride_zh + cols, mask=ok, other=0.0).to(tl.float32)
        return _gate(of, zf, nw_ptr, cols, eps, dtype, GATE, HEAD, 0)
    else:
        NH: tl.constexpr = BLOCK_K // HEAD
        heads = k0 // HEAD + tl.arange(0, NH)
        cols = tl.arange(0, HEAD)[None, :]
        mask = (heads < K // HEAD)[:, None]
        of = tl.load(o_ptr + (heads * stride_oh)[:, None] + cols, mask=mask, other=0.0)
        zf = tl.load(z_ptr + (heads * stride_zh)[:, None] + cols, mask=mask, other=0.0)
        x = _gate(of.to(tl.float32), zf.to(tl.float32), nw_ptr, cols, eps, dtype, GATE, HEAD, 1)
        return tl.reshape(x, (BLOCK_K,))  # [NH * HEAD]


@triton.jit
def _gated_tile(
    o_ptr,
    z_ptr,
    nw_ptr,
    offs_m,
    k0,
    T,
    K,
    stride_ot,
    stride_oh,
    stride_zt,
    stride_zh,
    eps,
    GATE: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_ROW: tl.constexpr,
):
    """The gated x tile [BLOCK_M, BLOCK_K] of columns k0 .. k0 + BLOCK_K, in o's dtype (rows
    from T on, and columns from K on, are zero). A tile within one head (BLOCK_K <= HEAD) is
    one 2-D load; a tile of NH > 1 whole heads is loaded as [BLOCK_M, NH, HEAD] (the gated
    norm reduces each head). ONE_ROW (T == 1): the gate on row 0 alone, placed in row 0 of the
    tile (on all BLOCK_M rows the gate math, repeated by every program, made the kernel 2-5x
    slower than the gate kernel and the GEMM). Offsets are int32: o and z are a step's
    activations (at most 64 rows of a projection's output)."""
    dtype = o_ptr.dtype.element_ty
    if ONE_ROW:
        xr = _gated_row(o_ptr, z_ptr, nw_ptr, k0, K, stride_oh, stride_zh, eps, GATE, HEAD, BLOCK_K)
        return tl.where(offs_m[:, None] == 0, xr[None, :], 0.0).to(dtype)
    row_ok = offs_m < T
    if BLOCK_K <= HEAD:  # k0 is a multiple of BLOCK_K: the tile lies in head k0 // HEAD
        # k0 % HEAD written as a multiple of BLOCK_K, so the compiler sees the loads aligned
        # and vectorised (the pipeliner then streams them like W's)
        cols = (k0 // BLOCK_K) % (HEAD // BLOCK_K) * BLOCK_K + tl.arange(0, BLOCK_K)
        head = k0 // HEAD
        mask = row_ok[:, None] & (k0 < K)
        o_offs = offs_m[:, None] * stride_ot + head * stride_oh + cols[None, :]
        z_offs = offs_m[:, None] * stride_zt + head * stride_zh + cols[None, :]
        of = tl.load(o_ptr + o_offs, mask=mask, other=0.0).to(tl.float32)
        zf = tl.load(z_ptr + z_offs, mask=mask, other=0.0).to(tl.float32)
        return _gate(of, zf, nw_ptr, cols[None, :], eps, dtype, GATE, HEAD, 1)
    else:
        NH: tl.constexpr = BLOCK_K // HEAD
        heads = k0 // HEAD + tl.arange(0, NH)
        cols = tl.arange(0, HEAD)[None, None, :]
        mask = row_ok[:, None, None] & (heads < K // HEAD)[None, :, None]
        o_offs = offs_m[:, None, None] * stride_ot + (heads * stride_oh)[None, :, None] + cols
        z_offs = offs_m[:, None, None] * stride_zt + (heads * stride_zh)[None, :, None] + cols
        of = tl.load(o_ptr + o_offs, mask=mask, other=0.0).to(tl.float32)
        zf = tl.load(z_ptr + z_offs, mask=mask, other=0.0).to(tl.float32)
        x = _gate(of, zf, nw_ptr, cols, eps, dtype, GATE, HEAD, 2)
        return tl.reshape(x, (BLOCK_M, BLOCK_K))  # [BLOCK_M, NH * HEAD]


@triton.jit
def _gated_step(
    acc,
    o_ptr,
    z_ptr,
    nw_ptr,
    w_rows,
    offs_m,
    k0,
    T,
    K,
    stride_ot,
    stride_oh,
    stride_zt,
    stride_zh,
    eps,
    n_mask,
    GATE: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_ROW: tl.constexpr,
):
    """acc [BLOCK_M, BLOCK_N] += gate(o, z)[:, k] @ W[n, k].T for the K tile at k0."""
    k = k0 + tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0)
    x = _gated_tile(
        o_ptr, z_ptr, nw_ptr, offs_m, k0, T, K, stride_ot, stride_oh, stride_zt, stride_zh,
        eps, GATE, HEAD, BLOCK_M, BLOCK_K, ONE_ROW,
    )  # fmt: skip
    return tl.dot(x, tl.trans(w), acc)


@autotune(configs=_configs(), key=["N", "K", "BLOCK_M", "GATE", "HEAD", "ONE_ROW"], prune=_prune)
@triton.jit
def _gated_gemm_kernel(
    o_ptr,
    z_ptr,
    nw_ptr,
    w_ptr,
    out_ptr,
    T,
    R,
    N,
    K,
    stride_ot,
    stride_oh,
    stride_zt,
    stride_zh,
    stride_wn,
    stride_om,
    eps,
    GATE: tl.constexpr,
    HEAD: tl.constexpr,
    ONE_ROW: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILE_LIST: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N),): out[:R, n tile] = gate(o, z)[:R] @ W[n tile].T; o and z hold T
    <= R rows (the rest are zero)."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_first = 0
    if PDL:  # the first W tile is loaded while the previous kernel finishes (ops/pdl.py)
        k = tl.arange(0, BLOCK_K)
        w0 = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0)
        pdl.wait(PDL)
        x0 = _gated_tile(
            o_ptr, z_ptr, nw_ptr, offs_m, 0, T, K, stride_ot, stride_oh, stride_zt, stride_zh,
            eps, GATE, HEAD, BLOCK_M, BLOCK_K, ONE_ROW,
        )  # fmt: skip
        acc = tl.dot(x0, tl.trans(w0), acc)
        k_first = BLOCK_K
    if INTERPRET:
        # NOTE: the interpreter (with numpy >= 2.4) cannot take `range` over a runtime bound
        k0 = k_first
        while k0 < K:
            acc = _gated_step(
                acc, o_ptr, z_ptr, nw_ptr, w_rows, offs_m, k0, T, K, stride_ot, stride_oh,
                stride_zt, stride_zh, eps, n_mask, GATE, HEAD, BLOCK_M, BLOCK_K, ONE_ROW,
            )  # fmt: skip
            k0 += BLOCK_K
    else:
        for k0 in tl.range(k_first, K, BLOCK_K):
            acc = _gated_step(
                acc, o_ptr, z_ptr, nw_ptr, w_rows, offs_m, k0, T, K, stride_ot, stride_oh,
                stride_zt, stride_zh, eps, n_mask, GATE, HEAD, BLOCK_M, BLOCK_K, ONE_ROW,
            )  # fmt: skip
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < R)[:, None] & n_mask[None, :])


def gate_unsupported(gate: str, head: int, dtype: torch.dtype) -> str | None:
    """Why `gated_decode_gemm` cannot serve this gate at this head size and dtype, or None."""
    if gate not in GATES:
        return f"unknown gate {gate!r} (one of {sorted(GATES)})"
    if dtype not in DTYPES:
        return f"dtype {dtype} (bf16 / fp16 only)"
    if gate == "gated_norm" and (head & (head - 1) or head > MAX_NORM_HEAD):
        return f"a gated-norm head of {head} channels (a power of two up to {MAX_NORM_HEAD})"
    if head & (head - 1):
        return f"a head of {head} channels (a power of two)"
    return None


def gated_decode_gemm(
    gate: str,
    o: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    rows: int,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """gate(o, z) @ weight.T -> [rows, N] in o's dtype, accumulated in float32.

    gate: "gated_norm" (`w * rmsnorm(o) * silu(z)` per head, norm_weight [head] and eps) or
        "sigmoid" (`o * sigmoid(z)`).
    o: [T, H, head] with a unit last stride (T <= rows <= WIDE_MAX_ROWS); z: o's shape and
        dtype, any unit-last-stride view (e.g. columns of a projection's output).
    weight: [N, H * head], unit last stride. Output rows from T on are zero.
    """
    if o.dim() != 3 or z.shape != o.shape:
        raise ValueError(f"o {tuple(o.shape)} must be [T, H, head] and z {tuple(z.shape)} alike")
    T, H, head = o.shape
    K = H * head
    N = weight.shape[0]
    why = gate_unsupported(gate, head, o.dtype)
    if why is not None:
        raise ValueError(f"gated_decode_gemm cannot serve {why}")
    if weight.shape[1] != K or z.dtype != o.dtype or weight.dtype != o.dtype:
        raise ValueError(
            f"weight {tuple(weight.shape)} {weight.dtype} does not take o {tuple(o.shape)} "
            f"{o.dtype} (z {z.dtype})"
        )
    if not T <= rows <= WIDE_MAX_ROWS:
        raise ValueError(f"rows must be in [T, {WIDE_MAX_ROWS}] = [{T}, ...], got {rows}")
    if o.stride(-1) != 1 or z.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("gated_decode_gemm needs a unit last stride on o, z and weight")
    if gate == "gated_norm":
        if norm_weight is None or norm_weight.shape != (head,) or norm_weight.stride(0) != 1:
            raise ValueError(f"the gated norm needs a contiguous [{head}] weight")
    out = torch.empty(rows, N, dtype=o.dtype, device=o.device)
    if rows == 0:
        return out

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]),)

    _gated_gemm_kernel[grid](
        o,
        z,
        norm_weight if norm_weight is not None else weight,
        weight,
        out,
        T,
        rows,
        N,
        K,
        o.stride(0),
        o.stride(1),
        z.stride(0),
        z.stride(1),
        weight.stride(0),
        out.stride(0),
        float(eps),
        GATE=GATES[gate],
        HEAD=head,
        ONE_ROW=T == 1,
        INTERPRET=interpreting(),
        **pdl.launch_kwargs(o),
        BLOCK_M=max(16, triton.next_power_of_2(rows)),
    )
    return out


def gated_decode_gemm_torch(
    gate: str,
    o: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    rows: int,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """The reference: the unfused ops (ops/fused/reference.py) then F.linear, the rows from T on
    zero."""
    from deltaserve.ops.fused import reference

    if gate == "gated_norm":
        x = reference.gated_rms_norm(o, z, norm_weight, eps)
    else:
        x = reference.sigmoid_gate_mul(o, z)
    y = torch.nn.functional.linear(x.reshape(o.shape[0], -1), weight)
    out = y.new_zeros(rows, weight.shape[0])
    out[: o.shape[0]] = y
    return out
