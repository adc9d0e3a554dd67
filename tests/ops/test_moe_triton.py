"""The Triton `moe` backend (ops/moe/triton_*) against the torch reference: on CPU in Triton's
interpreter at tiny sizes (odd token counts, T = 0 and 1, top-k 1..8, idle experts, every token
on one expert, given routing and router logits with and without renormalisation, both the decode
path and the sorted path, scratch buffers poisoned), the routing kernel against `route`, the
alignment's invariants; DeepSeek-V2's scaled greedy routing (`routed_scaling_factor`) in the
routing kernel and inside gate_up against grouped_topk.deepseek_route; on the GPU (`pytest -m
gpu`) in bf16 at Qwen3.5-35B-A3B's shapes and inside a CUDA graph replayed with a new routing
each time."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_helpers import kernel_device, requires_triton  # noqa: E402
from moe_cases import (  # noqa: E402
    check_against_reference,
    experts,
    poisoned_empty,
    random_routing,
    shared_expert_terms,
    shared_terms,
)

from deltaserve.ops.moe import route  # noqa: E402
from deltaserve.ops.moe.grouped_topk import deepseek_route  # noqa: E402

pytestmark = requires_triton

# tiny shapes, not multiples of the interpreter's 32-wide tiles (H spans two K tiles)
E, H, INTER = 10, 40, 24
# decode_max_pairs forcing each path ("decode-wide": the decode path's full capacity)
PATHS = {"decode": 128, "decode-wide": 512, "sorted": 0}


def _backend(path: str):
    from deltaserve.ops.moe.triton_backend import TritonMoE

    return TritonMoE(decode_max_pairs=PATHS[path])


def _cpu_dtype():
    return torch.float32 if kernel_device().type == "cpu" else torch.bfloat16


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(
    "num_tokens, top_k", [(0, 2), (1, 1), (1, 8), (2, 3), (7, 4), (13, 2), (40, 4), (90, 1)]
)
def test_given_routing_matches_reference(path, num_tokens, top_k):
    dev, dtype = kernel_device(), _cpu_dtype()
    w13, w2, gen = experts(E, H, INTER, seed=num_tokens * 10 + top_k, dtype=dtype, device=dev)
    x = torch.randn(num_tokens, H, generator=gen).to(dev, dtype)
    ids, weights = random_routing(num_tokens, E, top_k, gen)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    check_against_reference(
        _backend(path), x, w13, w2, tol,
        topk_ids=ids.to(dev), topk_weights=weights.to(dev, dtype),
    )  # fmt: skip


@pytest.mark.parametrize("path", list(PATHS))
def test_idle_experts_and_all_on_one_expert(path):
    dev, dtype = kernel_device(), _cpu_dtype()
    w13, w2, gen = experts(E, H, INTER, seed=5, dtype=dtype, device=dev)
    x = torch.randn(11, H, generator=gen).to(dev, dtype)
    backend = _backend(path)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # only experts 2, 3, 7 used (the others get no pair), int32 ids
    ids, weights = random_routing(11, E, 2, gen, allowed=[2, 3, 7])
    routing = dict(topk_ids=ids.int().to(dev), topk_weights=weights.to(dev, dtype))
    check_against_reference(backend, x, w13, w2, tol, **routing)
    # every token on expert 4 (k = 1), then every token on experts 4 and 9
    for chosen in ([4], [4, 9]):
        ids = torch.tensor([chosen] * 11)
        weights = torch.rand(11, len(chosen), generator=gen)
        routing = dict(topk_ids=ids.to(dev), topk_weights=weights.to(dev, dtype))
        check_against_reference(backend, x, w13, w2, tol, **routing)


@pytest.mark.parametrize("path", list(PATHS))
def test_expert_repeated_within_tokens(path):
    """A given routing may repeat an expert within a token (top-k never does): 3 tokens x 8
    choices all on expert 4 are 24 slots of one expert, more than one 16-row decode pass."""
    dev, dtype = kernel_device(), _cpu_dtype()
    w13, w2, gen = experts(E, H, INTER, seed=8, dtype=dtype, device=dev)
    x = torch.randn(3, H, generator=gen).to(dev, dtype)
    routing = dict(
        topk_ids=torch.full((3, 8), 4, device=dev),
        topk_weights=torch.rand(3, 8, generator=gen).to(dev, dtype),
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    check_against_reference(_backend(path), x, w13, w2, tol, **routing)


def test_decode_path_one_expert_over_two_passes():
    """90 tokens (k = 1) all on expert 4 on the wide decode path: 90 slots of one expert, more
    than its 64-row tile."""
    dev, dtype = kernel_device(), _cpu_dtype()
    w13, w2, gen = experts(E, H, INTER, seed=9, dtype=dtype, device=dev)
    x = torch.randn(90, H, generator=gen).to(dev, dtype)
    routing = dict(
        topk_ids=torch.full((90, 1), 4, device=dev),
        topk_weights=torch.rand(90, 1, generator=gen).to(dev, dtype),
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    check_against_reference(_backend("decode-wide"), x, w13, w2, tol, **routing)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_tokens, top_k", [(1, 8), (5, 3), (9, 1)])
def test_router_logits_match_reference(path, renormalize, num_tokens, top_k):
    dev, dtype = kernel_device(), _cpu_dtype()
    w13, w2, gen = experts(E, H, INTER, seed=num_tokens + top_k, dtype=dtype, device=dev)
    x = torch.randn(num_tokens, H, generator=gen).to(dev, dtype)
    # NOTE: float32 logits: bf16 ones tie often, and a tie may be broken either way
    logits = (torch.randn(num_tokens, E, generator=gen) * 3).to(dev)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    check_against_reference(
        _backend(path), x, w13, w2, tol,
        router_logits=logits, top_k=top_k, renormalize=renormalize,
    )  # fmt: skip


def _half_dtype():
    """The 16-bit activation dtype of the mixed-dtype tests: bf16 on the GPU; fp16 under the
    interpreter (its bf16 dot products are wrong, given routing or not)."""
    return torch.float16 if kernel_device().type == "cpu" else torch.bfloat16


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("half", [False, True], ids=["float32", "half"])
@pytest.mark.parametrize("num_tokens, top_k", [(1, 6), (1, 1), (5, 3)])
def test_scaled_routing_equals_deepseek_route(path, half, num_tokens, top_k):
    """routed_scaling_factor: the op routes by DeepSeek-V2's greedy rule (one token on the
    decode path: inside gate_up; else the routing kernel) and gives what it gives fed
    deepseek_route's ids and float32 weights (the weights equal within float32 rounding, so
    the outputs within one rounding of x's dtype), and the reference's result; the shared
    expert given itself, ungated, as DeepseekMoeBlock passes it; `renormalize` (True by
    default) is not applied."""
    dev = kernel_device()
    dtype = _half_dtype() if half else torch.float32
    w13, w2, gen = experts(E, H, INTER, seed=110 + num_tokens + top_k, dtype=dtype, device=dev)
    x = torch.randn(num_tokens, H, generator=gen).to(dev, dtype)
    # NOTE: float32 logits (the DeepSeek router's), a strided view: no ties
    logits = (torch.randn(num_tokens, E + 3, generator=gen) * 3).to(dev)[:, 1 : E + 1]
    shared = shared_expert_terms(num_tokens, H, 30, gen, dtype, dev, gated=False)
    ids, weights = deepseek_route(logits, top_k, "greedy", routed_scaling_factor=2.5)
    backend = _backend(path)
    routing = dict(router_logits=logits, top_k=top_k, routed_scaling_factor=2.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got = check_against_reference(backend, x, w13, w2, tol, **routing, **shared)
    with poisoned_empty():
        want = backend(x, w13, w2, topk_ids=ids, topk_weights=weights, **shared)
    err = (got.float() - want.float()).abs().max().item()
    one_rounding = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: 2^-8 of the largest
    assert err <= one_rounding * (want.float().abs().max().item() + 1e-6), err


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("num_tokens, top_k", [(0, 2), (1, 8), (7, 3), (40, 4)])
def test_shared_expert_combined_in_the_reduce(path, gated, num_tokens, top_k):
    """routed + sigmoid(shared_gate) * shared_out in one kernel, the shared terms and the
    router logits all strided views (slices of a fused projection's output)."""
    dev, dtype = kernel_device(), _cpu_dtype()
    w13, w2, gen = experts(E, H, INTER, seed=70 + num_tokens + top_k, dtype=dtype, device=dev)
    x = torch.randn(num_tokens, H, generator=gen).to(dev, dtype)
    # NOTE: float32 logits: bf16 ones tie often, and a tie may be broken either way
    wide_logits = (torch.randn(num_tokens, E + 3, generator=gen) * 3).to(dev)
    shared = shared_terms(num_tokens, H, gen, dtype, dev, gated)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    check_against_reference(
        _backend(path), x, w13, w2, tol,
        router_logits=wide_logits[:, 1 : E + 1], top_k=top_k, **shared,
    )  # fmt: skip


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("shared_inter", [INTER, 37])
@pytest.mark.parametrize("num_tokens, top_k", [(0, 2), (1, 8), (7, 3), (40, 4)])
def test_shared_expert_given_itself(path, gated, shared_inter, num_tokens, top_k):
    """The shared expert passed as its gate/up outputs and down weight (the decode path runs
    it in the down kernel's extra row of programs; the sorted path in torch), strided views,
    an expert width other than the routed experts' (37: two K tiles, a ragged one), scratch
    poisoned, against the reference."""
    dev, dtype = kernel_device(), _cpu_dtype()
    w13, w2, gen = experts(E, H, INTER, seed=90 + num_tokens + top_k, dtype=dtype, device=dev)
    x = torch.randn(num_tokens, H, generator=gen).to(dev, dtype)
    logits = (torch.randn(num_tokens, E, generator=gen) * 3).to(dev)
    shared = shared_expert_terms(num_tokens, H, shared_inter, gen, dtype, dev, gated)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    check_against_reference(
        _backend(path), x, w13, w2, tol, router_logits=logits, top_k=top_k, **shared
    )


def test_shared_expert_arguments_are_checked():
    dev = kernel_device()
    w13, w2, gen = experts(E, H, INTER, seed=3, dtype=torch.float32, device=dev)
    x = torch.randn(2, H, generator=gen).to(dev)
    call = dict(router_logits=torch.randn(2, E, device=dev), top_k=2)
    terms = shared_expert_terms(2, H, 8, gen, torch.float32, dev)
    backend = _backend("decode")
    with pytest.raises(ValueError, match="go together"):
        backend(x, w13, w2, shared_gate_up=terms["shared_gate_up"], **call)
    with pytest.raises(ValueError, match="not both"):
        backend(x, w13, w2, shared_out=x, **terms, **call)
    with pytest.raises(ValueError, match="shared_down must be"):
        bad = dict(terms, shared_down=terms["shared_down"][:-1])
        backend(x, w13, w2, **bad, **call)
    with pytest.raises(ValueError, match="shared_gate_up must be"):
        bad = dict(terms, shared_gate_up=terms["shared_gate_up"][:, :-2])
        backend(x, w13, w2, **bad, **call)
    with pytest.raises(ValueError, match="shared_gate must be"):
        bad = dict(terms, shared_gate=terms["shared_gate"].reshape(-1))
        backend(x, w13, w2, **bad, **call)


@pytest.mark.parametrize("with_shared", [False, True])
@pytest.mark.parametrize("num_tokens, top_k", [(1, 8), (5, 3), (3, 8)])
def test_decode_down_kernel_sum_equals_the_reduce(with_shared, num_tokens, top_k):
    """The down kernel's own top-k sum (last program per column tile) gives the same bits as
    the pair outputs summed by the reduce kernel, and leaves its arrival counters at 0 (a second
    call on the same weights, whose counters it reuses, is identical)."""
    from deltaserve.ops.moe.triton_decode import SharedExpertArgs, decode_experts
    from deltaserve.ops.moe.triton_reduce import reduce_pairs
    from deltaserve.ops.tile_counters import all_counters

    dev, dtype = kernel_device(), _cpu_dtype()
    w13, w2, gen = experts(E, H, INTER, seed=30 + num_tokens, dtype=dtype, device=dev)
    x = torch.randn(num_tokens, H, generator=gen).to(dev, dtype)
    ids, weights = random_routing(num_tokens, E, top_k, gen)
    if num_tokens == 3:  # experts shared across tokens: slots whose programs stream nothing
        ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]] * 3)
    ids, weights = ids.to(dev), weights.to(dev, dtype)
    shared = None
    if with_shared:
        terms = shared_expert_terms(num_tokens, H, 20, gen, dtype, dev)
        shared = SharedExpertArgs(
            terms["shared_gate_up"], terms["shared_down"], terms["shared_gate"]
        )
    with poisoned_empty():
        pair_out = decode_experts(x, w13, w2, ids, weights, shared)
        num_pairs = num_tokens * top_k
        extra = pair_out[num_pairs:] if with_shared else None
        want = reduce_pairs(pair_out[:num_pairs], top_k, dtype, extra)
        got = decode_experts(x, w13, w2, ids, weights, shared, sum_tokens=True)
        again = decode_experts(x, w13, w2, ids, weights, shared, sum_tokens=True)
    assert got.shape == (num_tokens, H) and got.dtype == dtype
    assert not got.isnan().any()
    assert torch.equal(got, want) and torch.equal(again, got)
    assert all(int(c.abs().sum()) == 0 for c in all_counters())


@pytest.mark.parametrize("split_k", [2, 3, 4])
@pytest.mark.parametrize("num_tokens, top_k", [(1, 8), (3, 8), (20, 2)])
def test_decode_gate_up_split_over_h(split_k, num_tokens, top_k):
    """gate_up with H split across programs (slices of 32: 40 = 32 + 8, a short last slice;
    at split 3 and 4 whole slices past H), partials poisoned until written, the last slice's
    program applying SiLU-and-mul: the same result as the unsplit kernel within float32
    rounding, arrival counters back at 0. 20 tokens x 2 on 3 experts: more slots of one expert
    than a 16-row pass."""
    from deltaserve.ops.moe.triton_decode import decode_experts
    from deltaserve.ops.tile_counters import all_counters

    dev, dtype = kernel_device(), _cpu_dtype()
    w13, w2, gen = experts(E, H, INTER, seed=50 + num_tokens + split_k, dtype=dtype, device=dev)
    x = torch.randn(num_tokens, H, generator=gen).to(dev, dtype)
    allowed = [1, 4, 6] if num_tokens == 20 else None
    ids, weights = random_routing(num_tokens, E, top_k, gen, allowed=allowed)
    if num_tokens == 3:  # every token on the same 8 experts
        ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]] * 3)
    ids, weights = ids.to(dev), weights.to(dev, dtype)
    meta = {"BLOCK_N": 16, "BLOCK_K": 32}
    with poisoned_empty():
        want = decode_experts(x, w13, w2, ids, weights, gate_up_meta=dict(meta, SPLIT_K=1))
        got = decode_experts(x, w13, w2, ids, weights, gate_up_meta=dict(meta, SPLIT_K=split_k))
    assert not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (got - want).abs().max().item()
    assert err <= tol * (want.abs().max().item() + 1e-6), f"max error {err:.3e}"
    assert all(int(c.abs().sum()) == 0 for c in all_counters())
    check_against_reference(
        _backend("decode-wide"), x, w13, w2, tol, topk_ids=ids, topk_weights=weights
    )
    with pytest.raises(ValueError, match="SPLIT_K must be in"):
        decode_experts(x, w13, w2, ids, weights, gate_up_meta=dict(meta, SPLIT_K=5))


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_gate_up_routes_one_token(top_k, renormalize, split_k):
    """One token: the gate_up kernel routes it itself (every program; program (s, 0, 0) stores
    the routing) and gives the routing kernel's ids and weights, and the same output as the
    decode path fed that routing; logits a strided view, ids / weights poisoned until written.
    More than one token is refused."""
    from deltaserve.ops.moe.triton_decode import RouteArgs, decode_experts
    from deltaserve.ops.moe.triton_routing import route_triton

    dev, dtype = kernel_device(), _cpu_dtype()
    w13, w2, gen = experts(E, H, INTER, seed=70 + top_k, dtype=dtype, device=dev)
    x = torch.randn(1, H, generator=gen).to(dev, dtype)
    # NOTE: float32 logits: bf16 ones tie often, and a tie may be broken either way
    wide = (torch.randn(1, E + 3, generator=gen) * 3).to(dev)
    logits = wide[:, 2 : E + 2]
    want_ids, want_w = route_triton(logits, top_k, renormalize, dtype)
    meta = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": split_k}
    with poisoned_empty():
        ids = torch.empty(1, top_k, dtype=torch.int32, device=dev)
        weights = torch.empty(1, top_k, dtype=dtype, device=dev)
        got = decode_experts(
            x, w13, w2, ids, weights, sum_tokens=True, gate_up_meta=meta,
            route=RouteArgs(logits.contiguous(), renormalize),
        )  # fmt: skip
        want = decode_experts(x, w13, w2, want_ids, want_w, sum_tokens=True, gate_up_meta=meta)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.float().cpu(), want_w.float().cpu(), rtol=1e-3, atol=1e-3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * (want.float().abs().max().item() + 1e-6)
    two = torch.randn(2, H, generator=gen).to(dev, dtype)
    with pytest.raises(ValueError, match="routing inside gate_up serves one token"):
        decode_experts(
            two, w13, w2, ids.expand(2, -1), weights.expand(2, -1),
            route=RouteArgs(torch.zeros(2, E, device=dev), renormalize),
        )  # fmt: skip


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("top_k", [1, 6])
def test_gate_up_routes_one_token_scaled(top_k, split_k):
    """One token routed inside gate_up by DeepSeek-V2's greedy rule (RouteArgs.scale): the ids
    of deepseek_route, its float32 weights within float32 rounding, and the output of the
    decode path fed that routing. A 16-bit weights buffer is refused."""
    from deltaserve.ops.moe.triton_decode import RouteArgs, decode_experts

    dev, dtype = kernel_device(), _half_dtype()
    w13, w2, gen = experts(E, H, INTER, seed=80 + top_k, dtype=dtype, device=dev)
    x = torch.randn(1, H, generator=gen).to(dev, dtype)
    logits = (torch.randn(1, E, generator=gen) * 3).to(dev)
    want_ids, want_w = deepseek_route(logits, top_k, "greedy", routed_scaling_factor=16.0)
    meta = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": split_k}
    route_args = RouteArgs(logits, True, 16.0)  # renormalize is not applied when scaled
    with poisoned_empty():
        ids = torch.empty(1, top_k, dtype=torch.int32, device=dev)
        weights = torch.empty(1, top_k, dtype=torch.float32, device=dev)
        got = decode_experts(
            x, w13, w2, ids, weights, sum_tokens=True, gate_up_meta=meta, route=route_args
        )
        want = decode_experts(x, w13, w2, want_ids, want_w, sum_tokens=True, gate_up_meta=meta)
    assert torch.equal(ids.long().cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.cpu(), want_w.cpu())  # float32's default tolerance
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 8e-3 * (want.float().abs().max().item() + 1e-6), err
    with pytest.raises(ValueError, match="float32 weights"):
        half_w = torch.empty(1, top_k, dtype=dtype, device=dev)
        decode_experts(x, w13, w2, ids, half_w, route=route_args)


@pytest.mark.parametrize("top_k", [1, 3, 6, 8])
def test_routing_kernel_scaled_matches_deepseek_route(top_k):
    """The routing kernel with routed_scaling_factor: deepseek_route's greedy ids, and its
    weights (float32 whatever the activation dtype, times the factor, not renormalised) within
    float32 rounding."""
    from deltaserve.ops.moe.triton_routing import route_triton

    dev = kernel_device()
    gen = torch.Generator().manual_seed(40 + top_k)
    logits = (torch.randn(6, 13, generator=gen) * 4).to(dev)  # 13: padded lanes must not win
    ids, weights = route_triton(logits, top_k, True, torch.bfloat16, routed_scaling_factor=1.7)
    want_ids, want_weights = deepseek_route(logits, top_k, "greedy", routed_scaling_factor=1.7)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long().cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.cpu(), want_weights.cpu())
    torch.testing.assert_close(
        route(logits, top_k, True, torch.bfloat16, 1.7)[1].cpu(), want_weights.cpu()
    )


@pytest.mark.parametrize("top_k", range(1, 9))
@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_kernel_matches_route(top_k, renormalize):
    from deltaserve.ops.moe.triton_routing import route_triton

    dev = kernel_device()
    gen = torch.Generator().manual_seed(top_k)
    num_experts = 13  # not a power of two: padded lanes must never win
    logits = (torch.randn(6, num_experts, generator=gen) * 4).to(dev)
    ids, weights = route_triton(logits, top_k, renormalize, torch.float16)
    want_ids, want_weights = route(logits, top_k, renormalize, torch.float16)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float16
    assert torch.equal(ids.long().cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.cpu(), want_weights.cpu(), rtol=1e-3, atol=1e-3)
    if renormalize:
        torch.testing.assert_close(
            weights.float().sum(-1).cpu(), torch.ones(6), rtol=2e-3, atol=2e-3
        )


def test_routing_kernel_rejects_bad_top_k():
    from deltaserve.ops.moe.triton_routing import route_triton

    logits = torch.randn(2, 4, device=kernel_device())
    with pytest.raises(ValueError, match="top_k 5"):
        route_triton(logits, 5, True, torch.float32)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("num_tokens, top_k, block_m", [(1, 1, 16), (9, 3, 16), (40, 4, 4)])
def test_alignment_invariants(num_tokens, top_k, block_m, impl):
    from deltaserve.ops.moe import triton_align
    from deltaserve.ops.moe.triton_align import max_blocks

    align_by_expert = getattr(triton_align, f"align_by_expert_{impl}")
    gen = torch.Generator().manual_seed(num_tokens)
    ids, _ = random_routing(num_tokens, E, top_k, gen, allowed=[0, 1, 5, 6, 9])
    with poisoned_empty():  # the Triton kernel must write every entry of its torch.empty buffers
        a = align_by_expert(ids.to(kernel_device()), E, block_m)
    a = type(a)(a.sorted_ids.cpu(), a.block_expert.cpu(), a.num_rows.cpu(), a.block_m)
    num_pairs = num_tokens * top_k
    assert a.block_expert.numel() == max_blocks(num_pairs, E, block_m)
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    used = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(a.num_rows) == used <= a.sorted_ids.numel()
    rows = a.sorted_ids[:used].long()
    real = rows[rows < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    assert (a.sorted_ids[used:] == num_pairs).all()  # past the used rows: padding only
    flat = ids.reshape(-1)
    for b in range(used // block_m):
        block = rows[b * block_m : (b + 1) * block_m]
        block = block[block < num_pairs]
        assert len(block) > 0  # no block of padding only
        assert (flat[block] == a.block_expert[b]).all()
        assert torch.equal(block, block.sort().values)  # stable: pair order within an expert


def _align_case(num_tokens: int, top_k: int, num_experts: int, case: str, seed: int = 0):
    """topk_ids [T, k] int32: a random top-k routing ("random"), every token on the same k
    experts ("crowded"), or only the last expert among the first k (top_k 1: "last")."""
    gen = torch.Generator().manual_seed(seed)
    if case == "random":
        ids, _ = random_routing(num_tokens, num_experts, top_k, gen)
    elif case == "crowded":
        ids = torch.arange(top_k).repeat(num_tokens, 1)
    else:
        ids = torch.full((num_tokens, top_k), num_experts - 1)
    return ids.to(torch.int32)


@pytest.mark.parametrize(
    "num_tokens, top_k, num_experts, block_m, case",
    [
        (1, 1, 10, 16, "random"),
        (9, 3, 10, 16, "random"),
        (40, 4, 10, 4, "random"),
        (33, 2, 5, 16, "random"),
        (7, 6, 64, 32, "random"),
        (100, 1, 3, 64, "last"),
        (16, 4, 12, 16, "crowded"),  # runs that fill their blocks exactly: no padding rows
        (13, 5, 17, 8, "crowded"),
    ],
)
def test_triton_alignment_equals_torch(num_tokens, top_k, num_experts, block_m, case):
    """The one-launch Triton alignment gives the reference's buffers entry for entry."""
    from deltaserve.ops.moe.triton_align import align_by_expert_torch, align_by_expert_triton

    ids = _align_case(num_tokens, top_k, num_experts, case, seed=num_tokens)
    want = align_by_expert_torch(ids.long(), num_experts, block_m)
    with poisoned_empty():
        got = align_by_expert_triton(ids.to(kernel_device()), num_experts, block_m)
    assert torch.equal(got.sorted_ids.cpu(), want.sorted_ids)
    assert torch.equal(got.block_expert.cpu(), want.block_expert)
    assert got.num_rows.dtype == torch.int64 and int(got.num_rows) == int(want.num_rows)


@pytest.mark.parametrize("case", ["random", "crowded"])
def test_triton_alignment_in_several_reads(monkeypatch, case):
    """Pairs read 8 at a time and blocks placed 2 at a time by the last program (the loops a
    large batch takes on the GPU) give the reference's buffers too."""
    from deltaserve.ops.moe import triton_align

    monkeypatch.setattr(triton_align, "ALIGN_BLOCK_S", 8)
    monkeypatch.setattr(triton_align, "ALIGN_TILE", 32)  # CHUNK = 32 // 16 = 2 blocks
    ids = _align_case(11, 3, E, case, seed=5)  # 33 pairs: 5 reads, the last one partial
    want = triton_align.align_by_expert_torch(ids.long(), E, 4)
    with poisoned_empty():
        got = triton_align.align_by_expert_triton(ids.to(kernel_device()), E, 4)
    assert torch.equal(got.sorted_ids.cpu(), want.sorted_ids)
    assert torch.equal(got.block_expert.cpu(), want.block_expert)
    assert int(got.num_rows) == int(want.num_rows)


def test_alignment_dispatch_by_size(monkeypatch):
    """`align_by_expert` runs the Triton kernel up to ALIGN_TRITON_MAX_PAIRS pairs and the torch
    reference above (same result); the Triton entry point refuses a call past its limit."""
    from deltaserve.ops.moe import triton_align

    monkeypatch.setattr(triton_align, "ALIGN_TRITON_MAX_PAIRS", 12)
    calls = []
    real = triton_align.align_by_expert_triton
    monkeypatch.setattr(
        triton_align,
        "align_by_expert_triton",
        lambda *a: calls.append(a[0].numel()) or real(*a),
    )
    dev = kernel_device()
    small, large = _align_case(4, 3, E, "random"), _align_case(5, 3, E, "random")
    for ids in (small, large):
        got = triton_align.align_by_expert(ids.to(dev), E, 16)
        want = triton_align.align_by_expert_torch(ids.long(), E, 16)
        assert torch.equal(got.sorted_ids.cpu(), want.sorted_ids)
    assert calls == [12]  # the 15-pair call ran the reference
    with pytest.raises(ValueError, match="1..12 pairs"):
        real(large.to(dev), E, 16)


def test_rejects_bad_inputs():
    backend = _backend("decode")
    dev = kernel_device()
    w13, w2, _ = experts(E, H, INTER, seed=0, dtype=torch.float32, device=dev)
    x = torch.randn(3, H, device=dev)
    with pytest.raises(ValueError, match="router_logits must be"):
        backend(x, w13, w2, router_logits=torch.randn(3, E + 1, device=dev), top_k=2)
    with pytest.raises(ValueError, match="give router_logits"):
        backend(x, w13, w2)
    with pytest.raises(ValueError, match="shapes disagree"):
        backend(x, w13, w2[:, :, :-1], router_logits=torch.randn(3, E, device=dev), top_k=2)
    with pytest.raises(ValueError, match="topk_weights"):
        ids = torch.zeros(3, 2, dtype=torch.long, device=dev)
        backend(x, w13, w2, topk_ids=ids, topk_weights=torch.ones(3, 1, device=dev))


# --- GPU: bf16 at Qwen3.5-35B-A3B's shapes (hidden 2048, 256 experts, top-8, INTER = 512) ---------

REAL = dict(num_experts=256, hidden=2048, inter=512, top_k=8)


@functools.cache
def _real_experts() -> tuple[torch.Tensor, torch.Tensor]:
    """35B-A3B-sized experts (w13 [256, 1024, 2048], w2 [256, 2048, 512]), drawn once on the GPU
    and shared by the real-shape tests (drawing 0.8 G numbers on the CPU per test took ~10 s)."""
    gen = torch.Generator("cuda").manual_seed(0)
    e, h, i = REAL["num_experts"], REAL["hidden"], REAL["inter"]
    w13 = torch.randn(e, 2 * i, h, generator=gen, device="cuda") / h**0.5
    w2 = torch.randn(e, h, i, generator=gen, device="cuda") / i**0.5
    return w13.to(torch.bfloat16), w2.to(torch.bfloat16)


def _real_inputs(num_tokens: int, seed: int):
    w13, w2 = _real_experts()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, REAL["hidden"], generator=gen).to("cuda", torch.bfloat16)
    # peaky router logits: a few experts are popular, as in a trained router
    bias = torch.randn(REAL["num_experts"], generator=gen) * 2
    logits = torch.randn(num_tokens, REAL["num_experts"], generator=gen) + bias
    # NOTE: float32 logits: bf16 ones tie often, and a tie may be broken either way
    return x, w13, w2, logits.to("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("num_tokens", [1, 3, 16, 17, 64, 257, 1000])
def test_gpu_real_shapes(path, num_tokens):
    if path.startswith("decode") and num_tokens * REAL["top_k"] > PATHS[path]:
        pytest.skip("more pairs than the decode path serves")
    x, w13, w2, logits = _real_inputs(num_tokens, seed=num_tokens)
    check_against_reference(
        _backend(path), x, w13, w2, 2e-2, router_logits=logits, top_k=REAL["top_k"]
    )


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("num_tokens", [1, 16, 17, 257])
def test_gpu_real_shapes_with_shared_expert(path, num_tokens):
    if path.startswith("decode") and num_tokens * REAL["top_k"] > PATHS[path]:
        pytest.skip("more pairs than the decode path serves")
    x, w13, w2, logits = _real_inputs(num_tokens, seed=num_tokens + 5)
    gen = torch.Generator().manual_seed(num_tokens)
    shared = shared_terms(num_tokens, REAL["hidden"], gen, torch.bfloat16, "cuda")
    check_against_reference(
        _backend(path), x, w13, w2, 2e-2, router_logits=logits, top_k=REAL["top_k"], **shared
    )


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("num_tokens", [1, 16, 17, 257])
def test_gpu_real_shapes_with_shared_expert_given_itself(path, num_tokens):
    """The shared expert as SparseMoeBlock passes it (gate/up outputs, down weight): on the
    decode path inside the down kernel, which also sums the tokens' rows."""
    if path.startswith("decode") and num_tokens * REAL["top_k"] > PATHS[path]:
        pytest.skip("more pairs than the decode path serves")
    x, w13, w2, logits = _real_inputs(num_tokens, seed=num_tokens + 9)
    gen = torch.Generator().manual_seed(num_tokens)
    shared = shared_expert_terms(num_tokens, REAL["hidden"], 512, gen, torch.bfloat16, "cuda")
    check_against_reference(
        _backend(path), x, w13, w2, 2e-2, router_logits=logits, top_k=REAL["top_k"], **shared
    )


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("num_tokens", [1, 16, 17, 257])
def test_gpu_real_shapes_scaled_routing(path, num_tokens):
    """DeepSeek-V2's scaled greedy routing (top-6, factor 16, float32 weights) with the shared
    expert given itself, ungated, as DeepseekMoeBlock passes it: the op's own routing gives
    what deepseek_route's ids and weights give (within one bf16 rounding) and the reference's
    result."""
    if path.startswith("decode") and num_tokens * 6 > PATHS[path]:
        pytest.skip("more pairs than the decode path serves")
    x, w13, w2, logits = _real_inputs(num_tokens, seed=num_tokens + 13)
    gen = torch.Generator().manual_seed(num_tokens)
    shared = shared_expert_terms(
        num_tokens, REAL["hidden"], 1024, gen, torch.bfloat16, "cuda", gated=False
    )
    routing = dict(router_logits=logits, top_k=6, routed_scaling_factor=16.0)
    backend = _backend(path)
    got = check_against_reference(backend, x, w13, w2, 2e-2, **routing, **shared)
    ids, weights = deepseek_route(logits, 6, "greedy", routed_scaling_factor=16.0)
    want = backend(x, w13, w2, topk_ids=ids, topk_weights=weights, **shared)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 8e-3 * want.float().abs().max().item(), err


@pytest.mark.gpu
@pytest.mark.parametrize(
    "num_tokens, top_k, num_experts, block_m",
    [(64, 8, 256, 16), (512, 8, 256, 32), (1024, 8, 512, 16), (64, 6, 64, 32), (1365, 6, 64, 64)],
)
def test_gpu_triton_alignment_equals_torch(num_tokens, top_k, num_experts, block_m):
    """At decode-batch and prefill-chunk sizes of the real models (35B: 256 experts top-8,
    V2-Lite: 64 top-6, 397B: 512), on the GPU."""
    from deltaserve.ops.moe.triton_align import align_by_expert_torch, align_by_expert_triton

    ids = _align_case(num_tokens, top_k, num_experts, "random", seed=num_tokens).cuda()
    want = align_by_expert_torch(ids.long(), num_experts, block_m)
    got = align_by_expert_triton(ids, num_experts, block_m)
    assert torch.equal(got.sorted_ids, want.sorted_ids)
    assert torch.equal(got.block_expert, want.block_expert)
    assert torch.equal(got.num_rows, want.num_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [2, 4])
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_gpu_gate_up_split_over_h(split_k, num_tokens):
    """gate_up with H split across programs at the real shapes equals the unsplit kernel, and
    the arrival counters are back at 0."""
    from deltaserve.ops.moe.triton_decode import decode_experts
    from deltaserve.ops.moe.triton_routing import route_triton
    from deltaserve.ops.tile_counters import all_counters

    x, w13, w2, logits = _real_inputs(num_tokens, seed=num_tokens + 11)
    ids, weights = route_triton(logits, REAL["top_k"], True, torch.bfloat16)
    meta = {"BLOCK_N": 16, "BLOCK_K": 128}
    with poisoned_empty():
        want = decode_experts(x, w13, w2, ids, weights, gate_up_meta=dict(meta, SPLIT_K=1))
        got = decode_experts(x, w13, w2, ids, weights, gate_up_meta=dict(meta, SPLIT_K=split_k))
    torch.cuda.synchronize()
    assert not got.isnan().any()
    err = (got - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), err
    assert all(int(c.abs().sum()) == 0 for c in all_counters())


@pytest.mark.gpu
@pytest.mark.parametrize("with_shared", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 8, 16, 64])
@pytest.mark.parametrize("scale", [None, 16.0], ids=["qwen", "deepseek"])
def test_gpu_cuda_graph_replays_new_routing(num_tokens, with_shared, scale):
    """Captured once, replayed with three fresh inputs and routings (fewer and more experts
    than at capture): each replay equals the reference on its own inputs (the arrival counters
    of the decode path's top-k sum reset inside the graph). With the shared expert given
    itself, as SparseMoeBlock passes it; by Qwen's routing rule or DeepSeek-V2's scaled one."""
    from deltaserve.ops.moe.triton_backend import TritonMoE

    backend = TritonMoE()
    x, w13, w2, logits = _real_inputs(num_tokens, seed=1)
    static_x, static_logits = x.clone(), logits.clone()
    extra = {"routed_scaling_factor": scale}  # the shared expert's terms and the rule's
    if with_shared:
        gen = torch.Generator().manual_seed(7)
        extra |= shared_expert_terms(num_tokens, REAL["hidden"], 512, gen, torch.bfloat16, "cuda")

    def step():
        return backend(static_x, w13, w2, router_logits=static_logits, top_k=REAL["top_k"], **extra)

    step()  # compile / autotune outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for seed, spread in ((2, 1.0), (3, 0.0), (4, 10.0)):
        new_x, _, _, new_logits = _real_inputs(num_tokens, seed=seed)
        if spread == 0.0:  # every token routed to the same experts
            new_logits = new_logits[:1].expand_as(new_logits).contiguous()
        static_x.copy_(new_x)
        static_logits.copy_(new_logits * spread if spread else new_logits)
        graph.replay()
        torch.cuda.synchronize()
        from deltaserve.ops.moe.reference import TorchMoE

        want = TorchMoE()(
            static_x, w13, w2, router_logits=static_logits, top_k=REAL["top_k"], **extra
        )
        err = (static_out.float() - want.float()).abs().max().item()
        assert err <= 2e-2 * want.float().abs().max().item(), (seed, err)


def test_graph_blocker_allows_the_fast_moe_backends():
    """With a graph-capable moe backend a MoE model's decode steps can be captured; with the
    reference they cannot."""
    from deltaserve.backends import graph_blocker
    from deltaserve.ops.moe.grouped_mm import GroupedMmMoE
    from deltaserve.ops.moe.reference import TorchMoE
    from deltaserve.ops.moe.triton_backend import TritonMoE

    assert graph_blocker({"moe": TritonMoE()}) is None
    assert graph_blocker({"moe": GroupedMmMoE()}) is None
    assert (
        graph_blocker({"moe": TorchMoE()}) == "moe backend torch cannot be captured in a CUDA graph"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_gpu_bench_runs(num_tokens):
    """`bench kernels --only moe`'s measurement runs for every impl and counts sane bytes."""
    from deltaserve.ops.moe.triton_bench import (
        SHAPE,
        bench_moe,
        make_layers,
        make_weights,
        moe_impls,
    )

    layers = make_layers(num_tokens, make_weights())
    for impl in moe_impls(num_tokens):
        res = bench_moe(num_tokens, impl, layers)
        assert res["us"] > 0, impl
        assert 1 <= res["experts"] <= min(SHAPE["num_experts"], num_tokens * SHAPE["top_k"])
        assert res["bytes"] >= res["experts"] * 3 * 512 * 2048 * 2


def test_decode_config_lists(monkeypatch):
    """The GPU autotuner's lists: every entry by default (gate_up: its split-over-H entries
    too), the original list with DELTASERVE_MOE_DECODE_CONFIGS=base, a clear error otherwise."""
    from deltaserve.ops.moe import triton_decode_common as d

    monkeypatch.setattr(d, "interpreting", lambda: False)

    def table(configs):
        return [
            (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)
            + ((c.kwargs["SPLIT_K"],) if "SPLIT_K" in c.kwargs else ())
            for c in configs
        ]

    monkeypatch.delenv("DELTASERVE_MOE_DECODE_CONFIGS", raising=False)
    assert table(d.decode_configs(d.DOWN_EXTRA)) == list(d.BASE + d.DOWN_EXTRA)
    unsplit = [(*c, 1) for c in d.BASE + d.GATE_UP_EXTRA]
    assert table(d.gate_up_configs()) == unsplit + list(d.GATE_UP_SPLIT)
    assert all(1 < c[-1] <= d.SPLIT_K_MAX for c in d.GATE_UP_SPLIT)
    monkeypatch.setenv("DELTASERVE_MOE_DECODE_CONFIGS", "base")
    assert table(d.decode_configs(d.GATE_UP_EXTRA)) == list(d.BASE)
    assert table(d.gate_up_configs()) == [(*c, 1) for c in d.BASE]
    monkeypatch.setenv("DELTASERVE_MOE_DECODE_CONFIGS", "fast")
    with pytest.raises(ValueError, match="DELTASERVE_MOE_DECODE_CONFIGS must be"):
        d.decode_configs(d.DOWN_EXTRA)
