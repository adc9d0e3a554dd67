"""Prefix caching: reuse the cached units of a prompt prefix another sequence already computed.

`PrefixCache` is the interface the scheduler and the pools use; `BlockPrefixCache` is today's
implementation over paged KV blocks: each full, computed block is named by a hash chained over
the whole prefix up to its end, so equal hashes mean equal prefixes. A freed block keeps its
hash in the block manager's LRU free queue and can be hit again until it is taken for new data.

NOTE: a hybrid model (recurrent layers) can resume from a KV prefix only with the recurrent
state at the prefix's end: a hit for it must also carry a state snapshot. `HybridPrefixCache`
(engine/hybrid_prefix_cache.py) wraps this one with the snapshot pool (cache/snapshots.py) and
hits only at boundaries that have a snapshot (`PrefixHit.state`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deltaserve.engine.sequence import Sequence

if TYPE_CHECKING:
    from deltaserve.cache.ops import CacheOp
    from deltaserve.engine.block_manager import BlockManager


@dataclass(frozen=True)
class PrefixHit:
    """The cached units covering a sequence's first `num_tokens` tokens."""

    num_tokens: int = 0
    blocks: tuple[int, ...] = field(default=())  # paged blocks, in prefix order
    state: int = 0  # the state-snapshot row to restore into the sequence's slot (0: none)

    def __bool__(self) -> bool:
        return self.num_tokens > 0


NO_HIT = PrefixHit()


@dataclass(frozen=True)
class StateCheckpoint:
    """A recurrent-state snapshot taken inside a step: after the first `num_tokens` new tokens
    of the row's chunk, its slot's state is copied to state row `row` (ops/gdn/checkpoints.py)."""

    num_tokens: int
    row: int


@dataclass
class PrefixCacheStats:
    """What the prefix cache did, counted when a sequence is admitted (so a sequence that
    waits and is matched again counts once per admission)."""

    queries: int = 0  # admissions that looked the prefix up
    hits: int = 0  # ... and found a cached prefix
    query_tokens: int = 0  # prompt tokens of those admissions
    hit_tokens: int = 0  # tokens served from the cache


class PrefixCache(ABC):
    """Index of cached prefixes over a pool's units."""

    num_hit_tokens: int = 0  # prompt tokens served from the cache so far (statistics)
    stats: PrefixCacheStats  # set by implementations

    def record_admission(self, seq: Sequence, hit: PrefixHit) -> None:
        """Count the admission of `seq` with `hit` (statistics)."""
        self.stats.queries += 1
        self.stats.query_tokens += seq.num_tokens
        if hit:
            self.stats.hits += 1
            self.stats.hit_tokens += hit.num_tokens

    def bind(self, emit: Callable[[CacheOp], None]) -> None:
        """Where the cache ops it decides go (the scheduler's queue for the next batch); a
        cache of KV blocks alone needs none."""
        return None

    def limit_chunk(self, seq: Sequence, start: int, num_new: int) -> int:
        """How many of the `num_new` tokens of `seq` from `start` on this step may compute:
        fewer when the cache wants the step to end at a boundary it will snapshot (the
        scheduler then computes the rest in later steps). By default all of them."""
        return num_new

    def checkpoint(self, seq: Sequence, start: int, num_new: int) -> StateCheckpoint | None:
        """A state snapshot to take inside the scheduled chunk [start, start + num_new) of
        `seq` (called once the row is in the batch), or None. By default none."""
        return None

    @abstractmethod
    def match(self, seq: Sequence) -> PrefixHit:
        """The cached units covering the longest cached prefix of `seq`.

        NOTE: a hit always leaves at least the last token to compute (the step that computes it
        must produce logits)."""

    @abstractmethod
    def insert(self, seq: Sequence) -> None:
        """Register `seq`'s full blocks whose tokens are all computed."""

    @abstractmethod
    def evict(self, unit: int) -> None:
        """`unit` (a free one) is being taken for new data: forget what it cached."""

    @abstractmethod
    def lock(self, hit: PrefixHit) -> None:
        """Reference the hit's units so they are not evicted while in use."""

    @abstractmethod
    def unlock(self, hit: PrefixHit) -> None:
        """Drop a reference taken by `lock`."""

    def forget(self, seq: Sequence, num_tokens: int = 0) -> None:
        """Drop what is memoised about `seq` past its first `num_tokens` tokens (its tokens
        there changed, or it let go of its units)."""
        return None


class BlockPrefixCache(PrefixCache):
    """Hash-chain prefix cache over the blocks of one `BlockManager`.

    The block manager owns reference counts and the LRU free queue; this class owns the hashes:
    block -> hash, hash -> block, and per sequence the memoised hashes of its full blocks.
    """

    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.block_hash: list[int | None] = [None] * blocks.num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.seq_hashes: dict[int, list[int]] = {}  # seq_id -> hashes of its full blocks
        self.num_hit_tokens = 0
        self.stats = PrefixCacheStats()

    def block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """The chained hashes of `seq`'s first `num_full_blocks` blocks (memoised)."""
        return self._hashes(seq, num_full_blocks)

    def _hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        hashes = self.seq_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            # NOTE: image placeholders are the same ids for every image: blocks that hold some
            # also hash the images' content, so different images never share a block
            images = seq.mm.hash_key(i * bs, (i + 1) * bs) if seq.mm is not None else ()
            hashes.append(hash((parent, tokens, images) if images else (parent, tokens)))
        return hashes[:num_full_blocks]

    def match(self, seq: Sequence) -> PrefixHit:
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self._hashes(seq, max_blocks):
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        self.num_hit_tokens += len(hits) * self.block_size
        return PrefixHit(len(hits) * self.block_size, tuple(hits))

    def insert(self, seq: Sequence) -> None:
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        for i, h in enumerate(self._hashes(seq, num_full)):
            block = seq.block_ids[i]
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block] = h
                self.hash_to_block[h] = block

    def evict(self, unit: int) -> None:
        h = self.block_hash[unit]
        if h is None:
            return
        if self.hash_to_block.get(h) == unit:
            del self.hash_to_block[h]
        self.block_hash[unit] = None

    def lock(self, hit: PrefixHit) -> None:
        self.blocks.ref(hit.blocks)

    def unlock(self, hit: PrefixHit) -> None:
        self.blocks.unref(hit.blocks)

    def forget(self, seq: Sequence, num_tokens: int = 0) -> None:
        if num_tokens <= 0:
            self.seq_hashes.pop(seq.seq_id, None)
            return
        hashes = self.seq_hashes.get(seq.seq_id)
        if hashes is not None:
            del hashes[num_tokens // self.block_size :]
