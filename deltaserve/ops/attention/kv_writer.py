"""The one writer of new keys / values into the paged KV cache, for every attention backend.

`write_kv` is the entry point: a Triton kernel on CUDA (one launch for K and V, no host sync),
the torch reference elsewhere. Both give the same bits.

NOTE (slot -1): `slot_mapping[t] == -1` always means "skip token t": nothing of the cache
changes for it, on every path. Padded rows of a CUDA graph and tokens whose K/V must not land
(e.g. rows with nowhere to go) use -1. No path redirects a skipped token into the null block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

WRITERS = ("auto", "torch", "triton")


def write_rows(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter `new` [T, H, D] into `cache` [num_blocks, block_size, H, D] at `slot_mapping`
    (-1 skips a token; no host sync). Also the MLA reference's latent writer
    (deltaserve.ops.mla.reference.write_latent)."""
    flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, H, D] (a view, not a copy)
    new = new.to(cache.dtype)
    valid = slot_mapping >= 0  # [T]
    # NOTE: to skip a -1 token without a host sync (no boolean indexing), it is redirected to the
    # first valid token's slot with that token's value, so every duplicate write carries
    # identical bits. With no valid token at all, it rewrites slot 0 with slot 0's own current
    # contents (a no-op).
    first = torch.argmax(valid.to(torch.int32))  # index of the first valid token (0 if none)
    any_valid = valid[first]
    fallback_slot = torch.where(any_valid, slot_mapping[first], torch.zeros_like(slot_mapping[0]))
    fallback_val = torch.where(any_valid, new[first], flat[0])  # [H, D]
    slots = torch.where(valid, slot_mapping, fallback_slot)  # [T]
    vals = torch.where(valid[:, None, None], new, fallback_val[None])  # [T, H, D]
    flat.index_copy_(0, slots, vals)


def write_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The torch reference of `write_kv` (any device, no host sync); same contract."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    assert k.shape[0] >= num_tokens and v.shape[0] >= num_tokens
    write_rows(k_cache, k[:num_tokens], slot_mapping)
    write_rows(v_cache, v[:num_tokens], slot_mapping)


@functools.cache
def _triton_writer() -> Callable[..., None] | None:
    """The Triton kernel's launcher, imported on first use; None when Triton is not installed."""
    try:
        from deltaserve.ops.attention.triton_kv_writer import store_kv
    except ImportError:
        return None
    return store_kv


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    impl: str = "auto",
) -> None:
    """Write a step's new keys / values into the paged cache, in place, without a host sync.

    Args:
        k, v: [T, Hkv, D] the step's new keys and values (cast to the cache dtype); rows past
            `slot_mapping`'s length are ignored.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D].
        slot_mapping: [T'] int64 (T' <= T), `block * block_size + offset` per token.
            **-1 means "skip this token": the caches are left untouched for it.**
        impl: "auto" (Triton when the cache is on CUDA and Triton is installed, else torch),
            "torch" or "triton" (which also runs in Triton's CPU interpreter, for tests).
    """
    if impl not in WRITERS:
        raise ValueError(f"unknown KV writer {impl!r}; expected one of {WRITERS}")
    fast = _triton_writer() if impl != "torch" else None
    if impl == "triton" and fast is None:
        raise RuntimeError("KV writer 'triton' asked for, but triton is not installed")
    if fast is not None and (impl == "triton" or k_cache.is_cuda):
        fast(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_torch(k, v, k_cache, v_cache, slot_mapping)
