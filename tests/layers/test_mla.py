"""MLAttention's absorbed math against the expanded form, the DeepSeek rotary / YaRN against HF,
and DeepSeek routing against HF's router (float32, CPU).

The expanded form is written here from the layer's own weights: K / V are expanded from the
latent with kv_b_proj (per head [k_nope | v]), k_pe is broadcast to every head, and plain causal
softmax attention runs over the whole history. The engine runs only the absorbed form (q_nope @
W_UK against the cached latent, then @ W_UV), through the `mla` op and a paged latent cache.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_TESTS_DIR = Path(__file__).resolve().parents[1]
if str(_TESTS_DIR / "ops") not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR / "ops"))

from meta_helpers import make_meta  # noqa: E402

from deltaserve.forward_context import ForwardContext, Kernels  # noqa: E402
from deltaserve.layers.mla import MLAttention  # noqa: E402
from deltaserve.layers.yarn import deepseek_rope_from_config  # noqa: E402
from deltaserve.ops.fused.reference import apply_interleaved_rotary  # noqa: E402
from deltaserve.ops.mla.reference import TorchMLABackend  # noqa: E402
from deltaserve.ops.moe.grouped_topk import deepseek_route  # noqa: E402

H, HIDDEN, R, N, P, V = 3, 40, 20, 12, 8, 10
BLOCK = 4


def _layer(q_lora_rank: int | None, seed: int) -> tuple[MLAttention, torch.Tensor]:
    """A random layer (float32) and kv_b_proj's weight before it is split after loading."""
    gen = torch.Generator().manual_seed(seed)
    config = type("C", (), {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    rotary, _ = deepseek_rope_from_config(config, P)
    layer = MLAttention(0, HIDDEN, H, q_lora_rank, R, N, P, V, rotary, (N + P) ** -0.5 * 1.3)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    kv_b = layer.kv_b_proj.weight.detach().clone()
    layer.process_weights_after_loading()
    assert layer.kv_b_proj is None and layer.w_uk.shape == (H, N, R)
    return layer, kv_b


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _expanded(layer: MLAttention, kv_b: torch.Tensor, x: torch.Tensor, pos: torch.Tensor):
    """Plain causal MLA of one sequence x [T, hidden] at positions `pos`, keys and values
    expanded from the latent."""
    T = x.shape[0]
    y = layer.fused_qkv_a_proj(x)
    q_part, kv_a = layer.fused_qkv_a_proj.split(y)
    if layer.q_lora_rank is not None:
        n = layer.q_a_layernorm
        q = layer.q_b_proj(_rms(q_part, n.weight, n.eps))
    else:
        q = q_part
    q = q.view(T, H, N + P)
    c_kv = _rms(kv_a[:, :R], layer.kv_a_layernorm.weight, layer.kv_a_layernorm.eps)
    cos, sin = layer.rotary.cos_sin(pos)
    q_pe = apply_interleaved_rotary(q[..., N:], cos, sin)
    k_pe = apply_interleaved_rotary(kv_a[:, R:], cos, sin)  # [T, P]
    kv = (c_kv @ kv_b.T).view(T, H, N + V)
    k = torch.cat([kv[..., :N], k_pe[:, None, :].expand(T, H, P)], dim=-1)  # [T, H, N + P]
    v = kv[..., N:]
    qf = torch.cat([q[..., :N], q_pe], dim=-1)
    scores = torch.einsum("thd,shd->hts", qf, k) * layer.scale
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    o = torch.einsum("hts,shv->thv", probs, v).reshape(T, H * V)
    return layer.o_proj(o)


@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_absorbed_equals_expanded(q_lora_rank):
    """Prefill of 9 tokens, then 2 decode steps and a 3-token chunk through the paged latent
    cache (blocks out of order): each step equals the expanded attention over the history."""
    layer, kv_b = _layer(q_lora_rank, seed=7)
    gen = torch.Generator().manual_seed(1)
    total = 15
    x = torch.randn(total, HIDDEN, generator=gen)
    pos = torch.arange(total) + 3  # positions need not start at 0
    with torch.no_grad():
        want = _expanded(layer, kv_b, x, pos)
    blocks = [5, 2, 7, 1]  # block table of the sequence
    cache = torch.full((8, BLOCK, R + P), float("nan"))  # untouched slots must not be read
    kernels = Kernels(mla=TorchMLABackend())
    done = 0
    for step in (9, 1, 1, 3, 1):
        slots = [blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(done, done + step)]
        meta = make_meta([step], [done], block_tables=[blocks], slot_mapping=slots)
        ctx = ForwardContext(meta=meta, caches=[{"latent_cache": cache}], kernels=kernels)
        with torch.no_grad():
            got = layer(pos[done : done + step], x[done : done + step], ctx)
        torch.testing.assert_close(got, want[done : done + step], rtol=1e-5, atol=1e-5)
        done += step
    assert done == total


def test_interleaved_rotary_and_yarn_match_hf():
    """cos / sin (YaRN blend and attention factor) and the pairwise rotation equal HF's
    DeepseekV2RotaryEmbedding + apply_rotary_emb; the softmax scale equals HF's."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf

    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.5,
    }
    cfg = DeepseekV2Config(
        hidden_size=64,
        num_attention_heads=2,
        qk_rope_head_dim=16,
        qk_nope_head_dim=8,
        v_head_dim=8,
        kv_lora_rank=16,
        q_lora_rank=None,
        max_position_embeddings=163840,
        rope_parameters=rope,
    )
    rotary, scale_mult = deepseek_rope_from_config(cfg, 16)
    pos = torch.tensor([0, 1, 5, 4095, 4096, 70000])
    freqs_cis = hf.DeepseekV2RotaryEmbedding(cfg)(torch.zeros(1), pos[None])[0]  # [T, 8]
    cos, sin = rotary.cos_sin(pos)
    torch.testing.assert_close(cos, freqs_cis.real, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, freqs_cis.imag, rtol=1e-6, atol=1e-6)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, len(pos), 16, generator=gen)  # [B, H, T, P]
    k = torch.randn(1, 1, len(pos), 16, generator=gen)
    q_hf, k_hf = hf.apply_rotary_emb(q, k, freqs_cis[None])
    torch.testing.assert_close(
        apply_interleaved_rotary(q[0].transpose(0, 1), cos, sin), q_hf[0].transpose(0, 1)
    )
    torch.testing.assert_close(apply_interleaved_rotary(k[0, 0], cos, sin), k_hf[0, 0])
    attn = hf.DeepseekV2Attention(cfg, 0)
    assert abs((8 + 16) ** -0.5 * scale_mult - attn.scaling) < 1e-9
    # the scale and the cos / sin really change: mscale_all_dim 0.5 and mscale 0.707 at 40
    assert scale_mult > 1.3 and rotary.attention_factor > 1.05


@pytest.mark.parametrize(
    "method, n_group, topk_group, scale",
    [
        ("greedy", None, None, 1.0),
        ("greedy", None, None, 16.0),
        ("group_limited_greedy", 4, 2, 2.5),
    ],
)
def test_routing_matches_hf_router(method, n_group, topk_group, scale):
    """Ids and weights equal HF's DeepseekV2TopkRouter on peaky random logits; group-limited
    routing differs from greedy on some tokens (the mask matters)."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf

    cfg = DeepseekV2Config(
        hidden_size=32,
        num_attention_heads=2,
        n_routed_experts=16,
        num_experts_per_tok=3,
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=scale,
    )
    router = hf.DeepseekV2TopkRouter(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=gen))
    x = torch.randn(64, 32, generator=gen)
    logits, hf_w, hf_ids = router(x)
    ids, w = deepseek_route(logits, 3, method, n_group, topk_group, scale)
    order_hf, order = hf_ids.sort(-1).indices, ids.sort(-1).indices
    assert torch.equal(hf_ids.gather(1, order_hf), ids.gather(1, order))
    torch.testing.assert_close(hf_w.gather(1, order_hf), w.gather(1, order))
    if method == "group_limited_greedy":
        greedy, _ = deepseek_route(logits, 3, "greedy")
        assert not torch.equal(greedy.sort(-1).values, ids.sort(-1).values)


def test_bad_routing_config_is_named():
    with pytest.raises(ValueError, match="topk_method 'noaux_tc'"):
        deepseek_route(torch.zeros(2, 8), 2, "noaux_tc")
    with pytest.raises(ValueError, match="n_group"):
        deepseek_route(torch.zeros(2, 8), 2, "group_limited_greedy", 3, 2)


def test_expands_decides_per_step(monkeypatch):
    """MLAttention.expands under DELTASERVE_MLA_PREFILL=auto: the backend's expanded_min_query
    against the longest prefill query, mixed steps only where the backend attends decode rows
    alone, never all-decode steps, and no sequence over EXPANDED_MAX_BYTES of expansion
    (`expanded_bytes`, V2-Lite's widths: 8192 latents fit, 32768 do not); `absorbed` /
    `expanded` force either for steps with prefill rows."""
    from deltaserve.ops.mla import expanded as mla_expanded

    monkeypatch.delenv("DELTASERVE_MLA_PREFILL", raising=False)
    layer, _ = _layer(None, seed=3)
    assert layer.prefill_mode == "auto"
    backend = TorchMLABackend()
    cache = torch.zeros(4, BLOCK, R + P)

    def ctx(q_lens, context_lens, num_decodes=0):  # noqa: ANN001, ANN202
        meta = make_meta(q_lens, context_lens, num_decodes)
        return ForwardContext(
            meta=meta, caches=[{"latent_cache": cache}], kernels=Kernels(mla=backend)
        )

    assert not layer.expands(ctx([20], [0]))  # the torch backend's threshold: None
    monkeypatch.setattr(TorchMLABackend, "expanded_min_query", 16)
    assert layer.expands(ctx([16], [0])) and layer.expands(ctx([3, 16], [0, 40]))
    assert not layer.expands(ctx([15], [0])) and not layer.expands(ctx([1, 1], [5, 9], 2))
    assert layer.expands(ctx([1, 20], [9, 0], 1))  # a mixed step: the torch backend serves it
    monkeypatch.setattr(TorchMLABackend, "decodes_alone", False)
    assert not layer.expands(ctx([1, 20], [9, 0], 1)) and layer.expands(ctx([20], [0]))
    # the memory cap: this sequence's expansion is its bound's worth, one latent more is over
    need = mla_expanded.expanded_bytes(60, 20, H, R, P, N, V, cache.element_size())
    monkeypatch.setattr(mla_expanded, "EXPANDED_MAX_BYTES", need)
    assert layer.expands(ctx([20], [40])) and not layer.expands(ctx([20], [41]))
    assert not layer.expands(ctx([16, 20], [0, 41]))  # every sequence must fit
    lite = (16, 512, 64, 128, 128, 2)  # heads, R, P, N, V, bf16
    assert mla_expanded.expanded_bytes(8192, 8192, *lite) <= 512 * 2**20
    assert mla_expanded.expanded_bytes(32768, 8192, *lite) > 512 * 2**20
    for mode, want in (("absorbed", False), ("expanded", True)):
        monkeypatch.setenv("DELTASERVE_MLA_PREFILL", mode)
        forced, _ = _layer(None, seed=3)
        assert forced.expands(ctx([2], [41])) is want
        assert not forced.expands(ctx([1], [5], 1))  # all-decode steps: always absorbed
