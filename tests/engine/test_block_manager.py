"""Block manager and state pool bookkeeping (pure Python, no tensors)."""

import pytest

from deltaserve.engine.block_manager import BlockManager
from deltaserve.engine.sequence import Sequence
from deltaserve.engine.state_pool import StatePool
from deltaserve.sampling_params import SamplingParams


def seq(tokens):
    return Sequence("r", 0, list(tokens), SamplingParams(max_tokens=4))


def test_allocate_and_free_counts():
    bm = BlockManager(num_blocks=9, block_size=4, enable_prefix_caching=False)
    assert bm.capacity == 8 and bm.num_free_blocks == 8
    s = seq(range(10))
    assert bm.allocate(s, 10)
    assert len(s.block_ids) == 3 and 0 not in s.block_ids  # block 0 is the null block
    assert bm.num_used_blocks == 3
    s.num_computed_tokens = 10
    assert bm.allocate(s, 2)  # 12 tokens still fit in 3 blocks
    assert len(s.block_ids) == 3
    assert bm.allocate(s, 3)  # 15 tokens need a 4th block
    assert len(s.block_ids) == 4
    bm.free(s)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8 and s.block_ids == []


def test_allocate_fails_without_side_effects():
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    s = seq(range(12))
    assert not bm.allocate(s, 12)  # needs 3, only 2 usable
    assert s.block_ids == [] and bm.num_free_blocks == 2


def test_prefix_hit_shares_blocks_and_leaves_last_token():
    bm = BlockManager(num_blocks=17, block_size=4, enable_prefix_caching=True)
    a = seq(range(12))
    assert bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    # identical prompt: only 2 of its 3 full blocks may hit (the last token must be computed)
    b = seq(range(12))
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_ids[:2]
    assert bm.allocate(b, 4, hits)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert bm.ref_counts[a.block_ids[0]] == 2
    # a different second block stops the hit chain after the first block
    c = seq([0, 1, 2, 3, 9, 9, 9, 9, 8, 8, 8, 8, 7])
    assert bm.find_cached_prefix(c) == a.block_ids[:1]
    bm.free(a)
    bm.free(b)
    assert bm.num_used_blocks == 0


def test_cached_blocks_survive_free_until_evicted():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = seq([1, 2, 3, 4, 5])
    assert bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    first_two = a.block_ids[:2]
    bm.free(a)
    assert bm.num_used_blocks == 0
    b = seq([1, 2, 3, 4, 5])
    assert bm.find_cached_prefix(b) == first_two  # hit after free
    # fill the cache with other data: everything gets evicted
    c = seq([7, 7, 7, 7, 7, 7])
    assert bm.allocate(c, 6)
    bm.free(c)
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5])) == []


def test_state_pool_never_hands_out_null_slot():
    pool = StatePool(4)
    got = [pool.allocate() for _ in range(3)]
    assert sorted(got) == [1, 2, 3] and pool.allocate() is None
    pool.free(got[1])
    assert pool.num_used == 2 and pool.allocate() == got[1]
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(0)


def test_free_releases_tail_blocks_first_so_a_prefix_outlives_its_continuation():
    bm = BlockManager(num_blocks=5, block_size=2, enable_prefix_caching=True)  # 4 usable
    a = seq([1, 2, 3, 4, 5, 6])
    assert bm.allocate(a, 6)
    a.num_computed_tokens = 6
    bm.cache_full_blocks(a)
    head, mid, tail = a.block_ids
    bm.free(a)
    # the free queue: the block never used, then a's blocks from its tail to its head
    assert list(bm.free_queue) == [next(iter(bm.free_queue)), tail, mid, head]
    b = seq([9, 9, 9, 9])
    assert bm.allocate(b, 4)  # memory pressure: two blocks are taken for new data
    assert tail in b.block_ids and head not in b.block_ids and mid not in b.block_ids
    # the prefix [1, 2, 3, 4] is still cached; only its continuation [5, 6] is gone
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5, 6, 7])) == [head, mid]


def test_truncate_releases_blocks_past_a_length():
    bm = BlockManager(num_blocks=9, block_size=4, enable_prefix_caching=False)
    s = seq(range(14))
    assert bm.allocate(s, 14)
    ids = s.block_ids
    kept = ids[:2]
    bm.truncate(s, 7)  # 7 tokens need 2 blocks of 4
    assert s.block_ids == kept and s.block_ids is not ids  # a new list (host tables)
    assert bm.num_used_blocks == 2 and bm.ref_counts[ids[3]] == 0
    bm.truncate(s, 8)  # nothing to drop
    assert s.block_ids == kept
    bm.free(s)
    assert bm.num_used_blocks == 0


def test_pool_interface_of_both_managers():
    bm = BlockManager(num_blocks=3, block_size=4)
    pool = StatePool(2)
    s = seq(range(8))
    assert bm.can_allocate(s, 8) and not bm.can_allocate(s, 9)
    assert "2 free blocks, too few for 9 more tokens" in bm.shortage(s, 9)
    bm.allocate_for(s, 8)
    pool.allocate_for(s, 8)
    assert s.state_slot == 1 and pool.num_used == 1 and bm.num_used == 2
    t = seq(range(3))
    assert not pool.can_allocate(t, 3) and pool.can_allocate(s, 100)
    assert pool.max_sequences == 1 and bm.max_sequences is None
    pool.release(s)
    bm.release(s)
    assert s.state_slot == 0 and pool.num_used == 0 and bm.num_used == 0
