"""Random-weight presets: configs match the documented checkpoints, parameter counts match the
published sizes, and `init_random_weights` gives finite, seed-deterministic outputs."""

from __future__ import annotations

import pytest
import torch

from deltaserve.forward_context import BatchMetadata, ForwardContext, Kernels
from deltaserve.loader.random_model import (
    ARCHITECTURES,
    init_random_weights,
    random_model_config,
)
from deltaserve.loader.weights import build_model
from deltaserve.models.base import AttentionSpec
from deltaserve.models.registry import get_model_class
from deltaserve.ops.attention.reference import TorchAttentionBackend
from deltaserve.ops.gdn import GDNKernels
from deltaserve.ops.gdn.reference import TorchConv1d, TorchGDNDecode, TorchGDNPrefill

# name -> (layers, full-attention layers, hidden, q heads, kv heads, GDN key / value heads, tied)
DOCUMENTED = {
    "qwen3.5-0.8b": (24, 6, 1024, 8, 2, 16, 16, True),
    "qwen3.5-4b": (32, 8, 2560, 16, 4, 16, 32, True),
    "qwen3.5-9b": (32, 8, 4096, 16, 4, 16, 32, False),
    "qwen3.5-27b": (64, 16, 5120, 24, 4, 16, 48, False),
    "qwen3-0.6b": (28, 28, 1024, 16, 8, None, None, True),
    "qwen3-8b": (36, 36, 4096, 32, 8, None, None, False),
}

# name -> (published parameter count, relative tolerance). Qwen3 counts are exact (keras-hub
# preset 596,049,920; Qwen3-8B 8.19 B); the 9B text model is 8.95 B (measured on the H200,
# November 2026); the other Qwen3.5 names count the vision tower and round, so only the name's
# size is checked, loosely.
PUBLISHED = {
    "qwen3-0.6b": (596_049_920, 1e-9),
    "qwen3-8b": (8.19e9, 0.002),
    "qwen3.5-9b": (8.95e9, 0.01),
    "qwen3.5-0.8b": (0.8e9, 0.10),
    "qwen3.5-4b": (4.0e9, 0.10),
    "qwen3.5-27b": (27e9, 0.02),
}


def _meta_model(name: str):
    hf, text, arch = random_model_config(name)
    with torch.device("meta"):
        return get_model_class(arch)(text, tie_word_embeddings=hf.tie_word_embeddings)


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _expected_count(text, tied: bool) -> int:
    """Parameters of a Qwen3 / Qwen3.5 text model, written out from the config."""
    h, i, d = text.hidden_size, text.intermediate_size, text.head_dim
    q, kv = text.num_attention_heads, text.num_key_value_heads
    qwen3_5 = hasattr(text, "linear_num_value_heads")
    total = text.vocab_size * h * (1 if tied else 2) + h  # embedding (+ lm_head), final norm
    for kind in getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers:
        total += 3 * h * i + 2 * h  # MLP, two norms
        if kind == "full_attention":
            q_out = 2 * q * d if qwen3_5 else q * d  # Qwen3.5: [query | gate] per head
            total += h * (q_out + 2 * kv * d) + q * d * h + 2 * d
        else:
            hk, hv = text.linear_num_key_heads, text.linear_num_value_heads
            kd, vd = text.linear_key_head_dim, text.linear_value_head_dim
            conv_dim = 2 * hk * kd + hv * vd
            total += h * (conv_dim + hv * vd + 2 * hv)  # in_proj: qkv, z, b, a
            total += conv_dim * text.linear_conv_kernel_dim + 2 * hv + vd  # conv, A, dt, norm
            total += hv * vd * h  # out_proj
    return total


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_preset_config_matches_documented_shape(name: str) -> None:
    hf, text, arch = random_model_config(name)
    layers, full, hidden, q, kv, lin_k, lin_v, tied = DOCUMENTED[name]
    assert hf is text and arch == ARCHITECTURES[name] and hf.architectures == [arch]
    assert text.num_hidden_layers == layers
    assert text.hidden_size == hidden
    assert (text.num_attention_heads, text.num_key_value_heads) == (q, kv)
    assert bool(hf.tie_word_embeddings) is tied
    model = _meta_model(name)
    specs = model.layer_specs()
    assert len(specs) == layers
    assert sum(isinstance(s, AttentionSpec) for s in specs) == full
    if lin_k is not None:
        assert arch == "Qwen3_5ForCausalLM"
        assert (text.linear_num_key_heads, text.linear_num_value_heads) == (lin_k, lin_v)
        assert text.layer_types[3::4] == ["full_attention"] * full  # every 4th layer
        assert text.max_position_embeddings == 262144
        assert text.vocab_size == 248320
    else:
        assert arch == "Qwen3ForCausalLM"
        assert text.max_position_embeddings == 40960
        assert text.vocab_size == 151936


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_count(name: str) -> None:
    hf, text, _ = random_model_config(name)
    n = _count(_meta_model(name))
    assert n == _expected_count(text, bool(hf.tie_word_embeddings))
    published, rtol = PUBLISHED[name]
    assert abs(n - published) <= rtol * published, f"{name}: {n / 1e9:.3f} B parameters"


def test_nine_b_preset_is_the_gpu_md_model() -> None:
    """The 9B preset: 8.95 B parameters, 17.9 GB in bf16, of which 2.0 GB is the embedding table."""
    model = _meta_model("qwen3.5-9b")
    assert 17.85e9 < 2 * _count(model) < 17.95e9
    assert round(2 * model.model.embed_tokens.weight.numel() / 1e9, 1) == 2.0


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="qwen3.5-9b"):
        random_model_config("qwen9")


def _forward_logits(model, text, token_ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Prefill `token_ids` as one sequence, then decode one token; logits of both steps."""
    bs, n = 16, len(token_ids)
    specs = model.layer_specs()
    num_blocks = n // bs + 3
    caches = []
    for s in specs:
        if isinstance(s, AttentionSpec):
            shape = (num_blocks, bs, s.num_kv_heads, s.head_dim)
            caches.append(
                dict(
                    k_cache=torch.zeros(shape, dtype=dtype), v_cache=torch.zeros(shape, dtype=dtype)
                )
            )
        else:
            caches.append(
                dict(
                    ssm_state=torch.zeros(2, s.num_v_heads, s.head_v_dim, s.head_k_dim),
                    conv_state=torch.zeros(2, s.conv_dim, s.conv_kernel - 1, dtype=dtype),
                )
            )
    kernels = Kernels(
        attention=TorchAttentionBackend(),
        gdn=GDNKernels(TorchConv1d(), TorchGDNPrefill(), TorchGDNDecode()),
    )
    table = list(range(1, num_blocks))

    def step(ids: list[int], start: int, decode: bool) -> torch.Tensor:
        pos = list(range(start, start + len(ids)))
        end = start + len(ids)
        meta = BatchMetadata(
            slot_mapping=torch.tensor([table[p // bs] * bs + p % bs for p in pos]),
            query_start_loc=torch.tensor([0, len(ids)], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            context_lens=torch.tensor([start], dtype=torch.int32),
            block_tables=torch.tensor([table], dtype=torch.int32),
            state_slots=torch.tensor([1]),
            has_initial_state=torch.tensor([start > 0]),
            query_start_loc_cpu=[0, len(ids)],
            seq_lens_cpu=[end],
            context_lens_cpu=[start],
            state_slots_cpu=[1],
            num_decodes=1 if decode else 0,
        )
        ctx = ForwardContext(meta=meta, caches=caches, kernels=kernels)
        hidden = model(torch.tensor(ids), torch.tensor(pos), ctx)
        return model.compute_logits(hidden[-1:])

    with torch.inference_mode():
        first = step(token_ids, 0, decode=False)
        second = step([int(first.argmax())], n, decode=True)
    return torch.cat([first, second])


def _tiny_model(seed: int, dtype: torch.dtype = torch.bfloat16):
    hf, text, arch = random_model_config("tiny-qwen3.5")
    model = build_model(get_model_class(arch), text, hf.tie_word_embeddings, dtype, "cpu")
    init_random_weights(model, seed)
    return model, text


@pytest.mark.parametrize("tied", [False, True])
def test_random_weights_give_finite_logits_in_bf16(tied: bool) -> None:
    hf, text, arch = random_model_config("tiny-qwen3.5")
    # eight times deeper than the preset: activations must stay finite through many layers
    text.num_hidden_layers = 32
    text.layer_types = text.layer_types * 8
    model = build_model(get_model_class(arch), text, tied, torch.bfloat16, "cpu")
    init_random_weights(model, seed=1)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all() and p.float().std() > 0 or p.numel() == 1, name
    prompt = torch.randint(0, text.vocab_size, (37,), generator=torch.Generator().manual_seed(0))
    logits = _forward_logits(model, text, prompt.tolist(), torch.bfloat16)
    assert torch.isfinite(logits).all()
    assert 0.05 < logits.std().item() < 100  # neither collapsed nor blown up


def test_random_weights_are_deterministic_per_seed() -> None:
    a, text = _tiny_model(seed=3)
    b, _ = _tiny_model(seed=3)
    c, _ = _tiny_model(seed=4)
    pa, pb, pc = dict(a.named_parameters()), dict(b.named_parameters()), dict(c.named_parameters())
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not any(torch.equal(pa[k], pc[k]) for k in pa)
    prompt = list(range(5, 30))
    assert torch.equal(
        _forward_logits(a, text, prompt, torch.bfloat16),
        _forward_logits(b, text, prompt, torch.bfloat16),
    )


def test_random_weight_scales() -> None:
    model, text = _tiny_model(seed=0, dtype=torch.float32)
    layer0 = model.model.layers[0]
    gdn = layer0.linear_attn
    a = gdn.A_log.exp()
    assert (a >= 1 - 1e-4).all() and (a <= 16 + 1e-3).all()
    dt = torch.nn.functional.softplus(gdn.dt_bias)
    assert (dt > 0.9e-3).all() and (dt < 0.11).all()
    assert layer0.input_layernorm.weight.abs().max() < 0.2  # zero-centred: 1 + w
    assert (gdn.norm.weight - 1).abs().max() < 0.2  # plain gated norm: w near 1
    w = layer0.mlp.down_proj.weight
    assert abs(w.std().item() - text.intermediate_size**-0.5) < 0.1 * text.intermediate_size**-0.5


def test_random_model_keeps_an_explicit_tokenizer(deltaserve_cache_dir):
    """A random preset has no tokenizer of its own, unless one is given (`serve
    --random-model` serves token-id prompts with the demo model's)."""
    from deltaserve.config import create_engine_config
    from deltaserve.loader.demo import ensure_demo_model

    bare = create_engine_config(None, random_model="tiny-qwen3.5", device="cpu")
    assert bare.model.tokenizer is None
    demo = str(ensure_demo_model())
    cfg = create_engine_config(None, random_model="tiny-qwen3.5", device="cpu", tokenizer=demo)
    assert cfg.model.tokenizer == demo
