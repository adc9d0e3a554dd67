"""Checkpoint loading details not covered by the parity suite."""

import json
import logging

import pytest
import torch
from hf_models import add_tensor, build_model

from deltaserve import LLM
from deltaserve.loader.weights import WeightLoadError, checkpoint_files


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    path, _ = build_model("qwen3_5_vl", tmp_path_factory.mktemp("vl"), load_oracle=False)
    return path


@pytest.mark.parametrize("images", [True, False], ids=["vision_tower", "image0"])
def test_visual_and_mtp_skipped_with_one_log_line(vl_dir, caplog, images):
    """mtp.* is always skipped; model.visual.* loads into the vision tower unless images are
    off (limit_mm_per_prompt image=0, or no preprocessor_config.json), when it is skipped too:
    one log line either way."""
    if images:
        from transformers import Qwen2VLImageProcessor

        Qwen2VLImageProcessor(patch_size=4, merge_size=2).save_pretrained(vl_dir)
    logger = logging.getLogger("deltaserve")
    logger.addHandler(caplog.handler)
    limit = None if images else "image=0"
    try:
        llm = LLM(
            str(vl_dir),
            device="cpu",
            max_model_len=64,
            skip_tokenizer_init=True,
            limit_mm_per_prompt=limit,
        )
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1
    assert "mtp.*" in lines[0]
    assert ("model.visual.*" in lines[0]) is not images
    assert (getattr(llm.llm_engine.runner.model, "visual", None) is not None) is images


def test_index_naming_a_missing_shard(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(WeightLoadError, match="model-00001-of-00002.safetensors"):
        checkpoint_files(tmp_path)


def test_no_weights_at_all(tmp_path):
    with pytest.raises(WeightLoadError, match="no \\*.safetensors"):
        checkpoint_files(tmp_path)


def test_duplicate_tensor_across_shards(tmp_path):
    path, _ = build_model("qwen3_g1", tmp_path / "m", load_oracle=False)
    from safetensors.torch import load_file, save_file

    name = "model.norm.weight"
    save_file(
        {name: load_file(str(path / "model.safetensors"))[name].clone()},
        str(path / "extra.safetensors"),
    )
    with pytest.raises(ValueError, match="model.norm.weight appears twice"):
        LLM(str(path), device="cpu", max_model_len=64, skip_tokenizer_init=True)


def test_unexpected_tensor_under_known_prefix_is_named(tmp_path):
    path, _ = build_model("qwen3_g1", tmp_path / "m", load_oracle=False)
    add_tensor(path, "model.layers.0.self_attn.bogus.weight", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.bogus.weight"):
        LLM(str(path), device="cpu", max_model_len=64, skip_tokenizer_init=True)
