"""What the engine reads off a model: the global vocabulary, one cache spec per decoder layer
(from its mixer), and the FFN called as `ffn(h, ctx)`."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.cache.spec import AttentionSpec, GDNSpec
from deltaserve.forward_context import BatchMetadata, ForwardContext, Kernels
from deltaserve.layers.attention import Attention
from deltaserve.layers.gdn import GatedDeltaNet
from deltaserve.loader.random_model import init_random_weights, random_model_config
from deltaserve.loader.weights import build_model
from deltaserve.models.registry import get_model_class
from deltaserve.ops.attention.reference import TorchAttentionBackend
from deltaserve.ops.gdn import GDNKernels
from deltaserve.ops.gdn.reference import TorchConv1d, TorchGDNDecode, TorchGDNPrefill


def _tiny(dtype=torch.float32):
    hf, text, arch = random_model_config("tiny-qwen3.5")
    model = build_model(get_model_class(arch), text, hf.tie_word_embeddings, dtype, "cpu")
    init_random_weights(model, seed=0)
    return model, text


def test_vocab_size_and_layer_specs_from_mixers():
    model, text = _tiny()
    assert model.vocab_size == text.vocab_size == 512
    specs = model.layer_specs()
    assert len(specs) == text.num_hidden_layers
    for kind, spec, layer in zip(text.layer_types, specs, model.model.layers, strict=True):
        if kind == "full_attention":
            assert isinstance(layer.self_attn, Attention) and layer.mixer is layer.self_attn
            assert layer.self_attn.output_gate
            assert spec == AttentionSpec(text.num_attention_heads, text.num_key_value_heads, 16)
        else:
            assert isinstance(layer.linear_attn, GatedDeltaNet)
            assert layer.mixer is layer.linear_attn
            assert spec == GDNSpec(2, 4, 16, 16, 4)


class RecordingFFN(nn.Module):
    """Wraps an FFN and records the context it is called with."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.seen: list[ForwardContext] = []

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        self.seen.append(ctx)
        return self.inner(h, ctx)


def test_ffn_is_called_with_the_forward_context():
    model, _ = _tiny()
    for layer in model.model.layers:
        layer.mlp = RecordingFFN(layer.mlp)
    caches = []
    for s in model.layer_specs():
        shapes = s.tensors(4 if s.pool == "paged" else 2, 16, torch.float32, torch.float32)
        caches.append({n: torch.zeros(shape, dtype=dt) for n, (shape, dt) in shapes.items()})
    n = 9
    meta = BatchMetadata(
        slot_mapping=torch.arange(16, 16 + n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        context_lens=torch.tensor([0], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2]], dtype=torch.int32),
        state_slots=torch.tensor([1]),
        has_initial_state=torch.tensor([False]),
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
        context_lens_cpu=[0],
        state_slots_cpu=[1],
    )
    kernels = Kernels(
        attention=TorchAttentionBackend(),
        gdn=GDNKernels(TorchConv1d(), TorchGDNPrefill(), TorchGDNDecode()),
    )
    ctx = ForwardContext(meta=meta, caches=caches, kernels=kernels)
    with torch.inference_mode():
        out = model(torch.arange(3, 3 + n), torch.arange(n), ctx)
    assert out.shape == (n, 64) and torch.isfinite(out).all()
    assert all(layer.mlp.seen == [ctx] for layer in model.model.layers)
