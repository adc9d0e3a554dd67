"""The one-token MoE kernels (ops/moe/triton_decode_one_token.py) compile for sm_90 on CPU
(sm90_compile.py) in every configuration of their tuners, at the 35B-A3B's shapes (256 experts,
top-8, expert width 512, a gated shared expert of 512, renormalised routing) and V2-Lite's (64
experts, top-6, width 1408, an ungated shared expert of 2816, scaled routing with float32
weights), with programmatic dependent launch: no register spills; gate_up loads nothing before
its wait; down reads the router logits and its first two weight chunks before it, and uses an
arrival counter only when it splits its chunk sequence; neither stores anything before the
wait."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sm90_compile import compile_many, ptxas_path  # noqa: E402

from deltaserve.ops.moe.triton_decode_one_token import (  # noqa: E402
    DOWN_CONFIGS,
    DOWN_SPLITS,
    GATE_UP_CONFIGS,
)

pytestmark = pytest.mark.skipif(
    ptxas_path() is None, reason="this Triton has no NVIDIA backend / ptxas"
)

# model -> (E, top_k, inter, shared_inter, scaled)
SHAPES = {"35b-a3b": (256, 8, 512, 512, False), "v2-lite": (64, 6, 1408, 2816, True)}

GATE_UP_SIG = {
    **{p: "*bf16" for p in ("x_ptr", "w13_ptr", "inter_ptr")},
    "logits_ptr": "*fp32",
    "ids_ptr": "*i32",
    "weights_ptr": "*bf16",
    **{i: "i32" for i in ("stride_we", "stride_wn")},
    "route_scale": "fp32",
    **{c: "constexpr" for c in ("H", "INTER", "TOP_K", "E", "E_PAD")},
    **{c: "constexpr" for c in ("RENORMALIZE", "SCALE", "PDL", "BLOCK_N", "CHUNK_K")},
}
DOWN_SIG = {
    **{p: "*bf16" for p in ("inter_ptr", "w2_ptr")},
    "logits_ptr": "*fp32",
    **{p: "*bf16" for p in ("y_ptr", "gate_ptr", "wsd_ptr", "out_ptr", "weights_ptr")},
    "ws_ptr": "*fp32",
    "cnt_ptr": "*i32",
    **{i: "i32" for i in ("stride_we", "stride_wn", "stride_sdn")},
    "route_scale": "fp32",
    **{c: "constexpr" for c in ("H", "INTER", "K_PRUNE", "TOP_K", "K_PAD", "E", "E_PAD")},
    **{c: "constexpr" for c in ("RENORMALIZE", "SCALE", "HAS_SHARED", "SHARED_INTER")},
    **{c: "constexpr" for c in ("HAS_GATE", "PDL", "BLOCK_N", "CHUNK_K", "SPLIT")},
}
MODULE = "deltaserve.ops.moe.triton_decode_one_token"
GATE_UP_CASES = [(m, *c) for m in SHAPES for c in GATE_UP_CONFIGS]
DOWN_CASES = [(m, *c, sp) for m in SHAPES for c in DOWN_CONFIGS for sp in DOWN_SPLITS]


def _job(kind: str, model: str, block_n: int, chunk_k: int, warps: int, split: int = 1) -> dict:
    e, k, inter, shared, scaled = SHAPES[model]
    consts = dict(
        H=2048, INTER=inter, TOP_K=k, E=e, E_PAD=e, RENORMALIZE=not scaled, SCALE=scaled,
        PDL=True, BLOCK_N=block_n, CHUNK_K=chunk_k,
    )  # fmt: skip
    weights = "*fp32" if scaled else "*bf16"
    if kind == "gate_up":
        sig = dict(GATE_UP_SIG, weights_ptr=weights)
        div16 = ["x_ptr", "w13_ptr", "inter_ptr", "stride_we", "stride_wn"]
        name = "_one_token_gate_up_kernel"
    else:
        consts.update(K_PRUNE=max(inter, shared), K_PAD=8, HAS_SHARED=True,
                      SHARED_INTER=shared, HAS_GATE=not scaled, SPLIT=split)  # fmt: skip
        sig = dict(DOWN_SIG, weights_ptr=weights)
        div16 = ["inter_ptr", "w2_ptr", "wsd_ptr", "out_ptr", "stride_we", "stride_wn"]
        div16 += ["stride_sdn", "ws_ptr", "cnt_ptr"]
        name = "_one_token_down_kernel"
    return dict(
        kernel=f"{MODULE}:{name}", signature=sig, constexprs=consts, div16=div16,
        num_warps=warps, num_stages=1,
    )  # fmt: skip


@pytest.fixture(scope="module")
def compiled() -> dict:
    keys = [("gate_up", c) for c in GATE_UP_CASES] + [("down", c) for c in DOWN_CASES]
    return dict(zip(keys, compile_many([_job(kind, *c) for kind, c in keys])))


@pytest.mark.parametrize("case", GATE_UP_CASES)
def test_one_token_gate_up_compiles(compiled, case):
    c = compiled[("gate_up", case)]
    assert "error" not in c, c.get("error")
    assert c["spill_bytes"] == 0
    assert c["pdl_wait"]
    assert c["loads_before_wait"] == 0 and c["stores_before_wait"] == 0


@pytest.mark.parametrize("case", DOWN_CASES)
def test_one_token_down_compiles(compiled, case):
    c = compiled[("down", case)]
    assert "error" not in c, c.get("error")
    assert c["spill_bytes"] == 0
    assert c["pdl_wait"]
    assert c["loads_before_wait"] >= 3  # the logits and two chunks of weights
    assert c["stores_before_wait"] == 0
    assert c["has_atomics"] == (case[-1] > 1)  # the arrival counter of split runs
