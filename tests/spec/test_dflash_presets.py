"""Random drafters in released shapes (deltaserve/spec/dflash/presets.py)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.models.dflash import DFlashDraftModel
from deltaserve.spec.dflash.config import parse_dflash_config
from deltaserve.spec.dflash.presets import drafter_preset_config, random_preset_name


def test_qwen35_9b_drafter_shape():
    cfg = parse_dflash_config(drafter_preset_config("qwen3.5-9b-dflash"), "preset")
    # the Qwen3.5-9B target: hidden 4096, vocab 248320, 32 layers
    cfg.check_target(4096, 248320, 32)
    assert cfg.target_layer_ids == (1, 8, 15, 22, 29) and cfg.block_size == 16
    with torch.device("meta"):
        model = DFlashDraftModel(cfg)
    specs = model.layer_specs()
    assert len(specs) == 5
    assert {(s.num_heads, s.num_kv_heads, s.head_dim) for s in specs} == {(32, 8, 128)}
    assert tuple(model.fc.weight.shape) == (4096, 5 * 4096)
    # about 1.05 B parameters: fc 84 M + 5 layers of (attention 42 M + MLP 151 M)
    n = sum(p.numel() for p in model.parameters())
    assert 1.0e9 < n < 1.1e9


def test_preset_names():
    assert random_preset_name("/some/dir") is None
    assert random_preset_name("random:qwen3.5-9b-dflash") == "qwen3.5-9b-dflash"
    with pytest.raises(ValueError, match="unknown random drafter 'nope'"):
        random_preset_name("random:nope")
