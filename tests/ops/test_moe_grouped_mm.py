"""The `grouped_mm` `moe` backend (ops/moe/grouped_mm.py) against the torch reference: its math
on CPU (torch._grouped_mm's reference loop there; float32; Qwen's and DeepSeek-V2's routing
rules), on the GPU (`pytest -m gpu`) in bf16 at Qwen3.5-35B-A3B's shapes and in a CUDA graph
replayed with new routings; and the selector's reasons for passing over the fast `moe`
backends."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_cases import (  # noqa: E402
    check_against_reference,
    experts,
    random_routing,
    shared_terms,
)

from deltaserve import backend_checks, backends  # noqa: E402
from deltaserve.backend_checks import check_grouped_mm_moe, check_triton_moe  # noqa: E402
from deltaserve.backends import select_all  # noqa: E402
from deltaserve.capabilities import Capabilities  # noqa: E402
from deltaserve.ops.moe import MoESpec  # noqa: E402
from deltaserve.ops.moe.grouped_mm import GroupedMmMoE  # noqa: E402
from deltaserve.ops.moe.grouped_topk import deepseek_route  # noqa: E402

needs_grouped_mm = pytest.mark.skipif(
    not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm"
)
E, H, INTER = 10, 40, 24


@needs_grouped_mm
@pytest.mark.parametrize("num_tokens, top_k", [(0, 2), (1, 1), (1, 8), (7, 3), (13, 2)])
def test_given_routing_matches_reference_cpu(num_tokens, top_k):
    w13, w2, gen = experts(E, H, INTER, seed=num_tokens + top_k, dtype=torch.float32, device="cpu")
    x = torch.randn(num_tokens, H, generator=gen)
    ids, weights = random_routing(num_tokens, E, top_k, gen, allowed=[0, 2, 3, 4, 5, 6, 8, 9])
    check_against_reference(GroupedMmMoE(), x, w13, w2, 1e-5, topk_ids=ids, topk_weights=weights)


@needs_grouped_mm
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_logits_and_one_expert_cpu(renormalize):
    w13, w2, gen = experts(E, H, INTER, seed=3, dtype=torch.float32, device="cpu")
    x = torch.randn(9, H, generator=gen)
    logits = torch.randn(9, E, generator=gen) * 3
    routing = dict(router_logits=logits, top_k=4, renormalize=renormalize)
    check_against_reference(GroupedMmMoE(), x, w13, w2, 1e-5, **routing)
    ids = torch.full((9, 1), 6)
    weights = torch.rand(9, 1, generator=gen)
    check_against_reference(GroupedMmMoE(), x, w13, w2, 1e-5, topk_ids=ids, topk_weights=weights)


@needs_grouped_mm
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("num_tokens", [0, 1, 9])
def test_shared_expert_combined_cpu(num_tokens, gated):
    w13, w2, gen = experts(E, H, INTER, seed=11 + num_tokens, dtype=torch.float32, device="cpu")
    x = torch.randn(num_tokens, H, generator=gen)
    ids, weights = random_routing(num_tokens, E, 3, gen)
    shared = shared_terms(num_tokens, H, gen, torch.float32, "cpu", gated)
    check_against_reference(
        GroupedMmMoE(), x, w13, w2, 1e-5, topk_ids=ids, topk_weights=weights, **shared
    )


@needs_grouped_mm
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_scaled_routing_cpu(num_tokens):
    """routed_scaling_factor (DeepSeek-V2's greedy rule): the same result as the op fed
    deepseek_route's ids and float32 weights, and as the reference."""
    w13, w2, gen = experts(E, H, INTER, seed=21 + num_tokens, dtype=torch.float32, device="cpu")
    x = torch.randn(num_tokens, H, generator=gen)
    logits = torch.randn(num_tokens, E, generator=gen) * 3
    routing = dict(router_logits=logits, top_k=3, routed_scaling_factor=1.7)
    got = check_against_reference(GroupedMmMoE(), x, w13, w2, 1e-5, **routing)
    ids, weights = deepseek_route(logits, 3, "greedy", routed_scaling_factor=1.7)
    torch.testing.assert_close(got, GroupedMmMoE()(x, w13, w2, topk_ids=ids, topk_weights=weights))


def _caps(device: str, dtype, cc=None, spec=None) -> Capabilities:
    spec = spec or MoESpec(8, 2, 64, 32)
    return Capabilities.from_specs((spec,), torch.device(device), dtype, torch.float32, 16, cc)


def test_capability_reasons(monkeypatch):
    monkeypatch.setattr(backend_checks, "package_installed", lambda name: True)
    assert check_triton_moe(_caps("cpu", torch.float32)) == "no CUDA device"
    assert check_grouped_mm_moe(_caps("cpu", torch.bfloat16)) == "no CUDA device"
    assert check_triton_moe(_caps("cuda", torch.bfloat16, (9, 0))) is None
    assert check_triton_moe(_caps("cuda", torch.float32, (8, 0))) is None
    assert "float16 unsupported" in check_grouped_mm_moe(_caps("cuda", torch.float16, (9, 0)))
    assert "compute capability 8.0" in check_grouped_mm_moe(_caps("cuda", torch.bfloat16, (8, 0)))
    odd = MoESpec(8, 2, 64, 30)
    assert "not multiples of 8" in check_grouped_mm_moe(_caps("cuda", torch.bfloat16, (9, 0), odd))
    if hasattr(torch, "_grouped_mm"):
        assert check_grouped_mm_moe(_caps("cuda", torch.bfloat16, (9, 0))) is None
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    assert "no torch._grouped_mm" in check_grouped_mm_moe(_caps("cuda", torch.bfloat16, (9, 0)))


def test_selection_order_and_reasons(monkeypatch):
    assert backends.OP_FAMILIES["moe"].backend_names == ("triton", "grouped_mm", "torch")
    decision = select_all(_caps("cpu", torch.float32))["moe"]
    assert decision.chosen.name == "torch"
    assert dict(decision.passed_over) == {
        "triton": "no CUDA device",
        "grouped_mm": "no CUDA device",
    }
    monkeypatch.setattr(backend_checks, "package_installed", lambda name: True)
    # a pretend H100 in bf16: triton first; forced grouped_mm is able too
    assert select_all(_caps("cuda", torch.bfloat16, (9, 0)))["moe"].chosen.name == "triton"
    if hasattr(torch, "_grouped_mm"):
        forced = select_all(_caps("cuda", torch.bfloat16, (9, 0)), {"moe": "grouped_mm"})
        assert forced["moe"].chosen.name == "grouped_mm"
    with pytest.raises(backends.BackendUnavailable, match="grouped_mm.*float32 unsupported"):
        select_all(_caps("cuda", torch.float32, (9, 0)), {"moe": "grouped_mm"})


# --- GPU ---------------------------------------------------------------------------------------

REAL = dict(num_experts=256, hidden=2048, inter=512, top_k=8)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 5, 64, 257, 1000])
def test_gpu_real_shapes(num_tokens):
    w13, w2, gen = experts(256, 2048, 512, num_tokens, torch.bfloat16, "cuda")
    x = torch.randn(num_tokens, 2048, generator=gen).to("cuda", torch.bfloat16)
    logits = torch.randn(num_tokens, 256, generator=gen) + torch.randn(256, generator=gen) * 2
    routing = dict(router_logits=logits.to("cuda"), top_k=8)  # float32: no ties
    check_against_reference(GroupedMmMoE(), x, w13, w2, 2e-2, **routing)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 257])
def test_gpu_real_shapes_scaled_routing(num_tokens):
    """DeepSeek-V2's scaled greedy routing (the Triton routing kernel, float32 weights): the
    reference's result, and within one bf16 rounding of the op fed deepseek_route's routing."""
    w13, w2, gen = experts(256, 2048, 512, num_tokens + 3, torch.bfloat16, "cuda")
    x = torch.randn(num_tokens, 2048, generator=gen).to("cuda", torch.bfloat16)
    logits = torch.randn(num_tokens, 256, generator=gen) + torch.randn(256, generator=gen) * 2
    logits = logits.to("cuda")  # float32: no ties
    routing = dict(router_logits=logits, top_k=6, routed_scaling_factor=16.0)
    got = check_against_reference(GroupedMmMoE(), x, w13, w2, 2e-2, **routing)
    ids, weights = deepseek_route(logits, 6, "greedy", routed_scaling_factor=16.0)
    want = GroupedMmMoE()(x, w13, w2, topk_ids=ids, topk_weights=weights)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 8e-3 * want.float().abs().max().item(), err


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_new_routing():
    from deltaserve.ops.moe.reference import TorchMoE

    w13, w2, gen = experts(256, 2048, 512, 0, torch.bfloat16, "cuda")
    x = torch.randn(16, 2048, generator=gen).to("cuda", torch.bfloat16)
    logits = torch.randn(16, 256, generator=gen).to("cuda")  # float32: no ties
    backend = GroupedMmMoE()

    def step():
        return backend(x, w13, w2, router_logits=logits, top_k=8)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(16, 2048, generator=g))
        logits.copy_(torch.randn(16, 256, generator=g) * 3)
        graph.replay()
        torch.cuda.synchronize()
        want = TorchMoE()(x, w13, w2, router_logits=logits, top_k=8)
        err = (out.float() - want.float()).abs().max().item()
        assert err <= 2e-2 * want.float().abs().max().item(), (seed, err)
