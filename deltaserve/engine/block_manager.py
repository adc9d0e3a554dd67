"""Paged KV blocks: free list, reference counts, prefix-cache hashes (bookkeeping, no tensors).

Block 0 is a null block that no sequence owns (padded batch rows point at it). Blocks whose
reference count drops to zero go to the back of an LRU free queue; with prefix caching they keep
their hash there and can be hit again until they are taken for new data (evicted).
"""

from __future__ import annotations

from collections import OrderedDict

from deltaserve.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (1 null + 1), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(1, num_blocks)
        )
        self.hash_to_block: dict[int, int] = {}
        self.seq_hashes: dict[int, list[int]] = {}  # seq_id -> hashes of its full blocks
        self.num_hit_tokens = 0

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

    # ---- prefix cache ------------------------------------------------------------------
    def _hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        hashes = self.seq_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))))
        return hashes[:num_full_blocks]

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of `seq`, leaving at least its last token to
        compute (the step must produce logits)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self._hashes(seq, max_blocks):
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        self.num_hit_tokens += len(hits) * self.block_size
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of `seq`'s blocks that are full and computed."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        for i, h in enumerate(self._hashes(seq, num_full)):
            block = seq.block_ids[i]
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block] = h
                self.hash_to_block[h] = block

    # ---- allocation --------------------------------------------------------------------
    def _take_free(self) -> int:
        block, _ = self.free_queue.popitem(last=False)  # least recently freed first
        h = self.block_hash[block]
        if h is not None:  # evict it from the prefix cache
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
            self.block_hash[block] = None
        return block

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens (after any `cached` prefix blocks,
        which it then shares). False, with nothing changed, when there are too few free blocks."""
        cached = cached or []
        total = seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        needed = cdiv(total, self.block_size) - len(seq.block_ids) - len(cached)
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)  # cached but in the free queue
        if max(needed, 0) + revived > len(self.free_queue):
            return False
        for block in cached:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1
            seq.block_ids.append(block)
        for _ in range(needed):
            block = self._take_free()
            self.ref_counts[block] = 1
            seq.block_ids.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks nobody holds go to the free queue (tail blocks first,
        so a prefix outlives its continuation in the cache)."""
        for block in reversed(seq.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
        seq.block_ids = []
        self.seq_hashes.pop(seq.seq_id, None)
