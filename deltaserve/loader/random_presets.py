"""The `--random-model` presets: the text-config keyword arguments of real checkpoints (and of
a few tiny CPU-test shapes), their HF architectures and the vision presets. The configs are built
from them by deltaserve.loader.random_model.

Sources of the figures (config.json of each Hugging Face checkpoint, `text_config` part, as
quoted in public repositories; no figure below is a guess):

- qwen3.5-0.8b (Qwen/Qwen3.5-0.8B): hidden 1024, intermediate 3584, 24 layers, 8 q / 2 kv heads
  of 256, GDN 16 key / 16 value heads of 128, conv 4, tied embeddings. Quoted in full in several
  repositories' config fixtures (text_config with `"model_type": "qwen3_5_text"`, `"tie_word_
  embeddings": true`, `max_position_embeddings` 262144).
- qwen3.5-4b (Qwen/Qwen3.5-4B): hidden 2560, intermediate 9216, 32 layers, 16 / 4 heads of 256,
  GDN 16 / 32 heads of 128, tied embeddings (several fixtures "from the fetched configs",
  including one pinned to the checkpoint with `max_position_embeddings` 262144).
- qwen3.5-9b (Qwen/Qwen3.5-9B): hidden 4096, intermediate 12288, 32 layers, 16 / 4 heads of
  256, GDN 16 / 32 heads of 128, untied lm_head; a table quoting the checkpoint's config.json
  (rope_theta 1e7, partial_rotary_factor 0.25, max_position_embeddings 262144). The shape is also
  `Qwen3_5TextConfig()`'s defaults (transformers 5.17), which differ only in rope_theta (1e4) and
  max_position_embeddings (32768). Measured: 8.95 B parameters, 2.0 GB of embedding.
- qwen3.5-27b (Qwen/Qwen3.5-27B): hidden 5120, intermediate 17408, 64 layers, 24 / 4 heads of
  256, GDN 16 / 48 heads of 128, untied; a full `Qwen3_5Config(text_config={...})` copy of the
  checkpoint's config, and THUDM/slime scripts/models/qwen3.5-27B.sh (same figures).
- qwen3-0.6b (Qwen/Qwen3-0.6B): hidden 1024, intermediate 3072, 28 layers, 16 q / 8 kv heads of
  128, tied, max_position_embeddings 40960, rope_theta 1e6; published size 596,049,920
  parameters (keras-hub's qwen3_0.6b_en preset).
- qwen3-8b (Qwen/Qwen3-8B): a verbatim copy of the checkpoint's config.json: hidden 4096,
  intermediate 12288, 36 layers, 32 q / 8 kv heads of 128, untied, max_position_embeddings
  40960, rope_theta 1e6.

- qwen3.5-35b-a3b (Qwen/Qwen3.5-35B-A3B, `text_config` of Qwen3_5MoeForConditionalGeneration):
  hidden 2048, 40 layers, 16 q / 2 kv heads of 256, GDN 16 key / 32 value heads of 128, conv 4,
  256 experts top-8, moe_intermediate_size 512, shared_expert_intermediate_size 512, untied, no
  dense intermediate_size; an inventory of the checkpoint's config.json (snapshot ec2d4ec) and
  THUDM/slime scripts/models/qwen3.5-35B-A3B.sh (same figures). Published: 35B total, 3B active.
- qwen3.5-122b-a10b (Qwen/Qwen3.5-122B-A10B): hidden 3072, 48 layers, 32 q / 2 kv heads of 256,
  256 experts top-8, moe_intermediate_size 1024, vocab 248320 (model cards and spec tables quoting
  the config). Not found quoted: GDN 16 key / 64 value heads of 128 and a shared expert of 1024
  are the family's pattern (Qwen3.5-397B-A17B's GDN heads, shared width = expert width as in
  the 35B); with them the counts land at 122B total / 10B active (tests/loader/
  test_random_model_moe.py checks both within 1%).
- qwen3-next-80b-a3b (Qwen/Qwen3-Next-80B-A3B-Instruct, text-only Qwen3NextForCausalLM):
  hidden 2048, 48 layers, 16 q / 2 kv heads of 256, GDN 16 key / 32 value heads of 128, 512
  experts top-10, moe 512, shared 512, norm_topk_prob, decoder_sparse_step 1, mlp_only_layers
  [], dense intermediate_size 5120 (unused: every layer sparse), vocab 151936, rope_theta 5e6,
  partial rotary 0.25, full_attention_interval 4 (no layer_types), bos 151643, eos 151645;
  transcriptions of the checkpoint's config.json in several repositories' tests (identical).

- deepseek-v2-lite (deepseek-ai/DeepSeek-V2-Lite, DeepseekV2ForCausalLM): hidden 2048,
  intermediate 10944, 27 layers, 16 heads, q_lora_rank null, kv_lora_rank 512, rope 64, nope
  128, v 128, 64 routed experts top-6 (greedy, routed_scaling_factor 1.0), 2 shared, moe 1408,
  first_k_dense_replace 1, vocab 102400, max_position_embeddings 163840, YaRN factor 40 from
  4096 (beta_fast 32, beta_slow 1, mscale 0.707, mscale_all_dim 0.707), bos 100000, eos
  100001; the checkpoint's config.json as quoted in several repositories' tests. Published:
  15.7B total, 2.4B active.
- deepseek-v2 (deepseek-ai/DeepSeek-V2): hidden 5120, intermediate 12288, 60 layers, 128
  heads, q_lora_rank 1536, 160 routed experts top-6 (group_limited_greedy, n_group 8,
  topk_group 3, routed_scaling_factor 16.0), 2 shared, moe 1536; the rest as the Lite (same
  sources). Published: 236B total, 21B active.

All Qwen3.5 presets: vocab 248320, every 4th layer full attention (`full_attention_interval` 4),
rms_norm_eps 1e-6, eos 248044. All Qwen3 presets: vocab 151936, eos 151645.
`tiny-qwen3.5`, `tiny-qwen3.5-moe` and `tiny-deepseek-v2` are NOT real checkpoints: few-layer
shapes for CPU tests.

Vision presets (`VISION_PRESETS`): a text preset plus the vision tower, as the released
`Qwen3_5ForConditionalGeneration` checkpoints: `qwen3.5-9b-vl` takes `Qwen3_5VisionConfig()`'s
defaults (transformers 5.17: depth 27, hidden 1152, intermediate 4304, 16 heads, patch 16,
temporal patch 2, spatial merge 2, 2304 position embeddings) with out_hidden_size = the text
hidden size, and `Qwen3_5Config()`'s special token ids (image 248056, video 248057, vision
start 248053, vision end 248054). `tiny-qwen3.5-vl` (CPU tests) is a 2-block tower on
`tiny-qwen3.5` with the last four ids of its vocabulary as the special tokens.
"""

from __future__ import annotations

from typing import Any

QWEN3_5 = "Qwen3_5ForCausalLM"
QWEN3_5_MOE = "Qwen3_5MoeForCausalLM"
QWEN3_NEXT = "Qwen3NextForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
QWEN3_5_VL = "Qwen3_5ForConditionalGeneration"
DEEPSEEK_V2 = "DeepseekV2ForCausalLM"


def _qwen3_5(
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    linear_v_heads: int,
    linear_k_heads: int = 16,
    tie: bool = False,
) -> dict[str, Any]:
    """Text-config kwargs of a dense Qwen3.5 checkpoint (the fields its config.json sets)."""
    return dict(
        vocab_size=248320,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=256,
        linear_num_key_heads=linear_k_heads,
        linear_num_value_heads=linear_v_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
        ],
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=tie,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
        eos_token_id=248044,
        dtype="bfloat16",
    )


def _qwen3_5_moe(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    linear_v_heads: int,
    experts: int,
    top_k: int,
    expert_intermediate: int,
    shared_intermediate: int,
) -> dict[str, Any]:
    """Text-config kwargs of a Qwen3.5-MoE checkpoint (dense Qwen3.5's fields, the MoE block's
    instead of the MLP's intermediate_size)."""
    kwargs = _qwen3_5(hidden, 0, layers, heads, kv_heads, linear_v_heads=linear_v_heads)
    del kwargs["intermediate_size"]
    kwargs.update(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=expert_intermediate,
        shared_expert_intermediate_size=shared_intermediate,
    )
    return kwargs


def _qwen3_next_80b_a3b() -> dict[str, Any]:
    """Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (its text fields)."""
    return dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5120,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000,
            "partial_rotary_factor": 0.25,
        },
        bos_token_id=151643,
        eos_token_id=151645,
        dtype="bfloat16",
    )


def _qwen3(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, tie: bool
) -> dict[str, Any]:
    """Config kwargs of a Qwen3 (dense attention) checkpoint."""
    return dict(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=151643,
        eos_token_id=151645,
        dtype="bfloat16",
    )


def _deepseek_v2(
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    q_lora_rank: int | None,
    experts: int,
    expert_intermediate: int,
    routing: dict[str, Any],
) -> dict[str, Any]:
    """Config kwargs of a DeepSeek-V2 checkpoint (its config.json's fields, the legacy
    `rope_scaling` as released)."""
    return dict(
        vocab_size=102400,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=experts,
        n_shared_experts=2,
        num_experts_per_tok=6,
        moe_intermediate_size=expert_intermediate,
        first_k_dense_replace=1,
        norm_topk_prob=False,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        rope_theta=10000,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        bos_token_id=100000,
        eos_token_id=100001,
        dtype="bfloat16",
        **routing,
    )


def _tiny_qwen3_5() -> dict[str, Any]:
    kwargs = _qwen3_5(64, 128, 4, 4, 2, linear_v_heads=4, linear_k_heads=2)
    kwargs.update(
        vocab_size=512,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=4096,
        eos_token_id=2,
    )
    return kwargs


def _tiny_qwen3_5_moe() -> dict[str, Any]:
    kwargs = _tiny_qwen3_5()
    del kwargs["intermediate_size"]
    kwargs.update(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    )
    return kwargs


def _tiny_deepseek_v2() -> dict[str, Any]:
    kwargs = _deepseek_v2(
        64,
        128,
        3,
        4,
        32,
        8,
        32,
        dict(
            topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0
        ),
    )
    kwargs.update(
        vocab_size=512,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts_per_tok=3,
        eos_token_id=2,
    )
    return kwargs


# preset name -> text-config kwargs (see the module docstring for the source of each figure)
RANDOM_MODELS: dict[str, dict[str, Any]] = {
    "qwen3.5-0.8b": _qwen3_5(1024, 3584, 24, 8, 2, linear_v_heads=16, tie=True),
    "qwen3.5-4b": _qwen3_5(2560, 9216, 32, 16, 4, linear_v_heads=32, tie=True),
    "qwen3.5-9b": _qwen3_5(4096, 12288, 32, 16, 4, linear_v_heads=32, tie=False),
    "qwen3.5-27b": _qwen3_5(5120, 17408, 64, 24, 4, linear_v_heads=48, tie=False),
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, tie=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, tie=False),
    "qwen3.5-35b-a3b": _qwen3_5_moe(2048, 40, 16, 2, 32, 256, 8, 512, 512),
    "qwen3.5-122b-a10b": _qwen3_5_moe(3072, 48, 32, 2, 64, 256, 8, 1024, 1024),
    "qwen3-next-80b-a3b": _qwen3_next_80b_a3b(),
    "deepseek-v2-lite": _deepseek_v2(
        2048, 10944, 27, 16, None, 64, 1408, dict(topk_method="greedy", routed_scaling_factor=1.0)
    ),
    "deepseek-v2": _deepseek_v2(
        5120,
        12288,
        60,
        128,
        1536,
        160,
        1536,
        dict(
            topk_method="group_limited_greedy", n_group=8, topk_group=3, routed_scaling_factor=16.0
        ),
    ),
    "tiny-qwen3.5": _tiny_qwen3_5(),  # not a real checkpoint: CPU tests
    "tiny-qwen3.5-moe": _tiny_qwen3_5_moe(),  # not a real checkpoint: CPU tests
    "tiny-deepseek-v2": _tiny_deepseek_v2(),  # not a real checkpoint: CPU tests
}

# preset name -> HF architecture (the class deltaserve's registry maps to a model)
ARCHITECTURES: dict[str, str] = {
    name: (
        DEEPSEEK_V2
        if "deepseek-v2" in name
        else QWEN3_NEXT
        if name.startswith("qwen3-next")
        else QWEN3
        if name.startswith("qwen3-")
        else QWEN3_5_MOE
        if "num_experts" in kwargs
        else QWEN3_5
    )
    for name, kwargs in RANDOM_MODELS.items()
}


# vision preset -> (text preset, vision config overrides, special token ids or None: the
# released ones)
VISION_PRESETS: dict[str, tuple[str, dict[str, Any], dict[str, int] | None]] = {
    "qwen3.5-9b-vl": ("qwen3.5-9b", {}, None),
    "tiny-qwen3.5-vl": (
        "tiny-qwen3.5",
        dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4),
        dict(image_token_id=508, video_token_id=509, vision_start_token_id=510),
    ),
}
