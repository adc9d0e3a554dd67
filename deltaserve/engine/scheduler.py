"""Continuous batching under a token budget, with preemption by recompute.

One rule (DESIGN.md invariant 3): each step, every scheduled sequence's `num_computed_tokens`
advances toward its `num_tokens` under `max_num_batched_tokens`. A decode is one token, a
prefill chunk many; running sequences go first (oldest first), then waiting ones are admitted
while the budget, the sequence limit, KV blocks and state slots allow. When a running sequence
needs a block and none is free, the newest running sequence is preempted: its blocks and state
slot are freed and it waits again at the front of the queue, to be recomputed from scratch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from deltaserve.config import SchedulerConfig
from deltaserve.engine.block_manager import BlockManager
from deltaserve.engine.sequence import Sequence, SequenceStatus
from deltaserve.engine.state_pool import StatePool


@dataclass
class ScheduledBatch:
    """One step's work: (sequence, number of new tokens) in scheduling order."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    @staticmethod
    def is_decode(seq: Sequence, n: int) -> bool:
        """One new token on a non-empty context (valid before `Scheduler.advance`)."""
        return n == 1 and seq.num_computed_tokens > 0

    def decodes_first(self) -> list[tuple[Sequence, int]]:
        """The items with decodes first, then prefill chunks (the kernels' batch order)."""
        return sorted(self.items, key=lambda it: 0 if self.is_decode(*it) else 1)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager | None,
        state_pool: StatePool | None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.state_pool = state_pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.max_running = config.max_num_seqs
        if state_pool is not None:
            self.max_running = min(self.max_running, state_pool.capacity)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget)
            if not chunked and n < remaining:
                break
            while not self._allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.items.append((seq, n))
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted; everything after it is gone too

        while self.waiting and budget > 0 and not batch.preempted:
            if len(self.running) >= self.max_running:
                break
            seq = self.waiting[0]
            if self.state_pool is not None and self.state_pool.num_free == 0:
                break
            cached = []
            if self.block_manager is not None and seq.prompt_logprobs is None:
                # NOTE: prompt logprobs need every prompt position computed: no cache hits
                cached = self.block_manager.find_cached_prefix(seq)
            num_cached = len(cached) * (self.block_manager.block_size if cached else 0)
            remaining = seq.num_tokens - num_cached
            n = min(remaining, budget)
            if not chunked and n < remaining:
                break
            if self.block_manager is not None and not self.block_manager.allocate(seq, n, cached):
                break
            if self.state_pool is not None:
                seq.state_slot = self.state_pool.allocate()
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = max(seq.num_cached_tokens, num_cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.items.append((seq, n))
            budget -= n
        return batch

    def _allocate(self, seq: Sequence, n: int) -> bool:
        return self.block_manager is None or self.block_manager.allocate(seq, n)

    def _release(self, seq: Sequence) -> None:
        if self.block_manager is not None:
            self.block_manager.free(seq)
        if self.state_pool is not None and seq.state_slot:
            self.state_pool.free(seq.state_slot)
        seq.state_slot = 0

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- after the step ----------------------------------------------------------------
    def advance(self, batch: ScheduledBatch, num_rejected: dict[int, int] | None = None) -> None:
        """Record that the batch's tokens are now in the caches (sequences finished meanwhile,
        by an overlapped step's late results, are skipped: their blocks are gone)."""
        for seq, n in batch.items:
            if seq.is_finished:
                continue
            seq.num_computed_tokens += n
            if self.block_manager is not None:
                self.block_manager.cache_full_blocks(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks and state slot at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
