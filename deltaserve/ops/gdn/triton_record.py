"""Fused Triton save of one GDN layer's verify-step scratch (spec/gdn_rollback.py).

`GDNVerifyScratch.record` in torch takes about ten launches per layer (two index_select /
index_copy pairs for the conv and SSM states, three row gathers, a cat, a cast and an
index_copy for the records). `gdn_record_fused` does all of it in ONE launch whose programs
fall into three ranges:

- SSM state: ssm_state[dst[r]] = ssm_state[src[r]], BLOCK elements a program;
- conv state: conv_state[dst[r]] = conv_state[src[r]], BLOCK elements a program;
- records: records[record_rows[m]] = [qkv | b | a][token_rows[m]] cast to the records' dtype.

Everything is read on the device (CUDA-graph safe). Bytes: 2 x (HV V K x 4) per row for the SSM
state (2 x 2 MiB at 9B shapes), small beside the step's weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _record_kernel(
    ssm_ptr,  # [num_slots, S] flat rows
    conv_ptr,  # [num_slots, CS] flat rows
    src_ptr,  # [R] int64
    dst_ptr,  # [R] int64
    qkv_ptr,  # [T, C] (row stride stride_x)
    b_ptr,  # [T, HV] (row stride stride_b)
    a_ptr,  # [T, HV] (row stride stride_a)
    token_rows_ptr,  # [M] int64
    record_rows_ptr,  # [M] int64
    rec_ptr,  # [rows, C + 2 HV]
    stride_ssm,
    stride_conv,
    stride_x,
    stride_b,
    stride_a,
    stride_rec,
    S: tl.constexpr,
    CS: tl.constexpr,
    C: tl.constexpr,
    HV: tl.constexpr,
    P_SSM: tl.constexpr,  # programs per row for the SSM state
    P_CONV: tl.constexpr,  # programs per row for the conv state
    P_REC: tl.constexpr,  # programs per token row for the records
    R,  # rows (runtime: no compile per row count)
    BLOCK: tl.constexpr,
):
    """Grid (R * P_SSM + R * P_CONV + M * P_REC,)."""
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    # NOTE: Triton types a name once across the branches: each branch names its own values
    # (the SSM state is float32, the conv state and inputs the model's dtype)
    if pid < R * P_SSM:
        r = pid // P_SSM
        cols = (pid % P_SSM) * BLOCK + offs
        mask = cols < S
        src = tl.load(src_ptr + r).to(tl.int64)
        dst = tl.load(dst_ptr + r).to(tl.int64)
        ssm = tl.load(ssm_ptr + src * stride_ssm + cols, mask=mask)
        tl.store(ssm_ptr + dst * stride_ssm + cols, ssm, mask=mask)
    elif pid < R * (P_SSM + P_CONV):
        p = pid - R * P_SSM
        r = p // P_CONV
        cols = (p % P_CONV) * BLOCK + offs
        mask = cols < CS
        src = tl.load(src_ptr + r).to(tl.int64)
        dst = tl.load(dst_ptr + r).to(tl.int64)
        conv = tl.load(conv_ptr + src * stride_conv + cols, mask=mask)
        tl.store(conv_ptr + dst * stride_conv + cols, conv, mask=mask)
    else:
        p = pid - R * (P_SSM + P_CONV)
        m = p // P_REC
        cols = (p % P_REC) * BLOCK + offs
        row = tl.load(token_rows_ptr + m).to(tl.int64)
        out = tl.load(record_rows_ptr + m).to(tl.int64)
        in_x = cols < C
        in_b = (cols >= C) & (cols < C + HV)
        in_a = (cols >= C + HV) & (cols < C + 2 * HV)
        xin = tl.load(qkv_ptr + row * stride_x + cols, mask=in_x, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + (cols - C), mask=in_b, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + row * stride_a + (cols - C - HV), mask=in_a, other=0.0)
        val = tl.where(in_x, xin, tl.where(in_b, b, a.to(tl.float32)))
        tl.store(
            rec_ptr + out * stride_rec + cols,
            val.to(rec_ptr.dtype.element_ty),
            mask=cols < C + 2 * HV,
        )


def gdn_record_fused(
    conv_state: torch.Tensor,  # [num_slots, C, W - 1]
    ssm_state: torch.Tensor,  # [num_slots, HV, V, K]
    src_slots: torch.Tensor,  # [R] int64
    dst_slots: torch.Tensor,  # [R] int64
    mixed_qkv: torch.Tensor,  # [T, C]
    b: torch.Tensor,  # [T, HV]
    a: torch.Tensor,  # [T, HV]
    token_rows: torch.Tensor,  # [M] int64
    record_rows: torch.Tensor,  # [M] int64
    records: torch.Tensor,  # [rows, C + 2 HV]
) -> None:
    """Copy each row's conv and SSM state from src to dst and the draft tokens' inputs into
    their record rows, in one launch (the module docstring). No dst may be a src."""
    C, HV = mixed_qkv.shape[-1], b.shape[-1]
    if records.shape[-1] != C + 2 * HV or a.shape[-1] != HV:
        raise ValueError(f"records {tuple(records.shape)} for C={C}, HV={HV}")
    for name, t in (("conv_state", conv_state), ("ssm_state", ssm_state), ("records", records)):
        if not t[0].is_contiguous():
            raise ValueError(f"{name} rows must be contiguous")
    for name, t in (("mixed_qkv", mixed_qkv), ("b", b), ("a", a)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be unit-stride in its last dim")
    R, M = src_slots.shape[0], token_rows.shape[0]
    if R == 0 and M == 0:
        return
    S = ssm_state[0].numel()
    CS = conv_state[0].numel()
    block = 2048
    p_ssm, p_conv = triton.cdiv(S, block), triton.cdiv(CS, block)
    p_rec = triton.cdiv(C + 2 * HV, block)
    grid = (R * (p_ssm + p_conv) + M * p_rec,)
    _record_kernel[grid](
        ssm_state, conv_state, src_slots, dst_slots, mixed_qkv, b, a, token_rows, record_rows,
        records,
        ssm_state.stride(0), conv_state.stride(0), mixed_qkv.stride(0), b.stride(0),
        a.stride(0), records.stride(0),
        S=S, CS=CS, C=C, HV=HV, P_SSM=p_ssm, P_CONV=p_conv, P_REC=p_rec, R=R, BLOCK=block,
        num_warps=4,
    )  # fmt: skip
