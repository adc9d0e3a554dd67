"""The cache planner with latent-attention layers (DeepSeek-V2-Lite's 27 MLA layers): one
paged pool of [block_size, 576] latents per layer, sized and described like attention's, and
about 9x the tokens a per-head K / V cache of the same model would hold in the same memory."""

from __future__ import annotations

import torch
from test_cache_planner import config, plan

from deltaserve.cache.planner import allocate_caches
from deltaserve.cache.spec import AttentionSpec, MLASpec

LITE = [MLASpec(16, 512, 64)] * 27
# the same model with a plain per-head cache: K [16, 192] and V [16, 128] padded to 192
LITE_PER_HEAD = [AttentionSpec(16, 16, 192)] * 27


def test_latent_pool_sizes_and_capacity(monkeypatch):
    p, text = plan(monkeypatch, LITE, "2", max_num_seqs=256)
    assert p.units == {"paged": p.num_blocks} and p.num_slots == 0
    assert p.block_bytes == 27 * 16 * 576 * 2  # bf16 latents of 16 tokens, every layer
    tokens = (p.num_blocks - 1) * 16
    assert text.startswith(f"{p.num_blocks - 1} KV blocks of 16 tokens (2.00 GiB) = {tokens}")
    assert tokens == (2 * 2**30 // p.block_bytes - 1) * 16
    q, _ = plan(monkeypatch, LITE_PER_HEAD, "2", max_num_seqs=256)
    ratio = (p.num_blocks - 1) / (q.num_blocks - 1)
    assert 10 < ratio < 11  # 2 * 16 * 192 / 576 = 10.7 (8.9 with V of 128 unpadded)


def test_latent_cache_tensors(monkeypatch):
    p, _ = plan(monkeypatch, LITE[:2], "0.01", max_num_seqs=2, max_model_len=64)
    caches = allocate_caches(LITE[:2], p, config(max_num_seqs=2, max_model_len=64))
    assert [sorted(c) for c in caches] == [["latent_cache"], ["latent_cache"]]
    assert caches[0]["latent_cache"].shape == (p.num_blocks, 16, 576)
    assert caches[0]["latent_cache"].dtype == torch.bfloat16
