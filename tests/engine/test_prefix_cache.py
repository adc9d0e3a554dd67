"""The prefix-cache interface over paged blocks: match, insert, evict, lock / unlock, forget."""

from __future__ import annotations

from deltaserve.engine.block_manager import BlockManager
from deltaserve.engine.prefix_cache import BlockPrefixCache, PrefixCache, PrefixHit
from deltaserve.engine.sequence import Sequence
from deltaserve.sampling_params import SamplingParams


def seq(tokens) -> Sequence:
    return Sequence("r", 0, list(tokens), SamplingParams(max_tokens=4))


def computed(bm: BlockManager, tokens) -> Sequence:
    """A sequence whose tokens are all computed and registered in the prefix cache."""
    s = seq(tokens)
    assert bm.allocate(s, len(s.token_ids))
    s.num_computed_tokens = s.num_tokens
    bm.prefix_cache.insert(s)
    return s


def test_match_returns_a_hit_and_leaves_the_last_token():
    bm = BlockManager(9, 2, enable_prefix_caching=True)
    cache = bm.prefix_cache
    assert isinstance(cache, BlockPrefixCache) and isinstance(cache, PrefixCache)
    a = computed(bm, [1, 2, 3, 4, 5, 6])
    hit = cache.match(seq([1, 2, 3, 4, 5, 6]))  # 3 full blocks cached, only 2 may hit
    assert hit == PrefixHit(4, tuple(a.block_ids[:2])) and hit
    assert cache.num_hit_tokens == bm.num_hit_tokens == 4
    miss = cache.match(seq([9, 2, 3, 4, 5]))
    assert not miss and miss.blocks == ()
    # a partial block is never registered
    b = computed(bm, [7, 7, 7])
    assert cache.match(seq([7, 7, 7, 7, 1])).blocks == tuple(b.block_ids[:1])


def test_lock_keeps_a_hit_from_eviction_until_unlocked():
    bm = BlockManager(4, 2, enable_prefix_caching=True)  # 3 usable blocks
    cache = bm.prefix_cache
    a = computed(bm, [1, 2, 3, 4])
    bm.free(a)
    hit = cache.match(seq([1, 2, 3, 4, 5]))
    assert len(hit.blocks) == 2 and bm.num_free_blocks == 3
    cache.lock(hit)
    assert bm.num_free_blocks == 1 and all(bm.ref_counts[b] == 1 for b in hit.blocks)
    other = seq([8, 8, 8, 8])
    assert not bm.allocate(other, 4)  # only the unlocked block is free
    assert bm.allocate(other, 2)
    assert cache.match(seq([1, 2, 3, 4, 5])) == hit  # the locked blocks kept their hashes
    cache.unlock(hit)
    assert bm.num_free_blocks == 2
    bm.free(other)
    big = seq([6] * 6)
    assert bm.allocate(big, 6)  # now everything is taken for new data: the hit is evicted
    assert not cache.match(seq([1, 2, 3, 4, 5]))


def test_evict_forgets_a_block():
    bm = BlockManager(5, 2, enable_prefix_caching=True)
    cache = bm.prefix_cache
    a = computed(bm, [1, 2, 3, 4])
    cache.evict(a.block_ids[1])
    assert cache.match(seq([1, 2, 3, 4, 5])).blocks == (a.block_ids[0],)
    cache.evict(a.block_ids[1])  # evicting an unhashed block is a no-op
    assert cache.block_hash[a.block_ids[1]] is None


def test_forget_drops_memoised_hashes_past_a_length():
    bm = BlockManager(9, 2, enable_prefix_caching=True)
    cache = bm.prefix_cache
    computed(bm, [1, 2, 3, 4])
    s = seq([1, 2, 3, 9, 5])
    assert len(cache.match(s).blocks) == 1  # memoises the hashes of [1, 2] and [3, 9]
    s.token_ids[3] = 4  # e.g. a rolled-back draft replaced by the right token
    cache.forget(s, 3)
    assert len(cache.match(s).blocks) == 2
    cache.forget(s)
    assert s.seq_id not in cache.seq_hashes


def test_eviction_takes_the_least_recently_freed_block_first():
    bm = BlockManager(5, 2, enable_prefix_caching=True)  # 4 usable blocks
    cache = bm.prefix_cache
    a = computed(bm, [1, 1])
    b = computed(bm, [2, 2])
    a_block = a.block_ids[0]
    bm.free(b)
    bm.free(a)  # free queue: (2 untouched blocks), b's, a's
    assert bm.allocate(seq([0] * 6), 6)  # takes the untouched blocks, then b's
    assert not cache.match(seq([2, 2, 0]))
    assert cache.match(seq([1, 1, 0])).blocks == (a_block,)
