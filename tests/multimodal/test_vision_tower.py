"""The vision tower (deltaserve/models/qwen3_5_vision.py) against HF's Qwen3_5VisionModel and
Qwen3_5MoeVisionModel, float32, every weight random, several images of odd grids at once."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5MoeVisionConfig, Qwen3_5VisionConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

from deltaserve.models.qwen3_5_vision import Qwen3_5VisionTower

_VISION = dict(
    depth=2,
    hidden_size=48,
    intermediate_size=80,
    num_heads=3,  # head_dim 16
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=40,
    num_position_embeddings=25,  # a 5 x 5 learned grid, resampled to each image's grid
)


@pytest.mark.parametrize(
    "config_cls, model_cls",
    [(Qwen3_5VisionConfig, Qwen3_5VisionModel), (Qwen3_5MoeVisionConfig, Qwen3_5MoeVisionModel)],
    ids=["dense", "moe"],
)
@torch.no_grad()
def test_tower_matches_hf(config_cls, model_cls):
    vc = config_cls(**_VISION)
    torch.manual_seed(0)
    hf = model_cls._from_config(vc).eval()
    for name, p in hf.named_parameters():  # LayerNorm weights around 1, everything random
        mean = 1.0 if "norm" in name and name.endswith("weight") else 0.0
        p.copy_(torch.randn(p.shape) * 0.3 + mean)
    ours = Qwen3_5VisionTower(vc)
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=True)
    assert not missing and not unexpected
    grids = [[1, 6, 10], [1, 4, 4], [1, 14, 2]]
    n = sum(t * h * w for t, h, w in grids)
    patches = torch.randn(n, 3 * 2 * 4 * 4)
    ref = hf(patches, torch.tensor(grids)).pooler_output
    out = ours(patches, grids)
    assert out.shape == (n // 4, 40) == ref.shape
    assert (out - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    # images do not attend to each other: one image alone gives its rows of the batch
    alone = ours(patches[60:76], [grids[1]])
    assert torch.allclose(alone, out[15:19], atol=1e-5)


def test_tower_rejects_wrong_patch_count():
    ours = Qwen3_5VisionTower(Qwen3_5VisionConfig(**_VISION))
    with pytest.raises(ValueError, match="patches"):
        ours(torch.zeros(10, 96), [[1, 4, 4]])
