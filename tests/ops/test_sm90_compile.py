"""The decode kernels of the MoE decode-step work compile for sm_90 (on CPU: Triton's NVIDIA
backend and bundled ptxas, see sm90_compile.py), without register spills, the dot steps
pipelined through shared memory: the split-K decode GEMM in its dot / FMA / prefetch / split
variants, the base decode GEMM in two of its tuner's configurations, the MoE decode gate_up
kernel with and without its split over H, and the MoE decode down kernel with and without its
shared-expert branch and top-k sum, and the one-row GEMV in every configuration of its tuner.
The interpreter runs only the branches a test takes and does
not type untaken ones; this catches what it lets through."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sm90_compile import compile_many, ptxas_path  # noqa: E402

from deltaserve.ops.linear.triton_gemv import GEMV_CONFIGS  # noqa: E402
from deltaserve.ops.moe.triton_decode_common import (  # noqa: E402
    BASE,
    DOWN_EXTRA,
    GATE_UP_SPLIT,
)

pytestmark = pytest.mark.skipif(
    ptxas_path() is None, reason="this Triton has no NVIDIA backend / ptxas"
)

GEMM_SIG = {
    **{p: "*bf16" for p in ("x_ptr", "w_ptr", "b_ptr", "out_ptr")},
    "ws_ptr": "*fp32",
    "cnt_ptr": "*i32",
    **{i: "i32" for i in ("M", "N", "K", "K_SPLIT", "stride_xm", "stride_wn", "stride_om")},
    **{c: "constexpr" for c in ("HAS_BIAS", "INTERPRET", "FMA", "PREFETCH", "PDL", "M_PAD")},
    **{c: "constexpr" for c in ("SPLIT_K", "BLOCK_N", "BLOCK_K")},
}
GEMM_DIV16 = ["x_ptr", "w_ptr", "b_ptr", "out_ptr", "ws_ptr", "cnt_ptr", "K", "K_SPLIT"]
GEMM_DIV16 += ["stride_xm", "stride_wn"]


GEMM_CASES = [  # fma, prefetch, m_pad, split, block_n, block_k, bias (, pdl)
    (False, False, 16, 4, 16, 256, True),  # the chosen config of N 1281 / 2048
    (False, False, 16, 1, 32, 256, False),  # N >= 8192
    (True, True, 1, 4, 16, 256, False),
    (True, True, 4, 2, 16, 128, True),
    (True, False, 2, 8, 32, 128, False),
    (False, False, 16, 4, 16, 256, True, True),  # with programmatic dependent launch
    (True, True, 1, 4, 16, 256, False, True),
    (False, False, 64, 4, 64, 128, False),  # the wide tiles (64 rows): choose_config's
    (False, False, 32, 1, 64, 128, True, True),
]


def _gemm_job(fma, prefetch, m_pad, split, block_n, block_k, bias, pdl=False) -> dict:
    consts = dict(
        HAS_BIAS=bias, INTERPRET=False, FMA=fma, PREFETCH=prefetch, PDL=pdl, M_PAD=m_pad,
        SPLIT_K=split, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    kernel = "deltaserve.ops.linear.triton_splitk:_decode_gemm_splitk_kernel"
    return dict(kernel=kernel, signature=GEMM_SIG, constexprs=consts, div16=GEMM_DIV16)


BASE_SIG = {
    **{p: "*bf16" for p in ("x_ptr", "w_ptr", "b_ptr", "out_ptr")},
    **{i: "i32" for i in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om")},
    **{c: "constexpr" for c in ("HAS_BIAS", "INTERPRET", "PDL", "BLOCK_M", "BLOCK_N", "BLOCK_K")},
}
BASE_DIV16 = ["x_ptr", "w_ptr", "b_ptr", "out_ptr", "K", "stride_xm", "stride_wn"]
# block_m, block_n, block_k, warps, stages, pdl: three of the tuner's configurations (the last
# from its wide list, x padded to 64 rows)
BASE_CASES = [(16, 32, 256, 4, 4, True), (16, 16, 512, 4, 3, False), (64, 64, 128, 8, 4, True)]


def _base_job(block_m, block_n, block_k, warps, stages, pdl) -> dict:
    consts = dict(
        HAS_BIAS=False, INTERPRET=False, PDL=pdl, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k
    )
    return dict(
        kernel="deltaserve.ops.linear.triton_gemm:_decode_gemm_kernel", signature=BASE_SIG,
        constexprs=consts, div16=BASE_DIV16, num_warps=warps, num_stages=stages,
    )  # fmt: skip


# the conv epilogue's arguments (GDN's conv1d update on the fused in_proj's first columns)
CONV_SIG = {
    "cw_ptr": "*bf16",
    "cs_ptr": "*bf16",
    "slot_ptr": "*i64",
    **{i: "i32" for i in ("conv_channels", "stride_cwc", "stride_cww", "stride_csn")},
    **{i: "i32" for i in ("stride_csc", "stride_csw")},
}
GEMV_SIG = {
    **{p: "*bf16" for p in ("x_ptr", "w_ptr", "b_ptr", "out_ptr")},
    **{i: "i32" for i in ("N", "stride_wn")},
    **CONV_SIG,
    **{c: "constexpr" for c in ("K", "HAS_BIAS", "CONV", "CONV_W", "PDL", "BLOCK_N", "CHUNK_K")},
}
GEMV_DIV16 = ["x_ptr", "w_ptr", "b_ptr", "out_ptr", "stride_wn"]
# every configuration of the GEMV's tuner list with PDL at K 4096, and one at K 2048 (two
# chunks = the whole slice) without it
# (and every configuration at K 4096 with the conv epilogue)
GEMV_CASES = [(4096, bn, ck, w, True) for bn, ck, w in GEMV_CONFIGS] + [(2048, 8, 1024, 4, False)]
GEMV_CASES += [(4096, bn, ck, w, True, True) for bn, ck, w in GEMV_CONFIGS]


def _gemv_job(k, block_n, chunk_k, warps, pdl, conv=False) -> dict:
    consts = dict(K=k, HAS_BIAS=not conv, CONV=conv, CONV_W=4 if conv else 1, PDL=pdl,
                  BLOCK_N=block_n, CHUNK_K=chunk_k)  # fmt: skip
    return dict(
        kernel="deltaserve.ops.linear.triton_gemv:_decode_gemv_kernel", signature=GEMV_SIG,
        constexprs=consts, div16=GEMV_DIV16, num_warps=warps, num_stages=1,
    )  # fmt: skip


GEMV_NORM_SIG = {
    **{p: "*bf16" for p in ("h_ptr", "res_ptr", "nw_ptr", "w_ptr", "b_ptr", "out_ptr")},
    **{p: "*bf16" for p in ("res_out_ptr", "normed_ptr")},
    **{i: "i32" for i in ("N", "stride_wn")},
    "eps": "fp32",
    **CONV_SIG,
    **{c: "constexpr" for c in ("K", "HAS_BIAS", "ZERO_CENTERED", "WRITE_NORMED", "PDL")},
    **{c: "constexpr" for c in ("CONV", "CONV_W", "BLOCK_N", "CHUNK_K")},
}
GEMV_NORM_DIV16 = [p for p, t in GEMV_NORM_SIG.items() if t == "*bf16"] + ["stride_wn"]
GEMV_NORM_DIV16 = [p for p in GEMV_NORM_DIV16 if p not in CONV_SIG]
# the GEMV with the residual add + RMSNorm: every configuration at K 4096 (the 9B's hidden
# size) with PDL, zero-centred and writing the normalised row; one at K 2048 with a plain norm
GEMV_NORM_CASES = [(4096, bn, ck, w, True) for bn, ck, w in GEMV_CONFIGS]
GEMV_NORM_CASES += [(2048, 2, 2048, 2, False)]
# with the conv epilogue at K 2048 (the 35B-A3B's GDN in_proj), every configuration
GEMV_NORM_CASES += [(2048, bn, ck, w, True, True) for bn, ck, w in GEMV_CONFIGS]


def _gemv_norm_job(k, block_n, chunk_k, warps, zero_centered, conv=False) -> dict:
    consts = dict(K=k, HAS_BIAS=False, ZERO_CENTERED=zero_centered, WRITE_NORMED=zero_centered,
                  CONV=conv, CONV_W=4 if conv else 1, PDL=True, BLOCK_N=block_n,
                  CHUNK_K=chunk_k)  # fmt: skip
    return dict(
        kernel="deltaserve.ops.linear.triton_gemv_norm:_decode_gemv_norm_kernel",
        signature=GEMV_NORM_SIG, constexprs=consts, div16=GEMV_NORM_DIV16, num_warps=warps,
        num_stages=1,
    )  # fmt: skip


DOWN_SIG = {
    "inter_ptr": "*bf16",
    "w2_ptr": "*bf16",
    "weights_ptr": "*bf16",
    "pair_out_ptr": "*fp32",
    "ids_ptr": "*i32",
    **{i: "i32" for i in ("num_pairs", "stride_i", "stride_we", "stride_wn")},
    "y_ptr": "*bf16",
    "stride_y": "i32",
    "gate_ptr": "*bf16",
    "stride_gate": "i32",
    "wsd_ptr": "*bf16",
    "stride_sdn": "i32",
    "num_tokens": "i32",
    "out_ptr": "*bf16",
    "cnt_ptr": "*i32",
    "logits_ptr": "*bf16",
    "route_scale": "fp32",
    **{c: "constexpr" for c in ("H", "INTER", "S_PAD", "ROWS", "HAS_SHARED", "SHARED_INTER")},
    **{c: "constexpr" for c in ("SHARED_SPLITS", "HAS_GATE", "SUM", "TOP_K", "PRECISION")},
    **{c: "constexpr" for c in ("ROUTE", "E", "E_PAD", "RENORMALIZE", "SCALE")},
    **{c: "constexpr" for c in ("PDL", "BLOCK_N", "BLOCK_K")},
}
DOWN_DIV16 = ["inter_ptr", "w2_ptr", "weights_ptr", "pair_out_ptr", "ids_ptr", "stride_i"]
DOWN_DIV16 += ["stride_we", "stride_wn", "y_ptr", "stride_y", "wsd_ptr", "stride_sdn"]
DOWN_DIV16 += ["out_ptr", "cnt_ptr"]


DOWN_CASES = [  # shared, summed, block_n, block_k, warps, stages (, pdl, route)
    (shared, shared, *cfg) for shared in (False, True) for cfg in ((16, 512, 2, 1), (16, 128, 4, 4))
] + [(True, False, 32, 256, 4, 3), (False, True, 32, 512, 4, 2), (True, True, 16, 512, 2, 1, True)]
# one token routed in every program, with PDL: every configuration of the tuner's list
DOWN_CASES += [(True, True, *cfg, True, True) for cfg in BASE + DOWN_EXTRA]


def _down_job(shared, summed, block_n, block_k, warps, stages, pdl=False, route=False) -> dict:
    consts = dict(
        H=2048, INTER=512, S_PAD=16, ROWS=16, HAS_SHARED=shared, SHARED_INTER=1024,
        SHARED_SPLITS=2 if summed else 1, HAS_GATE=shared, SUM=summed, TOP_K=8, ROUTE=route,
        E=256, E_PAD=256, RENORMALIZE=True, SCALE=False, PRECISION="tf32", PDL=pdl,
        BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return dict(
        kernel="deltaserve.ops.moe.triton_decode_down:_decode_down_kernel", signature=DOWN_SIG,
        constexprs=consts, div16=DOWN_DIV16, num_warps=warps, num_stages=stages,
    )  # fmt: skip


GATE_UP_SIG = {
    "x_ptr": "*bf16",
    "w13_ptr": "*bf16",
    "inter_ptr": "*bf16",
    "ids_ptr": "*i32",
    "ws_ptr": "*fp32",
    "cnt_ptr": "*i32",
    "logits_ptr": "*bf16",
    "weights_ptr": "*bf16",
    **{i: "i32" for i in ("num_pairs", "stride_x", "stride_we", "stride_wn", "stride_i")},
    "route_scale": "fp32",
    **{c: "constexpr" for c in ("TOP_K", "H", "INTER", "S_PAD", "ROWS", "ROUTE", "E")},
    **{c: "constexpr" for c in ("E_PAD", "RENORMALIZE", "SCALE", "PRECISION", "BLOCK_N")},
    **{c: "constexpr" for c in ("PDL", "BLOCK_K", "SPLIT_K")},
}
GATE_UP_DIV16 = ["x_ptr", "w13_ptr", "inter_ptr", "ids_ptr", "ws_ptr", "cnt_ptr", "stride_x"]
GATE_UP_DIV16 += ["stride_we", "stride_wn", "stride_i"]
# block_n, block_k, warps, stages, split_k (, route, scale, pdl): one unsplit, every split
# configuration the autotuner may pick, two with the routing inside, one with DeepSeek-V2's
# scaled routing inside (float32 weights) and one with programmatic dependent launch
GATE_UP_CASES = [(16, 128, 4, 4, 1), *GATE_UP_SPLIT, (16, 128, 4, 4, 1, True)]
GATE_UP_CASES += [(16, 128, 4, 4, 2, True), (16, 128, 4, 4, 1, True, True)]
GATE_UP_CASES += [(16, 128, 4, 4, 1, True, False, True)]


def _gate_up_job(
    block_n, block_k, warps, stages, split_k, route=False, scale=False, pdl=False
) -> dict:
    consts = dict(
        TOP_K=8, H=2048, INTER=512, S_PAD=16, ROWS=16, ROUTE=route, E=256, E_PAD=256,
        RENORMALIZE=not scale, SCALE=scale, PRECISION="tf32", PDL=pdl, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split_k,
    )  # fmt: skip
    signature = dict(GATE_UP_SIG, weights_ptr="*fp32") if scale else GATE_UP_SIG
    return dict(
        kernel="deltaserve.ops.moe.triton_decode_gate_up:_decode_gate_up_kernel",
        signature=signature, constexprs=consts, div16=GATE_UP_DIV16, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Every case compiled in one subprocess (about 15 s)."""
    jobs = [_gemm_job(*c) for c in GEMM_CASES] + [_down_job(*c) for c in DOWN_CASES]
    jobs += [_gate_up_job(*c) for c in GATE_UP_CASES] + [_base_job(*c) for c in BASE_CASES]
    jobs += [_gemv_job(*c) for c in GEMV_CASES]
    jobs += [_gemv_norm_job(*c) for c in GEMV_NORM_CASES]
    keys = [("gemm", c) for c in GEMM_CASES] + [("down", c) for c in DOWN_CASES]
    keys += [("gate_up", c) for c in GATE_UP_CASES] + [("base", c) for c in BASE_CASES]
    keys += [("gemv", c) for c in GEMV_CASES]
    keys += [("gemv_norm", c) for c in GEMV_NORM_CASES]
    return dict(zip(keys, compile_many(jobs)))


@pytest.mark.parametrize("case", GEMM_CASES)
def test_splitk_gemm_compiles(compiled, case):
    c = compiled[("gemm", case)]
    assert "error" not in c, c.get("error")
    fma, prefetch, _, split = case[:4]
    assert c["spill_bytes"] == 0
    if not fma and not prefetch:
        assert c["async_copies"] > 0, "the dot step's loads should be pipelined"
    assert c["has_atomics"] == (split > 1)  # the arrival counter
    pdl = len(case) > 7 and case[7]
    assert c["pdl_wait"] == pdl
    if pdl:  # the first W tile's loads are issued before the wait, and nothing is stored
        assert c["loads_before_wait"] > 0
        assert c["stores_before_wait"] == 0


@pytest.mark.parametrize("case", BASE_CASES)
def test_base_gemm_compiles(compiled, case):
    """The base decode GEMM: no spills, its dot step pipelined."""
    c = compiled[("base", case)]
    assert "error" not in c, c.get("error")
    assert c["spill_bytes"] == 0
    assert c["async_copies"] > 0, "the dot step's loads should be pipelined"
    assert c["pdl_wait"] == case[5]


@pytest.mark.parametrize("case", GEMV_CASES)
def test_gemv_compiles(compiled, case):
    """The one-row GEMV (and with the conv epilogue): no spills with two chunks of W in
    registers; with PDL its first two chunks' loads come before the wait and nothing is stored
    before it (the conv state is read and shifted after it)."""
    c = compiled[("gemv", case)]
    assert "error" not in c, c.get("error")
    assert c["spill_bytes"] == 0
    assert c["pdl_wait"] == case[4]
    if case[4]:
        assert c["loads_before_wait"] >= 2
        assert c["stores_before_wait"] == 0


@pytest.mark.parametrize("case", GEMV_NORM_CASES)
def test_gemv_norm_compiles(compiled, case):
    """The GEMV with the residual add and norm (and with the conv epilogue): no spills; W's
    first two chunks loaded before the PDL wait and nothing stored before it (the norm's
    inputs and the conv state come after it)."""
    c = compiled[("gemv_norm", case)]
    assert "error" not in c, c.get("error")
    assert c["spill_bytes"] == 0
    assert c["pdl_wait"]
    assert c["loads_before_wait"] >= 2
    assert c["stores_before_wait"] == 0


@pytest.mark.parametrize("case", DOWN_CASES)
def test_moe_decode_down_compiles(compiled, case):
    c = compiled[("down", case)]
    assert "error" not in c, c.get("error")
    assert c["spill_bytes"] == 0
    assert c["has_atomics"] == case[1]  # the top-k sum's arrival counter
    pdl = len(case) > 6 and case[6]
    route = len(case) > 7 and case[7]
    assert c["pdl_wait"] == pdl
    if pdl:  # given routing: the wait comes first; routed inside: logits and weights before it
        assert (c["loads_before_wait"] > 0) == route
        assert c["stores_before_wait"] == 0


@pytest.mark.parametrize("case", GATE_UP_CASES)
def test_moe_decode_gate_up_compiles(compiled, case):
    c = compiled[("gate_up", case)]
    assert "error" not in c, c.get("error")
    assert c["spill_bytes"] == 0
    assert c["async_copies"] > 0, "the weight loads should be pipelined"
    assert c["has_atomics"] == (case[4] > 1)  # the split's arrival counter
    pdl = len(case) > 7 and case[7]
    assert c["pdl_wait"] == pdl
    if pdl:  # the routing decides every load: the wait comes first
        assert c["loads_before_wait"] == 0 and c["stores_before_wait"] == 0
