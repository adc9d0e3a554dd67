"""Every tuner configuration of the gated decode GEMM (ops/linear/triton_gated_gemm.py) compiles
for sm_90 on CPU (sm90_compile.py) at both gates, the models' head sizes and each of its three
tile lists (one token, up to 16 rows, up to 64): no register
spills, the o and z tiles pipelined through shared memory like W's (three async copies a
stage), and under programmatic dependent launch only the first W tile loaded before the wait,
nothing stored."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sm90_compile import compile_many, ptxas_path  # noqa: E402

pytestmark = pytest.mark.skipif(
    ptxas_path() is None, reason="this Triton has no NVIDIA backend / ptxas"
)

SIG = {
    **{p: "*bf16" for p in ("o_ptr", "z_ptr", "nw_ptr", "w_ptr", "out_ptr")},
    **{
        i: "i32"
        for i in ("T", "R", "N", "K", "stride_ot", "stride_oh", "stride_zt", "stride_zh")
        + ("stride_wn", "stride_om")
    },
    "eps": "fp32",
    **{
        c: "constexpr"
        for c in ("GATE", "HEAD", "ONE_ROW", "INTERPRET", "PDL", "BLOCK_M", "BLOCK_N")
        + ("BLOCK_K", "TILE_LIST")
    },
}
DIV16 = (
    [p for p, t in SIG.items() if t.startswith("*")]
    + ["K"]
    + [s for s in SIG if s.startswith("stride")]
)
# the gates at the Qwen3.5 head sizes: GDN's value heads (128), gated attention's heads (256)
GATES = [("gated_norm", 1, 128), ("sigmoid", 2, 256)]


def _cases() -> list[tuple]:
    from deltaserve.ops.linear.triton_gated_gemm import _TILES_1, _TILES_16, _TILES_WIDE

    return [
        (gate, block_m, tile)
        for gate, _, head in GATES
        for block_m, tiles in ((1, _TILES_1), (16, _TILES_16), (64, _TILES_WIDE))
        for tile in tiles
        if gate != "gated_norm" or tile[1] % head == 0
    ]


CASES = _cases()


@pytest.fixture(scope="module")
def compiled() -> dict:
    ids = {g: (i, h) for g, i, h in GATES}
    jobs = []
    for gate, block_m, (bn, bk, warps, stages) in CASES:
        code, head = ids[gate]  # block_m 1: one token (ONE_ROW), the dot tile still 16 rows
        constexprs = dict(GATE=code, HEAD=head, ONE_ROW=block_m == 1, INTERPRET=False, PDL=True)
        tiles = {1: 0, 16: 1, 64: 2}[block_m]
        constexprs.update(BLOCK_M=max(16, block_m), BLOCK_N=bn, BLOCK_K=bk, TILE_LIST=tiles)
        jobs.append(
            dict(
                kernel="deltaserve.ops.linear.triton_gated_gemm:_gated_gemm_kernel",
                signature=SIG,
                constexprs=constexprs,
                div16=DIV16,
                num_warps=warps,
                num_stages=stages,
            )
        )
    return dict(zip(CASES, compile_many(jobs)))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_compiles_without_spills_and_pipelines_the_gate_inputs(compiled, case):
    c = compiled[case]
    assert "error" not in c, c.get("error")
    stages = case[2][3]
    assert c["spill_bytes"] == 0
    assert c["async_copies"] >= 3 * stages, "o and z are not streamed like W"
    assert c["pdl_wait"] and c["stores_before_wait"] == 0
    bn, bk, warps = case[2][:3]
    w_tile_loads = bn * bk * 2 // (32 * warps * 16)  # 16-byte vector loads of one W tile
    assert 0 < c["loads_before_wait"] <= w_tile_loads  # the first W tile only
