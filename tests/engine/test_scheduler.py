"""The scheduling rule, chunking, admission limits and preemption (no model)."""

from deltaserve.config import SchedulerConfig
from deltaserve.engine.block_manager import BlockManager
from deltaserve.engine.scheduler import Scheduler
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
