"""Tiny random HF checkpoints for the parity and engine-invariant tests.

Every checkpoint is built from transformers' own config and model classes, has EVERY weight
randomised with a seeded generator (norms included: HF initialises zero-centred norm weights to
0, which would hide a missing `1 + w`), and is written with `save_pretrained` (the real on-disk
format: sharded or not, bf16 or fp32). `build_model` returns the directory and the HF model
reloaded from that directory in float32 eval mode, to serve as the oracle.

Shapes are chosen to catch layout bugs: GQA groups 1, 3, 5, head_dim != hidden / heads, GDN
value / key head ratios 1, 2, 3 with K != V, hybrid layer patterns where a full-attention layer is
not only last, tied and untied embeddings.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)


def _hf_reference_kernels_only() -> None:
    """Make HF's GDN layers use their own torch functions even where fla-core or causal-conv1d
    is installed (the GPU machine): transformers binds those packages' kernels at import, and
    fla's Triton kernels cannot take the CPU tensors of the float32 oracle. The oracle is the
    readable torch path; `inspect.unwrap` reaches it through transformers' kernel wrappers."""
    import importlib
    import inspect

    names = (
        "torch_chunk_gated_delta_rule",
        "torch_recurrent_gated_delta_rule",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    )
    for family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for name in names:
            fn = getattr(module, name, None)
            if fn is not None:
                setattr(module, name, inspect.unwrap(fn))


_hf_reference_kernels_only()


# A token id the random models emit now and then; set as eos so `ignore_eos` matters.
EOS_TOKEN_ID = 2
MAX_POSITIONS = 512


@dataclass(frozen=True)
class ModelSpec:
    """One tiny checkpoint: which HF class, which config overrides, how it is saved."""

    name: str
    # "qwen3" | "qwen3_5" (text, Qwen3_5ForCausalLM) | "qwen3_5_vl" (ConditionalGeneration) |
    # "qwen3_5_moe" (text) | "qwen3_5_moe_vl" | "qwen3_next" | "deepseek_v2"
    family: str
    config: dict[str, Any] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    dtype: str = "float32"  # on-disk dtype: "float32" | "bfloat16"
    max_shard_size: str | None = None  # e.g. "40KB": several shards + an index json
    fake_mtp: bool = False  # add an extra "mtp.*" tensor to the safetensors file (must be skipped)
    # MoE only: rewrite HF's per-expert tensors (what save_pretrained writes) into the released
    # fused layout, experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]
    fused_experts: bool = False
    seed: int = 0


def _qwen3_text_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,  # != hidden / heads (= 8)
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return kwargs


def _qwen3_5_text_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,  # partial rotary 0.25 -> rotary dim 8
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,  # K != V
        linear_conv_kernel_dim=4,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,  # see _GAINS
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return kwargs


# ---------------------------------------------------------------------------------------------
# The variants. Names are used as pytest ids.
# ---------------------------------------------------------------------------------------------

QWEN3_SPECS = [
    # GQA group 1 (3 kv / 3 q), untied, head_dim 16 != 48 / 3.
    ModelSpec(
        "qwen3_g1", "qwen3", _qwen3_text_kwargs(num_attention_heads=3, num_key_value_heads=3)
    ),
    # GQA group 3 (2 kv / 6 q), tied embeddings, sharded save.
    ModelSpec(
        "qwen3_g3_tied_sharded",
        "qwen3",
        _qwen3_text_kwargs(num_attention_heads=6, num_key_value_heads=2),
        tie_word_embeddings=True,
        max_shard_size="40KB",
        seed=3,
    ),
    # GQA group 5 (2 kv / 10 q: with 1 kv head a wrong kv-head mapping would go unseen),
    # head_dim 24, 3 layers, odd vocab.
    ModelSpec(
        "qwen3_g5",
        "qwen3",
        _qwen3_text_kwargs(
            num_attention_heads=10,
            num_key_value_heads=2,
            head_dim=24,
            num_hidden_layers=3,
            vocab_size=263,
        ),
        seed=5,
    ),
]

QWEN3_5_SPECS = [
    # value/key head ratio 2 (HK=2, HV=4), attention GQA group 3 (2 kv / 6 q), untied.
    ModelSpec("qwen3_5_r2_g3", "qwen3_5", _qwen3_5_text_kwargs()),
    # ratio 1 (HK=2, HV=2), attention GQA group 1, tied, full attention at layers 0 and 2.
    ModelSpec(
        "qwen3_5_r1_g1_tied",
        "qwen3_5",
        _qwen3_5_text_kwargs(
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            layer_types=[
                "full_attention",
                "linear_attention",
                "full_attention",
                "linear_attention",
            ],
        ),
        tie_word_embeddings=True,
        seed=1,
    ),
    # ratio 3 (HK=2, HV=6: value head j reads key head j // 3, which HK=1 could not tell from
    # j % HK), attention MQA (3 q / 1 kv), bf16 on disk, sharded.
    ModelSpec(
        "qwen3_5_r3_bf16_sharded",
        "qwen3_5",
        _qwen3_5_text_kwargs(
            linear_num_key_heads=2,
            linear_num_value_heads=6,
            num_attention_heads=3,
            num_key_value_heads=1,
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
        ),
        dtype="bfloat16",
        max_shard_size="40KB",
        seed=3,
    ),
    # The multimodal layout: model.language_model.*, model.visual.*, lm_head, plus a fake mtp.*.
    ModelSpec(
        "qwen3_5_vl",
        "qwen3_5_vl",
        _qwen3_5_text_kwargs(),
        fake_mtp=True,
        seed=7,
    ),
]


def _qwen3_5_moe_text_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs = _qwen3_5_text_kwargs(
        num_experts=10,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=40,
    )
    kwargs.pop("intermediate_size")
    kwargs.update(overrides)
    return kwargs


QWEN3_5_MOE_SPECS = [
    # 10 experts, top-3; attention GQA group 3 (6 q / 2 kv), linear v/k head ratio 2, K != V;
    # per-expert tensors (HF save_pretrained's layout).
    ModelSpec("qwen3_5_moe_e10k3_g3", "qwen3_5_moe", _qwen3_5_moe_text_kwargs(), seed=21),
    # 12 experts, top-4; GQA group 5 (10 q / 2 kv); the released fused-experts layout.
    ModelSpec(
        "qwen3_5_moe_e12k4_g5_fused",
        "qwen3_5_moe",
        _qwen3_5_moe_text_kwargs(
            num_experts=12, num_experts_per_tok=4, num_attention_heads=10, num_key_value_heads=2
        ),
        fused_experts=True,
        seed=22,
    ),
    # The multimodal layout (model.language_model.*, model.visual.*, fake mtp.*), fused experts.
    ModelSpec(
        "qwen3_5_moe_vl_fused",
        "qwen3_5_moe_vl",
        _qwen3_5_moe_text_kwargs(),
        fake_mtp=True,
        fused_experts=True,
        seed=23,
    ),
]


def _qwen3_next_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs = _qwen3_5_moe_text_kwargs(
        intermediate_size=80,  # the dense layers' MLP (decoder_sparse_step, mlp_only_layers)
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    )
    kwargs.update(overrides)
    return kwargs


QWEN3_NEXT_SPECS = [
    # 10 experts top-3, norm_topk_prob true; GDN v/k head ratio 2 (HK=2, HV=4), K=16 != V=24;
    # attention GQA group 3; every layer sparse.
    ModelSpec("qwen3_next_e10k3_r2", "qwen3_next", _qwen3_next_kwargs(), seed=31),
    # 12 experts top-4, norm_topk_prob false; ratio 3 (HK=2, HV=6); GQA group 5;
    # decoder_sparse_step 2 (layers 1 and 3 sparse, 0 and 2 dense MLPs).
    ModelSpec(
        "qwen3_next_e12k4_r3_step2_nonorm",
        "qwen3_next",
        _qwen3_next_kwargs(
            num_experts=12,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            linear_num_value_heads=6,
            num_attention_heads=10,
            num_key_value_heads=2,
            decoder_sparse_step=2,
        ),
        seed=32,
    ),
    # 10 experts top-4, norm_topk_prob false; ratio 2; mlp_only_layers [0, 2]; 5 layers, full
    # attention from full_attention_interval 2 (layers 1 and 3); fused experts on disk.
    ModelSpec(
        "qwen3_next_e10k4_r2_mlponly_fused",
        "qwen3_next",
        {
            k: v
            for k, v in _qwen3_next_kwargs(
                num_experts_per_tok=4,
                norm_topk_prob=False,
                mlp_only_layers=[0, 2],
                num_hidden_layers=5,
                full_attention_interval=2,
                linear_key_head_dim=24,
                linear_value_head_dim=16,
            ).items()
            if k != "layer_types"
        },
        fused_experts=True,
        seed=33,
    ),
]


def _deepseek_v2_kwargs(**overrides: Any) -> dict[str, Any]:
    """A tiny DeepSeek-V2: MLA with nope 16 != v 12, rope 8, latent 24; layer 0 dense, then MoE
    (10 experts top-3, 2 shared); YaRN with mscale != mscale_all_dim."""
    kwargs: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,
        q_lora_rank=None,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=10,
        num_experts_per_tok=3,
        n_shared_experts=2,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
        topk_method="greedy",
        routed_scaling_factor=1.7,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.9,
            "mscale_all_dim": 0.6,
        },
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return kwargs


DEEPSEEK_V2_SPECS = [
    # q_proj (no q LoRA), greedy routing scaled by 1.7, YaRN (mscale 0.9, mscale_all_dim 0.6),
    # a dense first layer, 2 shared experts.
    ModelSpec("deepseek_v2_qproj_greedy_yarn", "deepseek_v2", _deepseek_v2_kwargs(), seed=41),
    # q LoRA 20, 6 heads, group-limited routing (12 experts in 4 groups, 2 kept, top-3, scaled
    # by 2.5), 1 shared expert, no dense layer, default rope, sharded checkpoint.
    ModelSpec(
        "deepseek_v2_qlora_grouped_sharded",
        "deepseek_v2",
        _deepseek_v2_kwargs(
            q_lora_rank=20,
            num_attention_heads=6,
            n_routed_experts=12,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            routed_scaling_factor=2.5,
            n_shared_experts=1,
            first_k_dense_replace=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        max_shard_size="40KB",
        seed=43,
    ),
]

ALL_SPECS = QWEN3_SPECS + QWEN3_5_SPECS  # dense models (tests/models/test_hf_parity.py)
# tensor parallelism with fewer kv heads than ranks (tests/distributed): GQA group 4, 2 kv / 8 q
# heads (at TP=4 each kv head is held by 2 ranks), 1 kv / 4 q heads (at TP=2 on both ranks)
TP_KV_SPECS = [
    ModelSpec(
        "qwen3_g4_kv2",
        "qwen3",
        _qwen3_text_kwargs(num_attention_heads=8, num_key_value_heads=2),
        seed=4,
    ),
    ModelSpec(
        "qwen3_g4_kv1",
        "qwen3",
        _qwen3_text_kwargs(num_attention_heads=4, num_key_value_heads=1),
        seed=6,
    ),
]
SPECS_BY_NAME = {
    s.name: s
    for s in ALL_SPECS + QWEN3_5_MOE_SPECS + QWEN3_NEXT_SPECS + TP_KV_SPECS + DEEPSEEK_V2_SPECS
}


# ---------------------------------------------------------------------------------------------
# Construction
# ---------------------------------------------------------------------------------------------


def _make_config(spec: ModelSpec):
    if spec.family == "qwen3":
        return Qwen3Config(**spec.config, tie_word_embeddings=spec.tie_word_embeddings)
    if spec.family == "qwen3_5":
        return Qwen3_5TextConfig(**spec.config, tie_word_embeddings=spec.tie_word_embeddings)
    if spec.family == "qwen3_5_moe":
        return Qwen3_5MoeTextConfig(**spec.config, tie_word_embeddings=spec.tie_word_embeddings)
    if spec.family == "qwen3_next":
        return Qwen3NextConfig(**spec.config, tie_word_embeddings=spec.tie_word_embeddings)
    if spec.family == "deepseek_v2":
        return DeepseekV2Config(**spec.config, tie_word_embeddings=spec.tie_word_embeddings)
    if spec.family in ("qwen3_5_vl", "qwen3_5_moe_vl"):
        text = dict(spec.config, tie_word_embeddings=spec.tie_word_embeddings)
        hidden = text["hidden_size"]
        vision = dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=hidden,
            num_position_embeddings=16,
        )
        vocab = text["vocab_size"]
        config_cls = Qwen3_5MoeConfig if spec.family == "qwen3_5_moe_vl" else Qwen3_5Config
        return config_cls(
            text_config=text,
            vision_config=vision,
            image_token_id=vocab - 4,
            video_token_id=vocab - 3,
            vision_start_token_id=vocab - 2,
            vision_end_token_id=vocab - 1,
            tie_word_embeddings=spec.tie_word_embeddings,
            eos_token_id=EOS_TOKEN_ID,
        )
    raise ValueError(f"unknown family {spec.family!r}")


def _model_class(spec: ModelSpec):
    return {
        "qwen3": Qwen3ForCausalLM,
        "qwen3_5": Qwen3_5ForCausalLM,
        "qwen3_5_vl": Qwen3_5ForConditionalGeneration,
        "qwen3_5_moe": Qwen3_5MoeForCausalLM,
        "qwen3_5_moe_vl": Qwen3_5MoeForConditionalGeneration,
        "qwen3_next": Qwen3NextForCausalLM,
        "deepseek_v2": DeepseekV2ForCausalLM,
    }[spec.family]


# Larger init for a few projections (by module name); 1/sqrt(fan_in) for the rest.
# NOTE: conditioning. The GDN output o = S q feeds a gated RMSNorm that rescales each head to unit
# RMS; where o is small by cancellation (q nearly orthogonal to the few keys a fast-decaying state
# holds), fp32 rounding is amplified, and with unit-scale values, A up to 8 and eps 1e-6 HF's own
# fp32 forward drifted up to 2e-4 (logprobs) from float64 on these tiny models: too close to the
# 1e-4 parity tolerance. Larger values (in_proj_qkv gain 4), decays A in [0.05, 2) and eps 1e-5
# for Qwen3.5 keep both fp32 implementations within ~2e-5 of each other on 37-token prompts.
# MoE routers ("gate", [E, H]) get gain 4: peaky routing (logits of std ~4), so that the top-k
# sets vary from token to token and are not near ties.
_GAINS = {"lm_head": 2.0, "in_proj_qkv": 4.0, "in_proj_qkvz": 4.0, "gate": 4.0}

# Norm classes whose forward is `x_hat * (1 + w)` (weights centred at 0).
_ZERO_CENTRED_NORMS = {"Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm"}


@torch.no_grad()
def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded random values (norms, A_log and dt_bias included).

    Linear / embedding weights get unit-scale activations (normal(0, 1/sqrt(fan_in))) so the tiny
    models have well separated logits (greedy argmax is not a near tie).
    """
    gen = torch.Generator().manual_seed(seed)
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)

    def normal(shape, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std + mean

    done: set[int] = set()
    for mod_name, module in model.named_modules():
        cls = type(module).__name__
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in done:  # tied weights: randomise once
                continue
            done.add(id(p))
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if "Norm" in cls and p_name == "weight":
                if cls in _ZERO_CENTRED_NORMS:
                    value = normal(p.shape, 0.1)
                else:  # plain weight (Qwen3RMSNorm, RMSNormGated, LayerNorm)
                    value = normal(p.shape, 0.1, mean=1.0)
            elif p_name == "A_log":
                value = (
                    torch.rand(p.shape, generator=gen).mul(1.95).add(0.05).log()
                )  # A in [0.05, 2)
            elif p_name == "dt_bias":
                value = normal(p.shape, 0.5)
            elif p_name == "bias":
                value = normal(p.shape, 0.1)
            elif isinstance(module, torch.nn.Embedding):
                # NOTE: tied embeddings use a smaller scale: with |E_t|^2 large, the residual's copy
                # of the current token dominates its own logit and greedy decoding just repeats.
                scale = 1.0 if tied else 2.0
                value = normal(p.shape, scale / math.sqrt(p.shape[1]))
            elif isinstance(module, torch.nn.Conv1d):  # GDN depthwise conv [C, 1, k]
                value = normal(p.shape, 1.0 / math.sqrt(p.shape[-1]))
            elif p.dim() >= 2:
                # stacked experts [E, out, in]: each expert's matrix has fan-in `in`
                fan_in = p.shape[-1] if p.dim() == 3 else math.prod(p.shape[1:])
                gain = _GAINS.get(full.rsplit(".", 2)[-2], 1.0)
                value = normal(p.shape, gain / math.sqrt(fan_in))
            else:
                value = normal(p.shape, 0.1)
            p.copy_(value.to(p.dtype))


def build_model(
    spec: ModelSpec | str, out_dir: str | Path, load_oracle: bool = True
) -> tuple[Path, torch.nn.Module | None]:
    """Build, randomise and save `spec` into `out_dir`.

    Returns (dir, oracle): the oracle is the HF model reloaded from `out_dir` in float32 eval mode
    (so a bf16 checkpoint's oracle carries the same bf16-rounded weights as the engine sees).
    """
    if isinstance(spec, str):
        spec = SPECS_BY_NAME[spec]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _make_config(spec)
    cls = _model_class(spec)
    torch.manual_seed(spec.seed)
    model = cls(config).eval()
    randomize_weights(model, spec.seed)
    if spec.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype]
    model = model.to(dtype)
    save_kwargs: dict[str, Any] = {}
    if spec.max_shard_size is not None:
        save_kwargs["max_shard_size"] = spec.max_shard_size
    model.save_pretrained(out_dir, **save_kwargs)
    if spec.max_shard_size is not None:
        assert (out_dir / "model.safetensors.index.json").exists(), "expected a sharded save"

    oracle = None
    if load_oracle:
        oracle = cls.from_pretrained(out_dir, dtype=torch.float32).eval()
    if spec.fake_mtp:
        add_tensor(out_dir, "mtp.fc.weight", torch.randn(8, 8).to(dtype))
    if spec.fused_experts:
        fuse_experts(out_dir)
    return out_dir, oracle


# ---------------------------------------------------------------------------------------------
# Checkpoint surgery (for load-error tests)
# ---------------------------------------------------------------------------------------------


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    return sorted(model_dir.glob("*.safetensors"))


def _file_holding(model_dir: Path, name: str) -> Path:
    for f in safetensors_files(model_dir):
        if name in load_file(f):
            return f
    raise KeyError(f"{name} not in any safetensors file of {model_dir}")


def tensor_names(model_dir: str | Path) -> list[str]:
    names: list[str] = []
    for f in safetensors_files(model_dir):
        names.extend(load_file(f).keys())
    return sorted(names)


def _rewrite(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def _update_index(model_dir: Path, name: str, filename: str | None) -> None:
    index = model_dir / "model.safetensors.index.json"
    if not index.exists():
        return
    data = json.loads(index.read_text())
    if filename is None:
        data["weight_map"].pop(name, None)
    else:
        data["weight_map"][name] = filename
    index.write_text(json.dumps(data, indent=2))


def remove_tensor(model_dir: str | Path, name: str) -> None:
    """Rewrite the checkpoint without tensor `name` (index updated too)."""
    model_dir = Path(model_dir)
    f = _file_holding(model_dir, name)
    tensors = load_file(f)
    del tensors[name]
    _rewrite(f, tensors)
    _update_index(model_dir, name, None)


def replace_tensor(model_dir: str | Path, name: str, value: torch.Tensor) -> None:
    """Rewrite the checkpoint with tensor `name` replaced by `value` (e.g. a mis-shaped one)."""
    model_dir = Path(model_dir)
    f = _file_holding(model_dir, name)
    tensors = load_file(f)
    tensors[name] = value
    _rewrite(f, tensors)


def add_tensor(model_dir: str | Path, name: str, value: torch.Tensor) -> None:
    """Rewrite the (first) checkpoint file with an extra tensor `name` (index updated too)."""
    model_dir = Path(model_dir)
    f = safetensors_files(model_dir)[0]
    tensors = load_file(f)
    tensors[name] = value
    _rewrite(f, tensors)
    _update_index(model_dir, name, f.name)


_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")


def fuse_experts(model_dir: str | Path) -> None:
    """Rewrite per-expert tensors `<p>.experts.{e}.{gate,up,down}_proj.weight` into the released
    fused layout: `<p>.experts.gate_up_proj` [E, 2I, H] (gate rows first) and
    `<p>.experts.down_proj` [E, H, I] (unsharded checkpoints only)."""
    model_dir = Path(model_dir)
    (f,) = safetensors_files(model_dir)
    tensors = load_file(f)
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in list(tensors):
        m = _EXPERT.match(name)
        if m:
            per = groups.setdefault(m["prefix"], {}).setdefault(int(m["e"]), {})
            per[m["proj"]] = tensors.pop(name)
    assert groups, "no per-expert tensors to fuse"
    for prefix, experts in groups.items():
        order = [experts[e] for e in sorted(experts)]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([x["gate_proj"], x["up_proj"]]) for x in order]
        )
        tensors[f"{prefix}.down_proj"] = torch.stack([x["down_proj"] for x in order])
    _rewrite(f, tensors)


def set_architectures(model_dir: str | Path, architectures: list[str]) -> None:
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    cfg["architectures"] = architectures
    path.write_text(json.dumps(cfg, indent=2))
