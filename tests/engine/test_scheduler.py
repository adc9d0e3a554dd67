"""The scheduling rule, chunking, admission limits and preemption (no model)."""

import pytest
import torch

from deltaserve.cache.ops import CopySlot, TruncateBlocks
from deltaserve.cache.planner import CachePlan
from deltaserve.cache.spec import AttentionSpec, GDNSpec
from deltaserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deltaserve.engine.block_manager import BlockManager
from deltaserve.engine.hybrid_prefix_cache import HybridPrefixCache
from deltaserve.engine.prefix_cache import BlockPrefixCache
from deltaserve.engine.scheduler import Scheduler, build_scheduler
from deltaserve.engine.sequence import Sequence, SequenceStatus
from deltaserve.engine.state_pool import StatePool
from deltaserve.sampling_params import SamplingParams


def make(budget=16, max_seqs=8, blocks=65, slots=None, chunked=True):
    cfg = SchedulerConfig(max_seqs, budget, chunked)
    bm = BlockManager(blocks, 4, False)
    pools = [bm, StatePool(slots)] if slots else [bm]
    return Scheduler(cfg, pools)


def seq(n, rid="r"):
    return Sequence(rid, 0, list(range(n)), SamplingParams(max_tokens=8))


def run_step(s):
    batch = s.schedule()
    s.advance(batch)
    for q, _ in batch.items:  # pretend each finished prefill sampled one token
        if q.num_computed_tokens == q.num_tokens:
            q.append_token(1)
    return batch


def test_chunked_prefill_under_budget_then_decode():
    s = make(budget=8)
    a = seq(20)
    s.add(a)
    sizes = [run_step(s).items[0][1] for _ in range(4)]
    assert sizes == [8, 8, 4, 1]  # three chunks, then a one-token decode
    assert a.num_computed_tokens == 21


def test_running_first_then_admission_within_budget():
    s = make(budget=10)
    a, b = seq(6, "a"), seq(9, "b")
    s.add(a)
    s.add(b)
    batch = run_step(s)
    assert [(q.request_id, n) for q, n in batch.items] == [("a", 6), ("b", 4)]
    batch = run_step(s)  # a decodes, b continues its prefill
    assert [(q.request_id, n) for q, n in batch.items] == [("a", 1), ("b", 5)]


def test_no_chunking_waits_for_whole_prompt():
    s = make(budget=8, chunked=False)
    a, b = seq(6, "a"), seq(5, "b")
    s.add(a)
    s.add(b)
    batch = run_step(s)
    assert [(q.request_id, n) for q, n in batch.items] == [("a", 6)]


def test_state_slots_limit_admission():
    s = make(slots=3)  # two usable slots
    qs = [seq(3, str(i)) for i in range(3)]
    for q in qs:
        s.add(q)
    batch = run_step(s)
    assert len(batch.items) == 2 and s.state_pool.num_free == 0
    assert {q.state_slot for q, _ in batch.items} == {1, 2}
    s.finish(qs[0])
    assert s.state_pool.num_free == 1
    batch = run_step(s)
    assert qs[2] in [q for q, _ in batch.items]


def test_preemption_frees_and_requeues_newest():
    s = make(budget=64, blocks=5)  # 4 usable blocks of 4 tokens
    a, b = seq(8, "a"), seq(7, "b")
    s.add(a)
    s.add(b)
    run_step(s)  # a: 2 blocks (8 +1 sampled = 9 tokens), b: 2 blocks (8 tokens)
    batch = run_step(s)  # a needs a 3rd block -> b (newest) is preempted
    assert s.num_preemptions == 1 and batch.preempted == [b]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_ids == [] and s.waiting[0] is b
    assert [q for q, _ in batch.items] == [a]


def test_finish_releases_everything():
    s = make(slots=4)
    qs = [seq(5, str(i)) for i in range(3)]
    for q in qs:
        s.add(q)
    run_step(s)
    for q in qs:
        s.finish(q)
    assert s.block_manager.num_used_blocks == 0 and s.state_pool.num_used == 0
    assert not s.has_unfinished()


# ---- rows, drafts and rollback -------------------------------------------------------------
def with_drafts(s, q, drafts):
    """Append `drafts` to the running sequence `q` as speculative tokens."""
    q.token_ids.extend(drafts)
    q.num_draft_tokens = len(drafts)


def test_rows_unpack_as_pairs_and_carry_drafts():
    s = make(budget=32)
    a, b = seq(6, "a"), seq(5, "b")
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled, each sampled one token
    with_drafts(s, a, [7, 8, 9])
    batch = s.schedule()
    row_a, row_b = batch.items
    q, n = row_a
    assert (q, n) == (a, 4) and row_a[1] == 4 and row_a.num_draft == 3 and row_a.seq is a
    assert (row_b.num_new, row_b.num_draft) == (1, 0)
    assert row_a.is_decode and row_b.is_decode
    assert batch.is_decode(a, 4) and not batch.is_decode(a, 4, num_draft=0)
    assert isinstance(row_a, tuple) and tuple(row_a) == (a, 4)


def test_decodes_first_groups_decodes_by_query_length():
    s = make(budget=64)
    qs = [seq(5, str(i)) for i in range(4)]
    for q in qs:
        s.add(q)
    run_step(s)
    with_drafts(s, qs[0], [1, 1])
    with_drafts(s, qs[2], [1, 1])
    late = seq(9, "late")
    s.add(late)
    batch = s.schedule()
    order = [(q.request_id, n) for q, n in batch.decodes_first()]
    assert order == [("1", 1), ("3", 1), ("0", 3), ("2", 3), ("late", 9)]


def test_advance_rolls_back_rejected_drafts():
    s = make(budget=64, blocks=9)  # blocks of 4 tokens
    a = seq(6, "a")
    s.add(a)
    run_step(s)  # 6 computed, 7 tokens (one sampled)
    with_drafts(s, a, [10, 11, 12, 13, 14])  # 12 tokens: 3 blocks
    batch = s.schedule()
    assert batch.items[0].num_draft == 5 and batch.items[0][1] == 6
    assert len(a.block_ids) == 3
    s.advance(batch, {a.seq_id: 4})  # the first draft is kept, four are rejected
    assert a.token_ids == list(range(6)) + [1, 10]
    assert a.num_computed_tokens == 8 and a.num_draft_tokens == 0
    assert len(a.block_ids) == 2 and s.block_manager.num_used_blocks == 2
    a.append_token(2)  # the bonus token sampled after the last kept draft
    batch = s.schedule()
    assert [(q, n) for q, n in batch.items] == [(a, 1)]
    assert batch.cache_ops == [TruncateBlocks(a.seq_id, 8)]  # carried once, then gone
    s.advance(batch)
    assert s.schedule().cache_ops == []


def test_advance_without_rejections_keeps_every_draft():
    s = make(budget=64)
    a = seq(6, "a")
    s.add(a)
    run_step(s)
    with_drafts(s, a, [10, 11])
    batch = s.schedule()
    s.advance(batch, {a.seq_id: 0})
    assert a.num_computed_tokens == 9 == a.num_tokens and a.num_draft_tokens == 0
    with pytest.raises(ValueError, match="rejected drafts"):
        b = seq(6, "b")
        s.add(b)
        s.advance(s.schedule(), {b.seq_id: 1})  # b's row carries no drafts


def test_a_chunk_that_stops_before_the_drafts_leaves_them_pending():
    s = make(budget=4)
    a = seq(6, "a")
    with_drafts(s, a, [10, 11])  # e.g. a preempted sequence being recomputed
    s.add(a)
    batch = s.schedule()
    assert (batch.items[0][1], batch.items[0].num_draft) == (4, 0)
    s.advance(batch)
    assert a.num_draft_tokens == 2
    batch = s.schedule()
    assert (batch.items[0][1], batch.items[0].num_draft) == (4, 2)
    assert not batch.items[0].is_decode  # a prefill chunk that ends with the drafts
    s.advance(batch, {a.seq_id: 1})
    assert a.num_tokens == 7 and a.num_computed_tokens == 7 and a.num_draft_tokens == 0


# ---- pools, cache ops, admission -----------------------------------------------------------
def test_pools_are_looked_up_by_kind():
    s = make(slots=3)
    assert s.block_manager is s.pools[0] and s.state_pool is s.pools[1]
    assert s.pool("paged") is s.block_manager and s.pool("nothing") is None
    assert s.max_running == 2  # two usable state slots
    assert make().state_pool is None
    with pytest.raises(AttributeError):
        s.block_manager = None


def test_queued_cache_ops_ride_on_the_next_batch():
    s = make(slots=3)
    s.add_cache_op(CopySlot(1, 2))
    assert not s.schedule()  # nothing to run: the op waits
    a = seq(3)
    s.add(a)
    batch = s.schedule()
    assert batch.cache_ops == [CopySlot(1, 2)]
    s.advance(batch)
    assert s.schedule().cache_ops == []


def test_admit_computed_marks_a_waiting_sequence_running():
    s = make(slots=3, blocks=5)  # 4 blocks of 4 tokens, 2 slots
    a, b, c = seq(10, "a"), seq(10, "b"), seq(4, "c")
    for q in (a, b, c):
        s.add(q)
    s.admit_computed(a, 9)
    assert a.status == SequenceStatus.RUNNING and a in s.running and a not in s.waiting
    assert a.num_computed_tokens == 9 and len(a.block_ids) == 3 and a.state_slot == 1
    with pytest.raises(RuntimeError, match="free blocks, too few for 9"):
        s.admit_computed(b, 9)
    assert b.block_ids == [] and b.state_slot == 0 and b in s.waiting  # nothing changed
    with pytest.raises(RuntimeError, match="is not waiting"):
        s.admit_computed(a, 9)
    s.admit_computed(c, 3)
    with pytest.raises(RuntimeError, match="at most 2 sequences"):
        s.admit_computed(b, 1)
    batch = s.schedule()  # both now compute their last prompt token
    assert [(q, n) for q, n in batch.items] == [(a, 1), (c, 1)]


def test_build_scheduler_decides_prefix_caching():
    attn = [AttentionSpec(2, 1, 8)]
    hybrid = [GDNSpec(1, 1, 4, 4, 3), AttentionSpec(2, 1, 8)]

    def cfg(prefix):
        model = ModelConfig(
            "m", None, None, "Hybrid", torch.float32, torch.device("cpu"), 32, None, 0
        )
        return EngineConfig(
            model, CacheConfig(4, prefix, None, torch.float32), SchedulerConfig(4, 16, True)
        )

    plan_attn = CachePlan({"paged": 17}, {"paged": 64})
    plan_hybrid = CachePlan(
        {"paged": 17, "slots": 5, "snapshots": 3}, {"paged": 64, "slots": 100, "snapshots": 100}
    )
    assert isinstance(build_scheduler(cfg(None), plan_attn, attn).prefix_cache, BlockPrefixCache)
    assert build_scheduler(cfg(False), plan_attn, attn).prefix_cache is None
    # hybrid: on by default, over KV blocks plus state snapshots (rows after the 5 slots)
    s = build_scheduler(cfg(None), plan_hybrid, hybrid)
    assert isinstance(s.prefix_cache, HybridPrefixCache)
    assert s.block_manager.capacity == 16 and s.state_pool.capacity == 4
    assert s.pool("snapshots").capacity == 3 and s.pool("snapshots").base == 5
    assert build_scheduler(cfg(False), plan_hybrid, hybrid).prefix_cache is None
    # no memory for snapshots: off when auto, an error when asked for
    no_snapshots = CachePlan({"paged": 17, "slots": 5}, {"paged": 64, "slots": 100})
    assert build_scheduler(cfg(None), no_snapshots, hybrid).prefix_cache is None
    with pytest.raises(ValueError) as err:
        build_scheduler(cfg(True), no_snapshots, hybrid)
    assert str(err.value) == (
        "enable_prefix_caching: Hybrid has Gated DeltaNet layers, whose prefixes need "
        "recurrent-state snapshots, and the cache memory holds none (raise prefix_state_memory)"
    )
