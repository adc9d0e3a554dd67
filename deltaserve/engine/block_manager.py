"""Paged KV blocks: free list and reference counts (bookkeeping, no tensors).

Block 0 is a null block that no sequence owns (padded batch rows point at it). Blocks whose
reference count drops to zero go to the back of an LRU free queue; with prefix caching
(engine/prefix_cache.py) they keep their hash there and can be hit again until they are taken
for new data (evicted), least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from deltaserve.cache.manager import PoolManager
from deltaserve.engine.prefix_cache import BlockPrefixCache, PrefixHit
from deltaserve.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager(PoolManager):
    """The "paged" pool: a sequence holds `seq.block_ids`, one block per `block_size` tokens."""

    kind = "paged"
    supports_prefix_caching = True

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (1 null + 1), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(1, num_blocks)
        )
        self.prefix_cache: BlockPrefixCache | None = (
            BlockPrefixCache(self) if enable_prefix_caching else None
        )

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by a sequence (cached blocks nobody uses count as free)."""
        return self.num_blocks - 1 - len(self.free_queue)

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_hit_tokens(self) -> int:
        """Prompt tokens served by the prefix cache so far (0 without prefix caching)."""
        return self.prefix_cache.num_hit_tokens if self.prefix_cache is not None else 0

    # ---- prefix cache (kept for callers of the block-level API) -------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of `seq`, leaving at least its last token to
        compute (the step must produce logits)."""
        if self.prefix_cache is None:
            return []
        return list(self.prefix_cache.match(seq).blocks)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of `seq`'s blocks that are full and computed."""
        if self.prefix_cache is not None:
            self.prefix_cache.insert(seq)

    # ---- reference counts --------------------------------------------------------------
    def ref(self, blocks: Iterable[int]) -> None:
        """One more reference to each block (a free, cached one leaves the free queue)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1

    def unref(self, blocks: Iterable[int]) -> None:
        """One reference less to each block, in the given order: blocks nobody holds go to the
        back of the free queue (evicted last)."""
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise ValueError(f"KV block {block} is not referenced")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None

    def _take_free(self) -> int:
        block, _ = self.free_queue.popitem(last=False)  # least recently freed first
        if self.prefix_cache is not None:
            self.prefix_cache.evict(block)
        return block

    # ---- allocation --------------------------------------------------------------------
    def _needed(self, seq: Sequence, num_new_tokens: int, cached: list[int] | tuple[int, ...]):
        """(new blocks to take, cached blocks to revive from the free queue)."""
        total = seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        needed = cdiv(total, self.block_size) - len(seq.block_ids) - len(cached)
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)  # cached but in the free queue
        return max(needed, 0), revived

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens (after any `cached` prefix blocks,
        which it then shares). False, with nothing changed, when there are too few free blocks."""
        cached = cached or []
        needed, revived = self._needed(seq, num_new_tokens, cached)
        if needed + revived > len(self.free_queue):
            return False
        self.ref(cached)
        seq.block_ids.extend(cached)
        for _ in range(needed):
            block = self._take_free()
            self.ref_counts[block] = 1
            seq.block_ids.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks nobody holds go to the free queue (tail blocks first,
        so a prefix outlives its continuation in the cache)."""
        self.unref(reversed(seq.block_ids))
        seq.block_ids = []
        if self.prefix_cache is not None:
            self.prefix_cache.forget(seq)

    # ---- PoolManager -------------------------------------------------------------------
    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> bool:
        needed, revived = self._needed(seq, num_new_tokens, hit.blocks if hit else ())
        return needed + revived <= len(self.free_queue)

    def allocate_for(
        self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> None:
        if not self.allocate(seq, num_new_tokens, list(hit.blocks) if hit else None):
            raise RuntimeError(self.shortage(seq, num_new_tokens))

    def release(self, seq: Sequence) -> None:
        self.free(seq)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the blocks covering the first `num_tokens` tokens; the rest are released (tail
        first, as in `free`)."""
        if self.prefix_cache is not None:  # hashes memoised over the dropped tokens
            self.prefix_cache.forget(seq, num_tokens)
        keep = cdiv(num_tokens, self.block_size)
        if keep >= len(seq.block_ids):
            return
        dropped = seq.block_ids[keep:]
        # NOTE: a new list, not an in-place cut: host block tables (engine/host_tables.py)
        # mirror a block list by identity and assume it only grows
        seq.block_ids = seq.block_ids[:keep]
        self.unref(reversed(dropped))

    def shortage(self, seq: Sequence, num_new_tokens: int) -> str:
        return (
            f"the KV cache has {self.num_free_blocks} free blocks, too few for {num_new_tokens} "
            "more tokens"
        )
