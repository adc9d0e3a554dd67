"""The snapshot pool's bookkeeping and the hybrid prefix cache's decisions, on integer ids only
(no model): LRU eviction, references, the private-unit limit, chunk ends at snapshot targets,
the cache ops queued, and everything released."""

from __future__ import annotations

import pytest

from deltaserve.cache.ops import CopySlot
from deltaserve.cache.snapshots import SnapshotPool
from deltaserve.config import SchedulerConfig
from deltaserve.engine.block_manager import BlockManager
from deltaserve.engine.prefix_cache import StateCheckpoint
from deltaserve.engine.scheduler import Scheduler
from deltaserve.engine.sequence import Sequence
from deltaserve.engine.state_pool import StatePool
from deltaserve.sampling_params import SamplingParams

BS = 4


def test_lru_eviction_refs_and_private_units():
    pool = SnapshotPool(3)
    a, b, c = pool.take(), pool.take(), pool.take()
    assert (a, b, c) == (0, 1, 2) and pool.take() is None  # nothing registered to evict
    pool.register(a, key=10)
    pool.register(b, key=11)
    pool.register(c, key=12)
    assert pool.num_free == 3 and pool.num_held == 3  # unreferenced snapshots count as free
    pool.ref(a)
    pool.touch(b)  # LRU order now: c, b (a is referenced)
    assert pool.num_free == 2 and pool.num_used == 1
    assert pool.take() == c and pool.lookup(12) is None and pool.num_evicted == 1
    assert pool.take() == b and pool.take() is None  # a is referenced: never evicted
    pool.unref(a)
    with pytest.raises(ValueError, match="not referenced"):
        pool.unref(a)
    with pytest.raises(ValueError, match="already registered"):
        pool.register(b, key=10)
    # private units: at most half the pool
    small = SnapshotPool(4)
    p1, p2 = small.take_private(), small.take_private()
    assert p1 is not None and p2 is not None and small.take_private() is None
    assert small.num_used == 2
    small.register(p1, key=5)  # a private unit becomes a registered snapshot
    small.free_private(p2)
    assert small.num_private == 0 and small.num_free == 4


def _scheduler(num_snapshots: int = 8, interval: int = 0) -> Scheduler:
    blocks = BlockManager(64, BS, enable_prefix_caching=True)
    slots = StatePool(5)
    snaps = SnapshotPool(num_snapshots, BS, interval)
    pools = [blocks, slots, snaps]
    cache = snaps.wrap_prefix_cache(blocks.prefix_cache, pools)
    return Scheduler(SchedulerConfig(4, 64, True), pools, cache)


def _seq(tokens) -> Sequence:
    return Sequence("r", 0, list(tokens), SamplingParams(max_tokens=2))


def _step(s: Scheduler):
    batch = s.schedule()
    s.advance(batch)
    return batch


def test_checkpoints_inside_chunks_and_hits_restore():
    s = _scheduler(interval=8)
    cache, snaps = s.prefix_cache, s.pool("snapshots")
    assert snaps.base == 5  # snapshot rows follow the 5 slots
    a = _seq(range(1, 19))  # 18 tokens: targets 8 (interval), 16 (last full block before 18)
    s.add(a)
    batch = _step(s)
    # one checkpoint per row and step: the chunk carries the one at 8 and ends at 16
    assert [(q, n) for q, n in batch.items] == [(a, 16)]
    assert batch.checkpoints == {a.seq_id: StateCheckpoint(8, snaps.row(0))}
    # after the step: 8 registered (copied inside it), 16 (the chunk's end) copied next step
    assert batch.cache_ops == [] and snaps.num_held == 2
    batch = _step(s)
    assert [(q, n) for q, n in batch.items] == [(a, 2)] and not batch.checkpoints
    assert batch.cache_ops == [CopySlot(a.state_slot, snaps.row(1))]
    s.finish(a)
    # the same prompt again: hits 16 tokens, restores the snapshot into its slot
    b = _seq(range(1, 19))
    s.add(b)
    batch = _step(s)
    assert [(q, n) for q, n in batch.items] == [(b, 2)] and b.num_cached_tokens == 16
    assert batch.cache_ops == [CopySlot(snaps.row(1), b.state_slot)]
    assert cache.stats.hits == 1 and cache.stats.hit_tokens == 16
    s.finish(b)
    assert all(p.num_used == 0 for p in s.pools)
    assert not cache._plans and not cache._restoring and not cache._trailing
    assert not cache._pending


def test_checkpoint_keys_and_units():
    """A prompt whose end is cached already takes no checkpoint; two equal prompts in one
    step both checkpoint, the second unit is put back; with no unit to take, the snapshot is
    skipped and the chunk runs whole; an aborted sequence gives its unit back."""
    s = _scheduler(num_snapshots=2)
    cache, snaps = s.prefix_cache, s.pool("snapshots")
    a, b = _seq(range(1, 11)), _seq(range(1, 11))  # 10 tokens: target 8
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert [(q, n) for q, n in batch.items] == [(a, 10), (b, 10)]
    assert batch.checkpoints == {
        a.seq_id: StateCheckpoint(8, snaps.row(0)),
        b.seq_id: StateCheckpoint(8, snaps.row(1)),
    }
    s.advance(batch)
    assert snaps.num_held == 1 and snaps.num_free == 2  # b's unit went back
    s.finish(a)
    s.finish(b)
    c = _seq(list(range(1, 11)) + [7, 7])  # 12 tokens: its target 8 is cached already
    s.add(c)
    batch = _step(s)
    assert not batch.checkpoints and c.num_cached_tokens == 8
    s.finish(c)
    # every unit referenced (restores in flight): nothing to take
    held = [_seq([50 + i] * 9) for i in range(2)]
    for seq in held:
        _run_prefill(s, seq)
        s.finish(seq)
    assert snaps.num_held == 2
    for unit in range(2):
        snaps.ref(unit)
    d = _seq(range(100, 110))
    s.add(d)
    skipped = cache.num_skipped
    batch = _step(s)
    assert [(q, n) for q, n in batch.items] == [(d, 10)] and not batch.checkpoints
    assert cache.num_skipped == skipped + 1
    s.finish(d)
    for unit in range(2):
        snaps.unref(unit)
    # aborted between its schedule and its advance: the checkpoint's unit is free again
    e = _seq(range(200, 210))
    s.add(e)
    batch = s.schedule()
    assert e.seq_id in batch.checkpoints and snaps.num_free == 1
    s.finish(e)
    assert snaps.num_free == 2 and not cache._pending
    assert all(p.num_used == 0 for p in s.pools)


def test_rows_with_drafts_take_no_checkpoint():
    s = _scheduler()
    a = _seq(range(1, 7))
    _run_prefill(s, a)
    for t in range(7, 12):
        a.append_token(t)
    a.num_draft_tokens = 4  # 5 new tokens, 4 of them drafts, crossing the boundary at 8
    s.prefix_cache._plans[a.seq_id].targets.append(8)  # even a planned target is not taken
    batch = s.schedule()
    assert [(q, n) for q, n in batch.items] == [(a, 5)] and not batch.checkpoints
    s.finish(a)
    assert all(p.num_used == 0 for p in s.pools)


def _run_prefill(s: Scheduler, seq: Sequence) -> list:
    s.add(seq)
    ops = []
    while seq.num_computed_tokens < seq.num_tokens:
        ops += _step(s).cache_ops
    return ops


def test_trailing_snapshot_registered_at_finish():
    s = _scheduler()
    snaps = s.pool("snapshots")
    a = _seq(range(1, 7))  # 6 tokens: a chunk ends at 4 (last full block before the last token)
    _run_prefill(s, a)
    assert snaps.num_held == 1 and snaps.num_private == 0
    taken = []
    for t in range(7, 14):  # decode 7 tokens: computed 6 -> 12 (the last one is not computed)
        a.append_token(t)
        taken += _step(s).cache_ops
    # every decode boundary (8, 12) rewrites the one private unit
    private = snaps.row(1)
    assert taken == [CopySlot(a.state_slot, private)] * 2 and snaps.num_private == 1
    s.finish(a)
    assert snaps.num_private == 0 and snaps.num_held == 2  # registered under the key at 12
    b = _seq(list(range(1, 13)) + [50])
    s.add(b)
    batch = _step(s)
    assert b.num_cached_tokens == 12 and batch.cache_ops == [CopySlot(private, b.state_slot)]
    s.finish(b)
    assert all(p.num_used == 0 for p in s.pools)


def test_divergence_point_is_snapshotted():
    s = _scheduler()
    snaps = s.pool("snapshots")
    a = _seq(range(1, 31))  # 30 tokens: one snapshot, at 28
    _run_prefill(s, a)
    s.finish(a)
    assert snaps.num_held == 1
    # b shares 15 tokens with a: KV blocks for 12 are cached but no snapshot: a miss whose
    # prefill snapshots 12 (where it diverged) inside its chunk, which ends at 16 (its end)
    b = _seq(list(range(1, 16)) + [99] * 5)
    s.add(b)
    batch = _step(s)
    assert b.num_cached_tokens == 0 and [(q, n) for q, n in batch.items] == [(b, 16)]
    assert batch.checkpoints[b.seq_id].num_tokens == 12
    while b.num_computed_tokens < b.num_tokens:
        _step(s)
    s.finish(b)
    assert snaps.num_held == 4  # 28 (a); 12, 16 and its block-aligned end 20 (b)
    c = _seq(list(range(1, 16)) + [98] * 3)
    s.add(c)
    _step(s)
    assert c.num_cached_tokens == 12
    s.finish(c)
    assert all(p.num_used == 0 for p in s.pools)
