"""Checkpoint-name mapping: prefix map, expert rules, packed modules, and their inverse (the
name a missing slot is reported by)."""

from __future__ import annotations

import pytest

from deltaserve.layers.weight_loading import WeightName
from deltaserve.models.qwen3_5 import Qwen3_5ForConditionalGeneration
from deltaserve.models.weight_names import WeightNameMap, WeightRule

PACKED = dict(Qwen3_5ForConditionalGeneration.packed_modules)
EXPERT_RULES = (
    WeightRule("experts.{e}.gate_proj.weight", "experts.w13", "gate_proj"),
    WeightRule("experts.{e}.up_proj.weight", "experts.w13", "up_proj"),
    WeightRule("experts.{e}.down_proj.weight", "experts.w2"),
    WeightRule("shared_expert_gate.weight", "shared_gate.weight"),
)


@pytest.fixture
def names() -> WeightNameMap:
    return WeightNameMap(
        skip_prefixes=("mtp.", "model.visual."),
        prefix_map=(("model.language_model.", "model."),),
        packed_modules=PACKED,
        rules=EXPERT_RULES,
    )


@pytest.mark.parametrize(
    "ckpt, target",
    [
        (
            "model.language_model.layers.3.mlp.experts.17.gate_proj.weight",
            WeightName("model.layers.3.mlp.experts.w13", "gate_proj", 17),
        ),
        (
            "model.language_model.layers.3.mlp.experts.0.up_proj.weight",
            WeightName("model.layers.3.mlp.experts.w13", "up_proj", 0),
        ),
        (
            "model.language_model.layers.3.mlp.experts.5.down_proj.weight",
            WeightName("model.layers.3.mlp.experts.w2", None, 5),
        ),
        (
            "model.language_model.layers.3.mlp.shared_expert_gate.weight",
            WeightName("model.layers.3.mlp.shared_gate.weight"),
        ),
        (
            "model.language_model.layers.3.mlp.shared_expert.gate_proj.weight",
            WeightName("model.layers.3.mlp.shared_expert.gate_up_proj.weight", "gate_proj"),
        ),
        (
            "model.language_model.layers.0.linear_attn.in_proj_b.weight",
            WeightName("model.layers.0.linear_attn.in_proj.weight", "in_proj_b"),
        ),
        ("model.language_model.norm.weight", WeightName("model.norm.weight")),
        ("lm_head.weight", WeightName("lm_head.weight")),
    ],
)
def test_map_and_inverse(names, ckpt, target):
    assert names.map(ckpt) == target
    assert names.checkpoint_name(target) == ckpt


def test_skipped_prefixes(names):
    assert names.map("mtp.fc.weight") is None
    assert names.skipped_prefix("model.visual.blocks.0.attn.qkv.weight") == "model.visual."
    assert names.skipped_prefix("model.language_model.norm.weight") is None


def test_rule_matches_whole_name_parts_only():
    rule = WeightRule("experts.{e}.down_proj.weight", "experts.w2")
    assert rule.map("mlp.experts.x.down_proj.weight") is None  # not an expert index
    assert rule.map("mlp.shared_experts.1.down_proj.weight") is None  # "shared_experts"
    assert rule.map("experts.2.down_proj.weight") == WeightName("experts.w2", None, 2)
    assert rule.unmap(WeightName("mlp.experts.w2")) is None  # an expert rule needs an expert
    assert rule.unmap(WeightName("mlp.experts.w2", "gate_proj", 1)) is None  # wrong shard
