"""Tiny DFlash drafter checkpoints in z-lab's layout (config.json + model.safetensors, names
`fc.weight`, `hidden_norm.weight`, `layers.N.self_attn.q_proj.weight`, ..., `norm.weight`; no
embedding, no lm_head), every weight random (norms around 1, so a missing weight shows), plus a
stand-in target (embedding table, lm_head and a shape) for tests that need no target forward."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

HIDDEN = 32
VOCAB = 64
TARGET_LAYERS = 6


def drafter_config(**overrides: Any) -> dict[str, Any]:
    """A tiny drafter config.json: 3 layers, GQA group 3 (6 q / 2 kv heads of 8), head_dim !=
    hidden / heads, drafting keys in dflash_config."""
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "intermediate_size": 40,
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "vocab_size": VOCAB,
        "num_target_layers": TARGET_LAYERS,
        "layer_types": ["full_attention"] * 3,
        "sliding_window": None,
        "dflash_config": {"block_size": 6, "mask_token_id": VOCAB - 1, "target_layer_ids": [1, 4]},
    }
    cfg.update(overrides)
    return cfg


def random_drafter_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of a drafter checkpoint, random, by z-lab name."""
    gen = torch.Generator().manual_seed(seed)
    H, inter = cfg["hidden_size"], cfg["intermediate_size"]
    D = cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    draft = cfg.get("dflash_config") or {}
    taps = len(draft.get("target_layer_ids", cfg.get("target_layer_ids", [])))

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * cols**-0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(n, generator=gen)

    w = {"fc.weight": mat(H, taps * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        w[p + "self_attn.q_proj.weight"] = mat(hq, H)
        w[p + "self_attn.k_proj.weight"] = mat(hkv, H)
        w[p + "self_attn.v_proj.weight"] = mat(hkv, H)
        w[p + "self_attn.o_proj.weight"] = mat(H, hq)
        w[p + "self_attn.q_norm.weight"] = norm(D)
        w[p + "self_attn.k_norm.weight"] = norm(D)
        w[p + "mlp.gate_proj.weight"] = mat(inter, H)
        w[p + "mlp.up_proj.weight"] = mat(inter, H)
        w[p + "mlp.down_proj.weight"] = mat(H, inter)
        if cfg.get("attention_bias"):
            for name, n in (("q_proj", hq), ("k_proj", hkv), ("v_proj", hkv), ("o_proj", H)):
                w[p + f"self_attn.{name}.bias"] = 0.1 * torch.randn(n, generator=gen)
    return w


def write_drafter(
    path: Path, cfg: dict[str, Any], weights: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Write config.json and model.safetensors to `path`; returns the weights written."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    if weights is None:
        weights = random_drafter_weights(cfg)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return weights


class StandInTarget(nn.Module):
    """What a drafter reads from its target, without a target forward: `config.hidden_size`,
    `vocab_size`, `model.layers` (their count), `model.embed_tokens`, `compute_logits`."""

    def __init__(
        self,
        hidden: int = HIDDEN,
        vocab: int = VOCAB,
        num_layers: int = TARGET_LAYERS,
        seed: int = 1,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        gen = torch.Generator(device=device).manual_seed(seed)
        self.config = SimpleNamespace(hidden_size=hidden)
        self.vocab_size = vocab
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Identity() for _ in range(num_layers))
        self.model.embed_tokens = nn.Embedding(vocab, hidden, device=device, dtype=dtype)
        emb = torch.randn(vocab, hidden, generator=gen, device=device)
        self.model.embed_tokens.weight.data = emb.to(dtype)
        head = torch.randn(vocab, hidden, generator=gen, device=device) * hidden**-0.5
        self.register_buffer("lm_head_weight", head.to(dtype))
        self.requires_grad_(False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.lm_head_weight.T).float()


@torch.inference_mode()
def prefill_taps(model, ids: list[int], layers: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """The outputs of decoder `layers` [T, H] of deltaserve `model` (attention and GDN layers,
    reference kernels) over a prefill of `ids`."""
    from deltaserve.cache.spec import AttentionSpec
    from deltaserve.forward_context import BatchMetadata, ForwardContext, Kernels
    from deltaserve.ops.attention.reference import TorchAttentionBackend
    from deltaserve.ops.gdn import GDNKernels
    from deltaserve.ops.gdn.reference import TorchConv1d, TorchGDNDecode, TorchGDNPrefill

    block = 16
    caches = []
    for s in model.layer_specs():
        if isinstance(s, AttentionSpec):
            shape = (8, block, s.num_kv_heads, s.head_dim)
            caches.append({"k_cache": torch.zeros(shape), "v_cache": torch.zeros(shape)})
        else:
            caches.append(
                {
                    "ssm_state": torch.zeros(2, s.num_v_heads, s.head_v_dim, s.head_k_dim),
                    "conv_state": torch.zeros(2, s.conv_dim, s.conv_kernel - 1),
                }
            )
    T = len(ids)
    meta = BatchMetadata(
        slot_mapping=torch.arange(block, block + T),
        query_start_loc=torch.tensor([0, T], dtype=torch.int32),
        seq_lens=torch.tensor([T], dtype=torch.int32),
        context_lens=torch.tensor([0], dtype=torch.int32),
        block_tables=torch.arange(1, 8, dtype=torch.int32)[None],
        state_slots=torch.tensor([1]),
        has_initial_state=torch.tensor([False]),
        query_start_loc_cpu=[0, T],
        seq_lens_cpu=[T],
        context_lens_cpu=[0],
        state_slots_cpu=[1],
    )
    kernels = Kernels(
        attention=TorchAttentionBackend(),
        gdn=GDNKernels(TorchConv1d(), TorchGDNPrefill(), TorchGDNDecode()),
    )
    ctx = ForwardContext(meta=meta, caches=caches, kernels=kernels, hidden_layers=layers)
    model(torch.tensor(ids), torch.arange(T), ctx)
    return ctx.hidden_states
