"""Loading z-lab DFlash drafter checkpoints: config keys in dflash_config or at the top level,
weights by z-lab name into the fused layers, and clear errors for malformed drafters or ones
that do not fit their target."""

from __future__ import annotations

import json

import pytest
import torch
from dflash_helpers import (
    HIDDEN,
    TARGET_LAYERS,
    VOCAB,
    StandInTarget,
    drafter_config,
    write_drafter,
)

from deltaserve.loader.weights import WeightLoadError
from deltaserve.spec.dflash.config import DFlashConfigError, load_dflash_config, parse_dflash_config
from deltaserve.spec.dflash.drafter import load_drafter


def test_keys_in_dflash_config():
    cfg = parse_dflash_config(drafter_config())
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (6, VOCAB - 1, (1, 4))
    assert cfg.num_target_layers == TARGET_LAYERS
    assert [cfg.layer_causal(i) for i in range(3)] == [False] * 3
    assert [cfg.layer_window(i) for i in range(3)] == [None] * 3


def test_keys_at_top_level_and_dflash_config_first():
    raw = drafter_config(block_size=8, mask_token_id=5, target_layer_ids=[0, 2, 3])
    del raw["dflash_config"]
    cfg = parse_dflash_config(raw)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (8, 5, (0, 2, 3))
    # dflash_config wins over the top level, key by key
    raw["dflash_config"] = {"mask_token_id": 7}
    cfg = parse_dflash_config(raw)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (8, 7, (0, 2, 3))


def test_layer_types_window_and_causality():
    raw = drafter_config(
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=5,
    )
    cfg = parse_dflash_config(raw)
    # z-lab: with is_causal unset, sliding layers are causal and full ones are not
    assert [cfg.layer_causal(i) for i in range(3)] == [True, False, True]
    assert [cfg.layer_window(i) for i in range(3)] == [5, None, 5]
    cfg = parse_dflash_config({**raw, "is_causal": False})
    assert [cfg.layer_causal(i) for i in range(3)] == [False] * 3
    assert [cfg.layer_window(i) for i in range(3)] == [5, None, 5]


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"architectures": ["DFlash2DraftModel"]}, "architectures"),
        ({"model_type": "llama"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": [1]}}, "block_size"),
        ({"dflash_config": {"block_size": 4, "target_layer_ids": [1]}}, "mask_token_id"),
        ({"dflash_config": {"block_size": 4, "mask_token_id": 3}}, "target_layer_ids"),
        (
            {"dflash_config": {"block_size": 4, "mask_token_id": 3, "target_layer_ids": []}},
            "target_layer_ids",
        ),
        (
            {"dflash_config": {"block_size": 1, "mask_token_id": 3, "target_layer_ids": [1]}},
            "block_size",
        ),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        (
            {"layer_types": ["full_attention", "linear_attention", "full_attention"]},
            "linear_attention",
        ),
        ({"layer_types": ["sliding_attention"] * 3, "sliding_window": None}, "sliding_window"),
        ({"num_key_value_heads": 4}, "num_key_value_heads"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"is_causal": "yes"}, "is_causal"),
    ],
)
def test_malformed_config_is_named(change, needle):
    with pytest.raises(DFlashConfigError, match=needle):
        parse_dflash_config(drafter_config(**change))


def test_load_matches_checkpoint_tensors(tmp_path):
    weights = write_drafter(tmp_path / "d", drafter_config(attention_bias=True))
    drafter = load_drafter(tmp_path / "d", StandInTarget(), torch.float32, "cpu")
    model = drafter.model
    attn = model.layers[1].self_attn
    q_rows = attn.q_size
    qkv = attn.qkv_proj.weight
    assert torch.equal(qkv[:q_rows], weights["layers.1.self_attn.q_proj.weight"])
    assert torch.equal(qkv[q_rows + attn.kv_size :], weights["layers.1.self_attn.v_proj.weight"])
    assert torch.equal(
        attn.qkv_proj.bias[q_rows : q_rows + attn.kv_size],
        weights["layers.1.self_attn.k_proj.bias"],
    )
    assert torch.equal(model.fc.weight, weights["fc.weight"])
    assert torch.equal(model.hidden_norm.weight, weights["hidden_norm.weight"])
    up = model.layers[2].mlp.gate_up_proj.weight[40:]
    assert torch.equal(up, weights["layers.2.mlp.up_proj.weight"])
    assert len(drafter.layer_specs()) == 3


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    raw = drafter_config()
    weights = write_drafter(tmp_path / "ok", raw)
    partial = dict(weights)
    del partial["layers.2.self_attn.k_norm.weight"]
    write_drafter(tmp_path / "missing", raw, partial)
    with pytest.raises(WeightLoadError, match=r"layers\.2\.self_attn\.k_norm\.weight"):
        load_drafter(tmp_path / "missing", StandInTarget(), torch.float32, "cpu")
    extra = {**weights, "embed_tokens.weight": torch.zeros(VOCAB, HIDDEN)}
    write_drafter(tmp_path / "extra", raw, extra)
    with pytest.raises(WeightLoadError, match="embed_tokens.weight"):
        load_drafter(tmp_path / "extra", StandInTarget(), torch.float32, "cpu")
    bad = {**weights, "fc.weight": torch.zeros(HIDDEN, 3 * HIDDEN)}
    write_drafter(tmp_path / "bad", raw, bad)
    with pytest.raises(WeightLoadError, match=r"fc\.weight has shape \[32, 96\]"):
        load_drafter(tmp_path / "bad", StandInTarget(), torch.float32, "cpu")


@pytest.mark.parametrize(
    "target, needle",
    [
        (StandInTarget(hidden=48), "hidden_size 32 != the target's 48"),
        (StandInTarget(vocab=80), "vocab_size 64 != the target's 80"),
        (StandInTarget(num_layers=8), "num_target_layers 6 != the target's 8"),
    ],
)
def test_drafter_that_does_not_fit_the_target(tmp_path, target, needle):
    write_drafter(tmp_path / "d", drafter_config())
    with pytest.raises(DFlashConfigError, match=needle):
        load_drafter(tmp_path / "d", target, torch.float32, "cpu")


def test_taps_and_mask_id_checked_against_the_target(tmp_path):
    raw = drafter_config(num_target_layers=None)
    raw["dflash_config"] = {"block_size": 4, "mask_token_id": 70, "target_layer_ids": [1, 6]}
    raw.pop("vocab_size")
    write_drafter(tmp_path / "d", raw)
    with pytest.raises(DFlashConfigError) as err:
        load_drafter(tmp_path / "d", StandInTarget(), torch.float32, "cpu")
    assert "mask_token_id 70 is outside" in str(err.value)
    assert "layer(s) [6] outside the target's 6 layers" in str(err.value)


def test_config_file_errors(tmp_path):
    with pytest.raises(DFlashConfigError, match="no config.json"):
        load_dflash_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(DFlashConfigError, match="DFlashDraftModel"):
        load_dflash_config(tmp_path)
