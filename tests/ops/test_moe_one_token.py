"""The one-token MoE kernels (ops/moe/triton_decode_one_token.py: GEMV-style gate_up and a down
kernel that walks every selected expert and the shared expert, summing in-kernel) against the
decode path's tile kernels fed the same routing, and the Triton backend at one token against the
torch reference with both kernel choices (DELTASERVE_MOE_ONE_TOKEN). Scratch buffers poisoned;
odd sizes: H 40 (two K chunks under the interpreter's 32), expert widths 24 (one chunk) and 70
(three, a ragged last one), a shared expert of width 37. On the GPU (`pytest -m gpu`) the same
cases run in bf16 with the tuned configurations."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_helpers import kernel_device, requires_triton  # noqa: E402
from moe_cases import (  # noqa: E402
    check_against_reference,
    experts,
    poisoned_empty,
    shared_expert_terms,
)

pytestmark = requires_triton

E, H = 10, 40


def _dtype():
    """float32 under the interpreter (its 16-bit dot products are not what a GPU computes),
    bf16 on the GPU."""
    return torch.float32 if kernel_device().type == "cpu" else torch.bfloat16


def _tol(dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


def _down_config(split: int) -> dict | None:
    """The down kernel's configuration with `split` runs per column tile (the interpreter's
    block sizes; on the GPU the 35B-A3B's usual ones); None: the tuner's choice."""
    if split == 1:
        return None
    if kernel_device().type == "cpu":
        return {"BLOCK_N": 4, "CHUNK_K": 32, "SPLIT": split, "num_warps": 1, "num_stages": 1}
    return {"BLOCK_N": 8, "CHUNK_K": 512, "SPLIT": split, "num_warps": 2, "num_stages": 1}


def _tile_path(x, w13, w2, logits, renormalize, scale, shared, top_k, w_dtype):
    """The tile kernels' result for the same token (they route it too): (out, ids, weights)."""
    from deltaserve.ops.moe.triton_decode import RouteArgs, SharedExpertArgs, decode_experts

    ids = torch.empty(1, top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(1, top_k, dtype=w_dtype, device=x.device)
    args = SharedExpertArgs(*shared) if shared is not None else None
    route = RouteArgs(logits, renormalize, scale)
    out = decode_experts(x, w13, w2, ids, weights, args, sum_tokens=True, route=route)
    return out, ids, weights


# (inter, top_k, renormalize, shared expert, down runs): every combination with one run, and
# the split runs at width 70 (three chunks an expert) with and without a shared expert
ONE_TOKEN_CASES = [
    (inter, top_k, renormalize, shared, 1)
    for inter in (24, 70)
    for top_k in (1, 3, 8)
    for renormalize in (True, False)
    for shared in ("none", "gated", "ungated")
] + [
    (70, top_k, True, shared, split)
    for top_k in (1, 8)
    for shared in ("none", "gated")
    for split in (2, 4)
]


@pytest.mark.parametrize("inter, top_k, renormalize, shared, split", ONE_TOKEN_CASES)
def test_one_token_equals_the_tile_kernels(inter, top_k, renormalize, shared, split):
    """The same routing (ids equal, weights equal) and the same output within float32
    rounding, as the tile kernels given the same token; with the down kernel's chunk sequence
    in 1, 2 or 4 runs per column tile (at top-1 without a shared expert 4 runs leave some
    empty), its arrival counters back at 0 after the call."""
    from deltaserve.ops.moe.triton_decode_one_token import one_token_experts
    from deltaserve.ops.tile_counters import all_counters

    dev, dtype = kernel_device(), _dtype()
    w13, w2, gen = experts(E, H, inter, seed=inter + top_k, dtype=dtype, device=dev)
    x = torch.randn(1, H, generator=gen).to(dev, dtype)
    # NOTE: float32 logits with a wide spread: no ties (a tie may be broken either way)
    logits = (torch.randn(1, E, generator=gen) * 3).to(dev)
    terms = None
    if shared != "none":
        t = shared_expert_terms(1, H, 37, gen, dtype, dev, gated=shared == "gated")
        terms = (t["shared_gate_up"], t["shared_down"], t.get("shared_gate"))
    want, want_ids, want_w = _tile_path(x, w13, w2, logits, renormalize, None, terms, top_k, dtype)
    with poisoned_empty():
        ids = torch.empty(1, top_k, dtype=torch.int32, device=dev)
        weights = torch.empty(1, top_k, dtype=dtype, device=dev)
        down = _down_config(split)
        got = one_token_experts(
            x, w13, w2, logits, ids, weights, renormalize, None, *(terms or (None,) * 3),
            down_config=down,
        )  # fmt: skip
    assert got.shape == (1, H) and got.dtype == dtype and not got.isnan().any()
    assert all(int(c.abs().sum()) == 0 for c in all_counters())
    assert torch.equal(ids.cpu(), want_ids.cpu())
    assert torch.equal(weights.cpu(), want_w.cpu())
    err = (got.float() - want.float()).abs().max().item()
    assert err <= _tol(dtype) * (want.float().abs().max().item() + 1e-6), f"max error {err:.3e}"


@pytest.mark.parametrize("top_k", [1, 6])
def test_one_token_scaled_routing(top_k):
    """DeepSeek-V2's greedy rule (weights times the routed scaling factor, float32, not
    renormalised): deepseek_route's ids and weights, and the tile kernels' output."""
    from deltaserve.ops.moe.grouped_topk import deepseek_route
    from deltaserve.ops.moe.triton_decode_one_token import one_token_experts

    dev, dtype = kernel_device(), _dtype()
    w13, w2, gen = experts(E, H, 70, seed=90 + top_k, dtype=dtype, device=dev)
    x = torch.randn(1, H, generator=gen).to(dev, dtype)
    logits = (torch.randn(1, E, generator=gen) * 3).to(dev)
    t = shared_expert_terms(1, H, 37, gen, dtype, dev, gated=False)
    terms = (t["shared_gate_up"], t["shared_down"], None)
    want_ids, want_w = deepseek_route(logits, top_k, "greedy", routed_scaling_factor=16.0)
    want, _, _ = _tile_path(x, w13, w2, logits, True, 16.0, terms, top_k, torch.float32)
    with poisoned_empty():
        ids = torch.empty(1, top_k, dtype=torch.int32, device=dev)
        weights = torch.empty(1, top_k, dtype=torch.float32, device=dev)
        got = one_token_experts(x, w13, w2, logits, ids, weights, True, 16.0, *terms)
    assert torch.equal(ids.long().cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.cpu(), want_w.cpu())  # float32's default tolerance
    err = (got.float() - want.float()).abs().max().item()
    assert err <= _tol(dtype) * (want.float().abs().max().item() + 1e-6), f"max error {err:.3e}"


def test_one_token_refuses_a_bad_split():
    from deltaserve.ops.moe.triton_decode_one_token import one_token_experts

    dev, dtype = kernel_device(), _dtype()
    w13, w2, gen = experts(E, H, 24, seed=6, dtype=dtype, device=dev)
    x = torch.randn(1, H, generator=gen).to(dev, dtype)
    ids = torch.empty(1, 2, dtype=torch.int32, device=dev)
    weights = torch.empty(1, 2, dtype=dtype, device=dev)
    bad = dict(_down_config(2) or {}, SPLIT=5)
    with pytest.raises(ValueError, match="down SPLIT must be in"):
        one_token_experts(
            x, w13, w2, torch.zeros(1, E, device=dev), ids, weights, True, None, down_config=bad
        )


def test_one_token_refuses_more_tokens():
    from deltaserve.ops.moe.triton_decode_one_token import one_token_experts

    dev, dtype = kernel_device(), _dtype()
    w13, w2, gen = experts(E, H, 24, seed=5, dtype=dtype, device=dev)
    two = torch.randn(2, H, generator=gen).to(dev, dtype)
    ids = torch.empty(2, 2, dtype=torch.int32, device=dev)
    weights = torch.empty(2, 2, dtype=dtype, device=dev)
    with pytest.raises(ValueError, match="one token's contiguous"):
        one_token_experts(two, w13, w2, torch.zeros(2, E, device=dev), ids, weights, True, None)


@pytest.mark.parametrize("kernels", ["gemv", "tile"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("gated", [True, False])
def test_backend_one_token_against_reference(monkeypatch, kernels, renormalize, gated):
    """The registered Triton backend at one token (routing inside the kernels, the shared expert
    given itself) against the torch reference, with either kernel choice."""
    from deltaserve.ops.moe.triton_backend import TritonMoE

    monkeypatch.setenv("DELTASERVE_MOE_ONE_TOKEN", kernels)
    dev, dtype = kernel_device(), _dtype()
    w13, w2, gen = experts(E, H, 70, seed=17, dtype=dtype, device=dev)
    x = torch.randn(1, H, generator=gen).to(dev, dtype)
    logits = (torch.randn(1, E, generator=gen) * 3).to(dev, dtype)
    shared = shared_expert_terms(1, H, 37, gen, dtype, dev, gated=gated)
    check_against_reference(
        TritonMoE(), x, w13, w2, _tol(dtype), router_logits=logits, top_k=4,
        renormalize=renormalize, **shared,
    )  # fmt: skip


def test_one_token_choice(monkeypatch):
    """auto (the default): the GEMV-style pair up to ONE_TOKEN_GEMV_MAX_INTER wide experts, the
    tile kernels above; the variable or the constructor forces either; bad values refused."""
    from deltaserve import env
    from deltaserve.ops.moe.triton_backend import ONE_TOKEN_GEMV_MAX_INTER, TritonMoE

    monkeypatch.delenv("DELTASERVE_MOE_ONE_TOKEN", raising=False)
    assert env.moe_one_token() == "auto"
    auto = TritonMoE()
    assert auto._one_token_gemv(ONE_TOKEN_GEMV_MAX_INTER)
    assert not auto._one_token_gemv(ONE_TOKEN_GEMV_MAX_INTER + 1)
    monkeypatch.setenv("DELTASERVE_MOE_ONE_TOKEN", "gemv")
    assert auto._one_token_gemv(1408)
    assert not TritonMoE(one_token="tile")._one_token_gemv(512)
    monkeypatch.setenv("DELTASERVE_MOE_ONE_TOKEN", "tile")
    assert not auto._one_token_gemv(512)
    monkeypatch.setenv("DELTASERVE_MOE_ONE_TOKEN", "fast")
    with pytest.raises(ValueError, match="DELTASERVE_MOE_ONE_TOKEN must be"):
        env.moe_one_token()
    with pytest.raises(ValueError, match="one_token must be"):
        TritonMoE(one_token="fast")


# (E, top_k, inter, shared_inter, gated, routed scaling factor): the 35B-A3B's layer and
# V2-Lite's (a ragged expert width for the chunks: 1408)
REAL = {
    "35b-a3b": (256, 8, 512, 512, True, None),
    "v2-lite": (64, 6, 1408, 2816, False, 16.0),
}


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(REAL))
def test_gpu_one_token_real_shapes_in_a_graph(model):
    """bf16 at a real layer's shapes, the tuned configurations: the torch reference's output,
    the tile kernels' within bf16 rounding, and inside a CUDA graph replayed with new router
    logits (the routing is read on the device only) the eager result of those logits."""
    from deltaserve.ops.moe.triton_backend import TritonMoE

    e, k, inter, shared_inter, gated, scale = REAL[model]
    w13, w2, gen = experts(e, 2048, inter, seed=3, dtype=torch.bfloat16, device="cuda")
    shared = shared_expert_terms(1, 2048, shared_inter, gen, torch.bfloat16, "cuda", gated)
    bias = torch.randn(e, generator=gen) * 2  # peaky, as a trained router
    x = torch.randn(1, 2048, generator=gen).to("cuda", torch.bfloat16)
    logits = (torch.randn(1, e, generator=gen) + bias).to("cuda")
    routing = dict(top_k=k, routed_scaling_factor=scale, **shared)
    gemv, tile = TritonMoE(one_token="gemv"), TritonMoE(one_token="tile")
    got = check_against_reference(gemv, x, w13, w2, 2e-2, router_logits=logits, **routing)
    want = tile(x, w13, w2, router_logits=logits, **routing)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 1e-2 * want.float().abs().max().item(), err
    static_logits = logits.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, w13, w2, router_logits=static_logits, **routing)
    fresh = (torch.randn(1, e, generator=gen) + bias).to("cuda")
    static_logits.copy_(fresh)
    graph.replay()
    eager = gemv(x, w13, w2, router_logits=fresh, **routing)
    assert torch.equal(out, eager)
