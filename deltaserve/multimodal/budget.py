"""The vision encoder's share of a step and of memory.

Per step the scheduler admits images up to `encoder_budget_tokens` merged tokens (an image
larger than that runs alone); the encoder cache holds twice that many embedding rows. The
memory reserve (subtracted from the cache budget beside the text activations) covers that
cache plus the tower's widest per-patch activations for one step's budget.
"""

from __future__ import annotations

from deltaserve.cache.spec import dtype_bytes

MIN_ENCODER_BUDGET = 4096  # merged tokens: four 1024 x 1024 images


def encoder_budget_tokens(config) -> int:
    """Merged image tokens the encoder may run per step: the step's token budget, at least
    MIN_ENCODER_BUDGET (images are encoded whole even when chunked prefill splits them)."""
    return max(config.scheduler.max_num_batched_tokens, MIN_ENCODER_BUDGET)


def encoder_cache_tokens(config) -> int:
    """Embedding rows the encoder cache holds before evicting unpinned entries."""
    return 2 * encoder_budget_tokens(config)


def encoder_reserve_bytes(config) -> int:
    """Memory for the encoder cache and one step's encoder activations (0 without images)."""
    from deltaserve.multimodal.limits import no_image_reason

    if no_image_reason(config) is not None:
        return 0
    vc = config.model.hf_config.vision_config
    nbytes = dtype_bytes(config.model.dtype)
    budget = encoder_budget_tokens(config)
    patches = budget * vc.spatial_merge_size**2
    # residual, normed input, qkv, attention output, MLP hidden (x2: allocator fragmentation)
    per_patch = (6 * vc.hidden_size + vc.intermediate_size) * nbytes * 2
    cache = encoder_cache_tokens(config) * vc.out_hidden_size * nbytes
    return patches * per_patch + cache
