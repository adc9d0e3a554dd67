"""The token-by-token GDN prefill kernel and the conv prefill kernel compile for sm_90 (on CPU:
Triton's NVIDIA backend and bundled ptxas, see sm90_compile.py) without register spills, with
and without the in-step snapshots they store from inside the kernel (CKPT), at Qwen3.5-9B's
GDN shapes (HK=16, HV=32, K=V=128, conv width 4) with the tiling `prefill_tiling` picks. The
interpreter does not type the CKPT branch's stores for sm_90; this does."""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sm90_compile import compile_many, ptxas_path  # noqa: E402

pytestmark = pytest.mark.skipif(
    ptxas_path() is None, reason="this Triton has no NVIDIA backend / ptxas"
)

GDN_PTRS = ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "A_log_ptr", "dt_bias_ptr", "out_ptr")
GDN_STRIDES = ("qn", "qh", "kn", "kh", "vn", "vh", "an", "ah", "bn", "bh", "sn", "sh", "sv")
GDN_SIG = {
    **{p: "*bf16" for p in GDN_PTRS},
    "state_ptr": "*fp32",
    **{p: "*i64" for p in ("starts_ptr", "ends_ptr", "slots_ptr", "ckpt_ptr", "ckpt_rows_ptr")},
    "init_ptr": "*i1",
    **{f"stride_{s}": "i32" for s in (*GDN_STRIDES, "on", "oh")},
    "scale": "fp32",
    **{c: "constexpr" for c in ("HV", "GROUP", "K", "V", "BK", "BV", "CK", "QK_B")},
    **{c: "constexpr" for c in ("CKPT", "INTERPRET")},
}
CONV_SIG = {
    **{p: "*bf16" for p in ("x_ptr", "w_ptr", "out_ptr")},
    "state_ptr": "*bf16",
    **{p: "*i64" for p in ("slots_ptr", "ckpt_ptr", "ckpt_rows_ptr")},
    "has_init_ptr": "*i1",
    "qsl_ptr": "*i32",
    **{i: "i32" for i in ("C", "stride_xt", "stride_xc", "stride_wc", "stride_ww")},
    **{i: "i32" for i in ("stride_sn", "stride_sc", "stride_sw", "stride_ot", "stride_oc")},
    **{c: "constexpr" for c in ("W", "BT", "BC", "CKPT")},
}


def _gdn_job(ckpt: bool) -> dict:
    from deltaserve.ops.gdn import triton_prefill

    # the tiling a GPU gets (under the interpreter prefill_tiling picks the CPU's)
    with mock.patch.object(triton_prefill, "interpreting", return_value=False):
        tiling = triton_prefill.prefill_tiling(128, 128)
    consts = dict(
        HV=32, GROUP=2, K=128, V=128, BK=128, BV=tiling.block_v, CK=tiling.chunk_k,
        QK_B=tiling.block_v if tiling.qk_rows else 1, CKPT=ckpt, INTERPRET=False,
    )  # fmt: skip
    return dict(
        kernel="deltaserve.ops.gdn.triton_prefill:_gdn_prefill_kernel", signature=GDN_SIG,
        constexprs=consts, div16=[], num_warps=tiling.num_warps, num_stages=1,
    )  # fmt: skip


def _conv_job(ckpt: bool) -> dict:
    return dict(
        kernel="deltaserve.ops.gdn.triton_conv1d:_conv_prefill_kernel", signature=CONV_SIG,
        constexprs=dict(W=4, BT=32, BC=64, CKPT=ckpt), div16=[], num_warps=4, num_stages=1,
    )  # fmt: skip


@pytest.fixture(scope="module")
def compiled() -> dict:
    """The four kernels compiled in one subprocess."""
    cases = [("gdn", False), ("gdn", True), ("conv", False), ("conv", True)]
    jobs = [(_gdn_job if kind == "gdn" else _conv_job)(ckpt) for kind, ckpt in cases]
    return dict(zip(cases, compile_many(jobs)))


@pytest.mark.parametrize("kind", ["gdn", "conv"])
def test_prefill_kernels_compile_without_spills(compiled, kind):
    plain, ckpt = compiled[(kind, False)], compiled[(kind, True)]
    for c in (plain, ckpt):
        assert "error" not in c, c.get("error")
        assert c["spill_bytes"] == 0, c
    # the snapshot adds global stores (the state tile / window) only with CKPT
    stores = [sum(n for op, n in c["memory_ops"].items() if op.startswith("st.")) for c in (
        plain, ckpt)]  # fmt: skip
    assert stores[1] > stores[0], stores
