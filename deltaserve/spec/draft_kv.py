"""A drafter's own paged K / V, shared by the drafting methods with layers (DFlash, MTP).

A drafter's layers declare `AttentionSpec`s (pool "paged") that the runner plans with the
target's, so the drafter's cache tensors have as many blocks as the target's paged pool and the
drafter's K / V of position p of a sequence live in the target's block for p
(`seq.block_ids`): no allocator of its own, and blocks freed by the target (rejected drafts,
rollbacks, preemption, finished sequences) free the drafter's too.
"""

from __future__ import annotations

import torch

from deltaserve.cache.planner import CachePlan
from deltaserve.logger import get_logger

logger = get_logger(__name__)


def paged_blocks(caches: list | None) -> int:
    """Blocks of the target's paged pool, read from its allocated K caches (0: none yet)."""
    for cache in caches or []:
        if "k_cache" in cache:
            return int(cache["k_cache"].shape[0])
    return 0


def allocate_beside_target(proposer, target, config, what: str) -> None:
    """When `target`'s caches are already allocated from a plan without the drafter's specs
    (tests, tools), give `proposer` as many blocks as the target's paged pool, outside the
    cache budget, and log it (`allocate` with a joint plan replaces them)."""
    blocks = paged_blocks(getattr(target, "caches", None))
    if not blocks:
        return
    proposer.allocate(CachePlan({"paged": blocks}), config)
    mc, cc = config.model, config.cache
    per_block = sum(
        s.unit_bytes(cc.block_size, mc.dtype, cc.state_dtype) for s in proposer.layer_specs()
    )
    logger.info(
        "%s KV: %d blocks, %.2f GiB beside the planned caches (plan the drafter's "
        "layer_specs() with the target's to budget them)",
        what,
        blocks,
        blocks * per_block / 2**30,
    )


def slot_ids(block_ids: list[int], positions: range | list[int], block_size: int) -> list[int]:
    """Cache slots (block * block_size + offset) of `positions` of a sequence whose blocks are
    `block_ids`. Raises RuntimeError when a position has no block."""
    positions = list(positions)
    if positions and positions[-1] // block_size >= len(block_ids):
        raise RuntimeError(
            f"position {positions[-1]} has no KV block ({len(block_ids)} blocks of {block_size})"
        )
    return [block_ids[p // block_size] * block_size + p % block_size for p in positions]


def block_table(tables: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """[R, max width] int32 block tables (rows padded with the null block 0)."""
    width = max(1, max((len(t) for t in tables), default=1))
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for r, t in enumerate(tables):
        table[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return table.to(device)


def gather_context(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached context K / V of R rows, zero past each row's `ctx_lens`.

    Args:
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] a layer's paged K / V.
        block_tables: [R, nb] int block ids (nb * block_size covers every ctx_len).
        ctx_lens: [R] int cached positions per row.

    Returns:
        (keys, values) [R, S = nb * block_size, Hkv, D]. Device tensors only, fixed shapes: no
        host sync (CUDA-graph safe).
    """
    R, nb = block_tables.shape
    S = nb * k_cache.shape[1]
    ids = block_tables.long()
    ck = k_cache[ids].reshape(R, S, *k_cache.shape[2:])  # [R, nb, bs, Hkv, D] -> [R, S, Hkv, D]
    cv = v_cache[ids].reshape(R, S, *v_cache.shape[2:])
    # NOTE: slots past a row's context may hold stale values (a freed block's; NaN in the
    # tests); a masked score still multiplies its value by 0, so those values are zeroed
    ok = (torch.arange(S, device=ctx_lens.device)[None, :] < ctx_lens.long()[:, None])[
        ..., None, None
    ]
    return torch.where(ok, ck, 0), torch.where(ok, cv, 0)
