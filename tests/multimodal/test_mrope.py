"""M-RoPE: the rotary table for [3, T] positions (layers/rotary.py) against HF's
Qwen3_5TextRotaryEmbedding, the claim that equal axes give the 1-D rotary, and the prompt
positions (multimodal/processor.py) against HF's Qwen3_5Model.get_rope_index."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5Config, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model, Qwen3_5TextRotaryEmbedding

from deltaserve.layers.rotary import RotaryEmbedding, rope_from_config
from deltaserve.multimodal.inputs import ImageItem, MultiModalRecord
from deltaserve.multimodal.processor import mrope_positions


def _text_config(head_dim: int, section: list[int]) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=head_dim,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": section,
            "mrope_interleaved": True,
        },
    )


@pytest.mark.parametrize("head_dim, section", [(32, [2, 1, 1]), (256, [11, 11, 10])])
def test_mrope_table_matches_hf(head_dim, section):
    cfg = _text_config(head_dim, section)
    ours = rope_from_config(cfg, head_dim)
    hf = Qwen3_5TextRotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 500, (3, 37), generator=gen)
    cos, sin = ours.cos_sin(pos)  # [T, rotary_dim / 2]
    hf_cos, hf_sin = hf(torch.zeros(1, dtype=torch.float32), pos[:, None, :])  # [1, T, rd]
    half = cos.shape[1]
    assert torch.allclose(cos, hf_cos[0, :, :half], atol=1e-6)
    assert torch.allclose(sin, hf_sin[0, :, :half], atol=1e-6)
    assert torch.equal(hf_cos[0, :, :half], hf_cos[0, :, half:])  # NeoX halves


@pytest.mark.parametrize("section", [(2, 1, 1), (1, 2, 1), (11, 11, 10)])
def test_equal_axes_are_the_1d_rotary(section):
    """Text rows of a mixed batch get their 1-D position on all three axes: the same table."""
    rd = 2 * sum(section)
    rope = RotaryEmbedding(rd, rd, 10000.0, section)
    pos = torch.arange(3, 300, 7)
    c1, s1 = rope.cos_sin(pos)
    c3, s3 = rope.cos_sin(pos.expand(3, -1))
    assert torch.equal(c1, c3) and torch.equal(s1, s3)
    # ... while distinct axes do change it (the sections are used)
    moved = pos.expand(3, -1).clone()
    moved[1] += 5
    assert not torch.equal(rope.cos_sin(moved)[0], c1)


def test_bad_section_rejected():
    with pytest.raises(ValueError, match="mrope_section"):
        RotaryEmbedding(32, 8, 10000.0, (2, 2))
    with pytest.raises(ValueError, match="mrope_section"):
        RotaryEmbedding(32, 8, 10000.0).cos_sin(torch.zeros(3, 4, dtype=torch.long))


def _item(offset: int, grid: tuple[int, int, int], merge: int = 2) -> ImageItem:
    n = grid[0] * grid[1] * grid[2] // merge**2
    return ImageItem(torch.zeros(0), grid, f"h{offset}", offset, n)


def test_prompt_positions_match_hf_get_rope_index():
    cfg = Qwen3_5Config(
        text_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, out_hidden_size=32),
        image_token_id=60,
    )
    # text(3) image grid 1 x 6 x 10 (15 tokens) text(4) image 1 x 4 x 14 (14 tokens) text(2)
    items = [_item(3, (1, 6, 10)), _item(22, (1, 4, 14))]
    ids = [1, 2, 3] + [60] * 15 + [4, 5, 6, 7] + [60] * 14 + [8, 9]
    pos, delta = mrope_positions(ids, items, 2)
    model = Qwen3_5Model.__new__(Qwen3_5Model)  # get_rope_index reads only the config
    torch.nn.Module.__init__(model)
    model.config = cfg
    x = torch.tensor([ids])
    ref, ref_delta = model.get_rope_index(
        x, (x == 60).int(), image_grid_thw=torch.tensor([[1, 6, 10], [1, 4, 14]])
    )
    assert torch.equal(pos, ref[:, 0])
    assert delta == int(ref_delta)
    record = MultiModalRecord(items, pos, delta)
    # chunks: text before the images is 1-D, chunks touching images are [3][n], after: 1-D + delta
    assert record.rope_positions(0, 3) == [0, 1, 2]
    assert record.rope_positions(2, 5) == [row[2:7] for row in pos.tolist()]
    n = len(ids)
    assert record.rope_positions(n - 1, 3) == [n - 1 + delta + i for i in range(3)]
    assert record.hash_key(0, 3) == () and record.hash_key(16, 23) == ("h3", "h22")
