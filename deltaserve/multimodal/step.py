"""The runner's side of images in one step: which placeholder rows the step computes, the
encoder run for images not in the encoder cache (once per image, batched), and the embedding
rows that replace those placeholders' input embeddings (a chunk may hold part of an image)."""

from __future__ import annotations

import torch

from deltaserve.logger import get_logger
from deltaserve.multimodal.budget import (
    encoder_budget_tokens,
    encoder_cache_tokens,
    encoder_reserve_bytes,
)
from deltaserve.multimodal.encoder_cache import EncoderCache

logger = get_logger(__name__)


def build_encoder_cache(config, model) -> EncoderCache:
    """The encoder cache of an image model, with the start-up line on the encoder's memory."""
    cache = EncoderCache(encoder_cache_tokens(config))
    params = sum(p.numel() for p in model.visual.parameters())
    logger.info(
        "image input: vision tower %.0fM parameters, encoder budget %d image tokens per step, "
        "encoder cache %d tokens, encoder memory reserve %.2f GiB",
        params / 1e6,
        encoder_budget_tokens(config),
        cache.capacity_tokens,
        encoder_reserve_bytes(config) / 2**30,
    )
    return cache


def step_image_embeds(
    items: list, step, instance, cache: EncoderCache
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(token rows [N], embeddings [N, hidden]) for the image placeholder tokens this step
    computes, or None when it computes none. `items` are the rows in kernel order (the order
    of `step.query_start_loc`)."""
    wanted = []  # (token row of the first overlapping placeholder, item, lo, hi)
    for b, (seq, n) in enumerate(items):
        mm = seq.mm
        if mm is None:
            continue
        c = seq.num_computed_tokens
        for item in mm.overlapping(c, c + n):
            lo, hi = max(c, item.offset), min(c + n, item.end)
            wanted.append((step.query_start_loc[b] + lo - c, item, lo, hi))
    if not wanted:
        return None
    missing = {}
    for _, item, _, _ in wanted:
        if item.content_hash not in cache and item.content_hash not in missing:
            missing[item.content_hash] = item
    if missing:
        todo = list(missing.values())
        pixels = torch.cat([it.pixel_values for it in todo])  # [sum patches, C*Tp*P*P]
        outs = instance.encode_images(pixels, [it.grid_thw for it in todo])
        for it, emb in zip(todo, outs, strict=True):
            cache.put(it.content_hash, emb)
    rows, embeds = [], []
    for row, item, lo, hi in wanted:
        emb = cache.get(item.content_hash)
        if emb is None:  # NOTE: evicted by this very step's inserts (tiny cache): encode again
            (emb,) = instance.encode_images(item.pixel_values, [item.grid_thw])
        rows.append(torch.arange(row, row + hi - lo))
        embeds.append(emb[lo - item.offset : hi - item.offset])
    device = embeds[0].device
    return torch.cat(rows).to(device), torch.cat(embeds)
