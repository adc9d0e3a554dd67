"""The `moe` torch reference (deltaserve/ops/moe) against a plain float32 loop written here:
odd token counts, an expert that receives no token, every token on one expert, routing from
router logits (with and without renormalisation, and DeepSeek-V2's scaled greedy rule) and the
registry's selection rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.backends import OP_FAMILIES, select_all
from deltaserve.capabilities import Capabilities
from deltaserve.ops.moe import MoESpec, route
from deltaserve.ops.moe.grouped_topk import deepseek_route
from deltaserve.ops.moe.reference import TorchMoE


def plain_moe(x, w13, w2, ids, weights):
    """out[t] = sum_j weights[t, j] * w2[e] @ (silu(g) * u), [g; u] = w13[e] @ x[t], e = ids[t, j],
    one token and one choice at a time, in float32."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].float() @ x[t].float()
            y = w2[e].float() @ (F.silu(h[:inter]) * h[inter:])
            out[t] += weights[t, j].float() * y
    return out


def _weights(num_experts, hidden, inter, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return w13.to(dtype), w2.to(dtype), gen


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_reference_matches_plain_loop_with_an_idle_expert(num_tokens):
    E, H, N, k = 6, 24, 20, 3
    w13, w2, gen = _weights(E, H, N, seed=num_tokens)
    x = torch.randn(num_tokens, H, generator=gen)
    # experts 0..4 only: expert 5 gets no token
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, k, generator=gen)
    out = TorchMoE()(x, w13, w2, topk_ids=ids, topk_weights=weights)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, plain_moe(x, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)


def test_all_tokens_on_one_expert():
    E, H, N = 5, 16, 12
    w13, w2, gen = _weights(E, H, N, seed=3)
    x = torch.randn(9, H, generator=gen)
    ids = torch.full((9, 1), 2)
    weights = torch.rand(9, 1, generator=gen)
    out = TorchMoE()(x, w13, w2, topk_ids=ids, topk_weights=weights)
    torch.testing.assert_close(out, plain_moe(x, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)


def test_bf16_accumulates_in_float32():
    E, H, N, k = 4, 32, 16, 2
    w13, w2, gen = _weights(E, H, N, seed=4, dtype=torch.bfloat16)
    x = torch.randn(11, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(11)])
    weights = torch.rand(11, k, generator=gen).bfloat16()
    out = TorchMoE()(x, w13, w2, topk_ids=ids, topk_weights=weights)
    assert out.dtype == torch.bfloat16
    ref = plain_moe(x, w13, w2, ids, weights)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_empty_batch():
    w13, w2, _ = _weights(3, 8, 4, seed=5)
    x = torch.zeros(0, 8)
    out = TorchMoE()(
        x, w13, w2, topk_ids=torch.zeros(0, 2, dtype=torch.long), topk_weights=torch.zeros(0, 2)
    )
    assert out.shape == (0, 8)


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_from_logits(renormalize):
    E, H, N, k = 8, 16, 8, 3
    w13, w2, gen = _weights(E, H, N, seed=6)
    x = torch.randn(13, H, generator=gen)
    logits = torch.randn(13, E, generator=gen) * 3
    probs = torch.softmax(logits.double(), dim=-1)
    top, ids = probs.topk(k, dim=-1)
    if renormalize:
        top = top / top.sum(-1, keepdim=True)
    got_ids, got_w = route(logits, k, renormalize, torch.float32)
    assert torch.equal(got_ids, ids)
    torch.testing.assert_close(got_w.double(), top, rtol=1e-6, atol=1e-7)
    out = TorchMoE()(x, w13, w2, router_logits=logits, top_k=k, renormalize=renormalize)
    torch.testing.assert_close(out, plain_moe(x, w13, w2, ids, top), rtol=1e-5, atol=1e-5)
    assert route(logits.bfloat16(), k, renormalize, torch.bfloat16)[1].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_routing_is_deepseek_greedy(dtype):
    """routed_scaling_factor: `route` is deepseek_route's greedy rule exactly (top-k of the
    float32 softmax times the factor, not renormalised whatever `renormalize` says, float32
    whatever the activation dtype), and the op routing itself gives the same bits as the op fed
    deepseek_route's ids and weights; without the factor Qwen's rule is unchanged."""
    E, H, N, k = 10, 16, 8, 4
    w13, w2, gen = _weights(E, H, N, seed=7, dtype=dtype)
    x = torch.randn(9, H, generator=gen).to(dtype)
    logits = torch.randn(9, E, generator=gen) * 3  # float32, as DeepSeek's router gives them
    want_ids, want_w = deepseek_route(logits, k, "greedy", routed_scaling_factor=2.5)
    for renormalize in (True, False):
        ids, w = route(logits, k, renormalize, dtype, routed_scaling_factor=2.5)
        assert w.dtype == torch.float32
        assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
    routing = dict(router_logits=logits, top_k=k, routed_scaling_factor=2.5)
    got = TorchMoE()(x, w13, w2, **routing)
    want = TorchMoE()(x, w13, w2, topk_ids=want_ids, topk_weights=want_w)
    assert got.dtype == dtype and torch.equal(got, want)
    qwen_ids, qwen_w = route(logits, k, False, dtype)
    assert torch.equal(qwen_ids, want_ids) and qwen_w.dtype == dtype
    torch.testing.assert_close(qwen_w.float() * 2.5, want_w, rtol=1e-2, atol=1e-2)


def test_moe_family_only_for_models_with_moe_layers():
    assert OP_FAMILIES["moe"].layer_kind == "moe"
    cpu, f32 = torch.device("cpu"), torch.float32
    dense = Capabilities.from_specs([], cpu, f32, f32, 16)
    assert "moe" not in select_all(dense)
    moe = Capabilities.from_specs([MoESpec(8, 2, 16, 8)], cpu, f32, f32, 16)
    assert select_all(moe)["moe"].chosen.name == "torch"


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("num_tokens", [0, 1, 9])
def test_reference_adds_the_shared_expert(num_tokens, gated):
    """out = routed + sigmoid(shared_gate) * shared_out (ungated without shared_gate), the
    shared terms read through strided views (slices of a wider projection output)."""
    E, H, N, k = 5, 16, 12, 2
    w13, w2, gen = _weights(E, H, N, seed=40 + num_tokens)
    x = torch.randn(num_tokens, H, generator=gen)
    ids = (
        torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(num_tokens)])
        if (num_tokens)
        else torch.zeros(0, k, dtype=torch.long)
    )
    weights = torch.rand(num_tokens, k, generator=gen)
    wide = torch.randn(num_tokens, H + 3, generator=gen) * 2  # [shared_out | gate | pad]
    shared_out, shared_gate = wide[:, :H], wide[:, H : H + 1] if gated else None
    out = TorchMoE()(
        x, w13, w2, topk_ids=ids, topk_weights=weights, shared_out=shared_out,
        shared_gate=shared_gate,
    )  # fmt: skip
    want = plain_moe(x, w13, w2, ids, weights)
    for t in range(num_tokens):
        g = torch.sigmoid(wide[t, H]) if gated else 1.0
        want[t] += g * wide[t, :H]
    assert out.shape == (num_tokens, H)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_reference_rejects_bad_shared_arguments():
    E, H, N = 4, 8, 6
    w13, w2, gen = _weights(E, H, N, seed=3)
    x = torch.randn(3, H, generator=gen)
    logits = torch.randn(3, E, generator=gen)
    call = dict(router_logits=logits, top_k=2)
    with pytest.raises(ValueError, match="shared_gate was given without shared_out"):
        TorchMoE()(x, w13, w2, shared_gate=torch.zeros(3, 1), **call)
    with pytest.raises(ValueError, match="shared_out must be"):
        TorchMoE()(x, w13, w2, shared_out=torch.zeros(3, H + 1), **call)
    with pytest.raises(ValueError, match="shared_gate must be"):
        TorchMoE()(x, w13, w2, shared_out=torch.zeros(3, H), shared_gate=torch.zeros(3), **call)
    with pytest.raises(ValueError, match="shared_out is torch.float64"):
        TorchMoE()(x, w13, w2, shared_out=torch.zeros(3, H, dtype=torch.float64), **call)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("num_tokens", [0, 1, 9])
def test_reference_runs_a_shared_expert_given_itself(num_tokens, gated):
    """shared_gate_up [T, 2Is] and shared_down [H, Is] (strided views): out = routed +
    sigmoid(shared_gate) * (silu(g) * u) @ shared_down.T, in plain float32 math."""
    E, H, N, k, Is = 5, 16, 12, 2, 7
    w13, w2, gen = _weights(E, H, N, seed=60 + num_tokens)
    x = torch.randn(num_tokens, H, generator=gen)
    ids = (
        torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(num_tokens)])
        if num_tokens
        else torch.zeros(0, k, dtype=torch.long)
    )
    weights = torch.rand(num_tokens, k, generator=gen)
    wide = torch.randn(num_tokens, 2 * Is + 3, generator=gen) * 2  # [g | u | pad | gate]
    down = torch.randn(H, Is, generator=gen) / Is**0.5
    out = TorchMoE()(
        x, w13, w2, topk_ids=ids, topk_weights=weights, shared_gate_up=wide[:, : 2 * Is],
        shared_down=down, shared_gate=wide[:, -1:] if gated else None,
    )  # fmt: skip
    want = plain_moe(x, w13, w2, ids, weights)
    for t in range(num_tokens):
        g, u = wide[t, :Is], wide[t, Is : 2 * Is]
        h = (g / (1 + torch.exp(-g)) * u) @ down.T
        want[t] += (torch.sigmoid(wide[t, -1]) if gated else 1.0) * h
    assert out.shape == (num_tokens, H)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
