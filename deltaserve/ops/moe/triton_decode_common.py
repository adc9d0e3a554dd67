"""What the MoE decode path's kernels share (deltaserve.ops.moe.triton_decode): the autotune
tables and the slot bookkeeping every program starts with."""

from __future__ import annotations

import triton
import triton.language as tl

from deltaserve import env
from deltaserve.ops.moe.triton_gemm import interpreting

# (BLOCK_N, BLOCK_K, num_warps, num_stages) the decode kernels' autotuner chooses from on the
# GPU (per S_PAD, ROWS, H, INTER). BASE is the original list. At 8 pairs (batch 1, top-8) the
# grid is only 8 x cdiv(I, BLOCK_N) programs for gate_up (256 at I = 512, BLOCK_N 16) and
# 8 x cdiv(H, BLOCK_N) for down, so the bytes each program keeps in flight decide the rate:
# the additions are 2-warp variants (more programs resident per SM), deeper pipelines over
# gate_up's long H reduction, and for down (a short reduction over I) whole-I tiles in one or
# two loads. The tuner measures every entry, so an addition that does not pay is never chosen;
# DELTASERVE_MOE_DECODE_CONFIGS=base restricts it to BASE (the configuration before them).
BASE = (
    (16, 128, 4, 4),
    (16, 256, 4, 3),
    (32, 128, 4, 4),
    (32, 256, 4, 3),
    (32, 64, 4, 6),
    (64, 128, 4, 3),
    (64, 64, 4, 4),
    (16, 512, 4, 2),
)
GATE_UP_EXTRA = ((16, 128, 2, 6), (16, 256, 2, 4), (16, 64, 2, 8), (32, 128, 4, 5))
DOWN_EXTRA = ((16, 512, 2, 1), (32, 512, 4, 2), (64, 256, 4, 2), (16, 256, 2, 2))


# gate_up with H split across programs: (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K);
# each compiles for sm_90 without register spills (tests/ops/test_sm90_compile.py)
GATE_UP_SPLIT = (
    (16, 128, 4, 4, 2),
    (16, 256, 4, 3, 2),
    (16, 128, 4, 4, 4),
    (32, 128, 4, 4, 2),
    (16, 64, 4, 6, 4),
    (16, 128, 4, 6, 2),
)
SPLIT_K_MAX = 4  # the workspace of gate_up's partials is sized for it


def gate_up_configs() -> list[triton.Config]:
    """decode_configs(GATE_UP_EXTRA) (SPLIT_K 1) plus GATE_UP_SPLIT (not with
    DELTASERVE_MOE_DECODE_CONFIGS=base)."""
    if interpreting():
        meta = {"BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 1}
        return [triton.Config(meta, num_warps=4, num_stages=1)]
    configs = decode_configs(GATE_UP_EXTRA)
    for c in configs:
        c.kwargs["SPLIT_K"] = 1
    if env.moe_decode_configs() != "base":
        configs += [
            triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}, num_warps=w, num_stages=s)
            for bn, bk, w, s, sk in GATE_UP_SPLIT
        ]
    return configs


def decode_configs(extra: tuple[tuple[int, int, int, int], ...]) -> list[triton.Config]:
    """The autotuner's list: BASE plus `extra` (BASE only with
    DELTASERVE_MOE_DECODE_CONFIGS=base); one small configuration under the interpreter."""
    if interpreting():
        return [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    table = BASE if env.moe_decode_configs() == "base" else BASE + extra
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in table
    ]


@triton.jit
def slot_rows(ids_ptr, num_pairs, S_PAD: tl.constexpr):
    """(the slots before s routed to s's expert (0: s is its first), that expert's id as
    int64, the mask of all slots routed to it [S_PAD], its running count - 1 [S_PAD], the
    number of slots routed to it)."""
    s = tl.program_id(0)
    offs = tl.arange(0, S_PAD)
    in_range = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1)
    e = tl.load(ids_ptr + s)
    mine = in_range & (ids == e)
    earlier = tl.sum(((offs < s) & mine).to(tl.int32), axis=0)
    place = tl.cumsum(mine.to(tl.int32), axis=0) - 1
    return earlier, e.to(tl.int64), mine, place, tl.sum(mine.to(tl.int32), axis=0)


@triton.jit
def chunk_slots(mine, place, r0, ROWS: tl.constexpr, S_PAD: tl.constexpr):
    """The slots of rows r0 .. r0 + ROWS - 1 of this expert, compacted: (slot ids [ROWS] int64,
    valid [ROWS]). Row r is the slot whose running count - 1 is r."""
    want = r0 + tl.arange(0, ROWS)
    hit = mine[None, :] & (place[None, :] == want[:, None])  # [ROWS, S_PAD]
    slots = tl.sum(tl.where(hit, tl.arange(0, S_PAD)[None, :], 0), axis=1)
    return slots.to(tl.int64), tl.sum(hit.to(tl.int32), axis=1) > 0
