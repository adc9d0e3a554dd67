"""The MoE alignment kernel (ops/moe/triton_align.py: histogram, prefix sums, while loops over
runtime sizes) and DeepSeek-V2's float32 router kernel (ops/moe/triton_router.py, with and
without programmatic dependent launch) compile for sm_90 on CPU (sm90_compile.py): the
interpreter runs neither through Triton's compiler."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sm90_compile import compile_many, ptxas_path  # noqa: E402

pytestmark = pytest.mark.skipif(
    ptxas_path() is None, reason="this Triton has no NVIDIA backend / ptxas"
)

ALIGN_SIG = {
    "ids_ptr": "*i32",
    "sorted_ptr": "*i32",
    "block_expert_ptr": "*i32",
    "num_rows_ptr": "*i64",
    **{i: "i32" for i in ("S", "E", "NB")},
    **{c: "constexpr" for c in ("E_PAD", "BLOCK_M", "BLOCK_S", "CHUNK")},
}
# (E_PAD, BLOCK_M, CHUNK): V2-Lite (64 experts), the 35B-A3B (256), the 397B (512)
ALIGN_CASES = [(64, 16, 128), (256, 16, 32), (256, 64, 32), (512, 128, 16)]

ROUTER_SIG = {
    "x_ptr": "*bf16",
    "w_ptr": "*fp32",
    "out_ptr": "*fp32",
    **{i: "i32" for i in ("T", "E", "stride_xt", "stride_we")},
    **{c: "constexpr" for c in ("H", "BLOCK_T", "BLOCK_E", "BLOCK_H", "PDL")},
}
# (BLOCK_T, BLOCK_E, BLOCK_H, PDL): router_logits_triton's choices at 1 and 16 tokens
ROUTER_CASES = [(1, 2, 2048, True), (16, 4, 64, True), (4, 4, 256, False)]


@pytest.fixture(scope="module")
def compiled() -> dict:
    jobs = [
        dict(
            kernel="deltaserve.ops.moe.triton_align:_align_kernel",
            signature=ALIGN_SIG,
            constexprs=dict(E_PAD=e_pad, BLOCK_M=block_m, BLOCK_S=1024, CHUNK=chunk),
            div16=["ids_ptr", "sorted_ptr", "block_expert_ptr", "num_rows_ptr"],
            num_warps=4,
            num_stages=1,
        )
        for e_pad, block_m, chunk in ALIGN_CASES
    ]
    jobs += [
        dict(
            kernel="deltaserve.ops.moe.triton_router:_router_kernel",
            signature=ROUTER_SIG,
            constexprs=dict(H=2048, BLOCK_T=bt, BLOCK_E=be, BLOCK_H=bh, PDL=pdl),
            div16=["x_ptr", "w_ptr", "out_ptr", "stride_xt", "stride_we"],
            num_warps=4,
            num_stages=1,
        )
        for bt, be, bh, pdl in ROUTER_CASES
    ]
    keys = [("align", c) for c in ALIGN_CASES] + [("router", c) for c in ROUTER_CASES]
    return dict(zip(keys, compile_many(jobs)))


@pytest.mark.parametrize("case", ALIGN_CASES)
def test_alignment_kernel_compiles(compiled, case):
    c = compiled[("align", case)]
    assert "error" not in c, c.get("error")
    assert c["spill_bytes"] == 0


@pytest.mark.parametrize("case", ROUTER_CASES)
def test_router_kernel_compiles(compiled, case):
    c = compiled[("router", case)]
    assert "error" not in c, c.get("error")
    assert c["spill_bytes"] == 0
    assert c["pdl_wait"] == case[3]
    if case[3]:  # the first weight tile is loaded before the wait, nothing stored
        assert c["loads_before_wait"] > 0
        assert c["stores_before_wait"] == 0
