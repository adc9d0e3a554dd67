"""Decode-graph bucketing and step timing (CPU: no graph is captured here)."""

from deltaserve.engine.cuda_graph import batch_size_buckets
from deltaserve.engine.stats import PHASES, StepTimer


def test_buckets_cover_every_batch_size_and_end_at_the_maximum():
    for max_bs in (1, 3, 8, 9, 64, 100, 256, 512):
        buckets = batch_size_buckets(max_bs)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_bs
        for n in range(1, max_bs + 1):
            b = next(b for b in buckets if b >= n)
            assert b - n <= max(8, n // 4), (max_bs, n, b)  # padding stays small
    assert batch_size_buckets(6) == [1, 2, 4, 6]
    assert batch_size_buckets(256)[:8] == [1, 2, 4, 8, 16, 24, 32, 40]


def test_step_timer_bills_phases_and_syncs_only_when_enabled():
    calls = []
    timer = StepTimer(True, sync=lambda: calls.append(1))
    timer.start()
    for phase in PHASES:
        timer.mark(phase)
    assert len(calls) == len(PHASES)
    totals = timer.take()
    assert set(totals) == set(PHASES) and all(t >= 0 for t in totals.values())
    assert all(t == 0 for t in timer.take().values())  # take() resets
    off = StepTimer(False, sync=lambda: calls.append(1))
    off.start()
    off.mark("forward")
    assert len(calls) == len(PHASES) and off.take()["forward"] == 0
