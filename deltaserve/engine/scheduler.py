"""Continuous batching under a token budget, with preemption by recompute.

One rule (docs/architecture.md, "Invariants"): each step, every scheduled sequence's
`num_computed_tokens` advances toward its `num_tokens` under `max_num_batched_tokens`. A decode
is one token (plus the drafts a speculative step verifies), a prefill chunk many; running
sequences go first (oldest first), then waiting ones are admitted while the budget, the sequence
limit and every cache pool allow. When a running sequence cannot grow in some pool, the newest
running sequence is preempted: its units in every pool are freed and it waits again at the front
of the queue, to be recomputed from scratch.

The scheduler sees the cache pools only through `PoolManager` (cache/manager.py) and the prefix
cache through `PrefixCache` (engine/prefix_cache.py); `build_scheduler` builds both from the
cache plan.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from deltaserve.cache.manager import PoolManager
from deltaserve.cache.ops import CacheOp, TruncateBlocks
from deltaserve.cache.planner import CachePlan
from deltaserve.cache.pools import POOL_KINDS
from deltaserve.cache.spec import CacheSpec
from deltaserve.config import EngineConfig, SchedulerConfig
from deltaserve.engine.block_manager import BlockManager
from deltaserve.engine.prefix_cache import NO_HIT, PrefixCache, PrefixHit, StateCheckpoint
from deltaserve.engine.sequence import Sequence, SequenceStatus
from deltaserve.engine.state_pool import StatePool
from deltaserve.logger import get_logger

logger = get_logger(__name__)


def drafts_in_row(seq: Sequence, num_new: int) -> int:
    """How many of the `num_new` tokens from `seq.num_computed_tokens` on are drafts (the last
    `seq.num_draft_tokens` of its tokens)."""
    first_draft = seq.num_tokens - seq.num_draft_tokens
    end = seq.num_computed_tokens + num_new
    return max(0, min(num_new, end - first_draft))


class ScheduledRow(tuple):
    """One row of a step: `(seq, num_new)` as a tuple (it unpacks and indexes as one), plus
    `num_draft`, how many of the row's new tokens are speculative drafts."""

    num_draft: int

    def __new__(cls, seq: Sequence, num_new: int, num_draft: int = 0) -> ScheduledRow:
        row = super().__new__(cls, (seq, num_new))
        row.num_draft = num_draft
        return row

    def __getnewargs__(self) -> tuple[Sequence, int, int]:  # copy / pickle
        return (self[0], self[1], self.num_draft)

    @property
    def seq(self) -> Sequence:
        return self[0]

    @property
    def num_new(self) -> int:
        return self[1]

    @property
    def is_decode(self) -> bool:
        """Valid before `Scheduler.advance` (it reads the context length)."""
        return ScheduledBatch.is_decode(self[0], self[1], self.num_draft)

    def __repr__(self) -> str:
        return f"ScheduledRow({self[0]!r}, num_new={self[1]}, num_draft={self.num_draft})"


@dataclass
class ScheduledBatch:
    """One step's work: rows `(sequence, number of new tokens)` in scheduling order, the
    sequences preempted to make room, the cache operations to apply before the forward, and
    the state snapshots to take inside it (seq_id -> checkpoint, prefill rows only)."""

    items: list[ScheduledRow] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    cache_ops: list[CacheOp] = field(default_factory=list)
    checkpoints: dict[int, StateCheckpoint] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    @staticmethod
    def is_decode(seq: Sequence, n: int, num_draft: int | None = None) -> bool:
        """A decode row: a non-empty context and one new token plus the row's drafts (q =
        1 + num_draft tokens; by default the drafts are read from `seq`). Valid before
        `Scheduler.advance`."""
        if num_draft is None:
            num_draft = drafts_in_row(seq, n)
        return seq.num_computed_tokens > 0 and n == 1 + num_draft

    def decodes_first(self) -> list[ScheduledRow]:
        """The rows with decodes first, grouped by their query length q (ascending), then
        prefill chunks; scheduling order is kept within each group (the kernels' batch order)."""

        def key(row: ScheduledRow) -> tuple[int, int]:
            return (0, row[1]) if row.is_decode else (1, 0)

        return sorted(self.items, key=key)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pools: list[PoolManager],
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        kinds = [p.kind for p in pools]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"one manager per pool kind, got {kinds}")
        self.config = config
        self.pools = list(pools)
        self.prefix_cache = prefix_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.max_running = config.max_num_seqs
        for pool in pools:
            if pool.max_sequences is not None:
                self.max_running = min(self.max_running, pool.max_sequences)
        self._pending_ops: list[CacheOp] = []
        if prefix_cache is not None:
            prefix_cache.bind(self.add_cache_op)
        # called with each sequence whose units are released (finished, aborted or preempted):
        # e.g. a speculative proposer frees its drafter cache for it
        self.release_hooks: list[Callable[[Sequence], None]] = []
        # image models: vision-encoder work per step, in merged image tokens (None: no images)
        self.encoder_budget: int | None = None

    # ---- look-ups ----------------------------------------------------------------------
    def pool(self, kind: str) -> PoolManager | None:
        """The manager of pool `kind`, or None when the model has no such pool."""
        return next((p for p in self.pools if p.kind == kind), None)

    @property
    def block_manager(self) -> BlockManager | None:
        return self.pool("paged")  # type: ignore[return-value]

    @property
    def state_pool(self) -> StatePool | None:
        return self.pool("slots")  # type: ignore[return-value]

    def usage(self) -> dict[str, tuple[int, int]]:
        """Pool kind -> (units in use, capacity)."""
        return {p.kind: (p.num_used, p.capacity) for p in self.pools}

    # ---- requests ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_cache_op(self, op: CacheOp) -> None:
        """Queue a cache operation for the next scheduled batch (applied before its forward)."""
        self._pending_ops.append(op)

    def admit_computed(self, seq: Sequence, num_computed: int) -> None:
        """Admit the waiting `seq` as running with its first `num_computed` tokens marked
        computed, holding the units a prefill of them would hold (nothing is computed: the
        caches keep whatever they hold; benchmarks use this to skip long prefills). Raises
        RuntimeError, with nothing changed, when the engine cannot hold it."""
        if seq.status != SequenceStatus.WAITING or seq not in self.waiting:
            raise RuntimeError(f"{seq} is not waiting; only a fresh request can be admitted")
        if not 0 <= num_computed < seq.num_tokens:
            raise ValueError(f"num_computed must be in [0, {seq.num_tokens}), got {num_computed}")
        if len(self.running) >= self.max_running:
            raise RuntimeError(f"the engine runs at most {self.max_running} sequences at once")
        for pool in self.pools:
            if not pool.can_allocate(seq, num_computed):
                raise RuntimeError(pool.shortage(seq, num_computed))
        for pool in self.pools:
            pool.allocate_for(seq, num_computed)
        seq.num_computed_tokens = num_computed
        seq.status = SequenceStatus.RUNNING
        self.waiting.remove(seq)
        self.running.append(seq)

    # ---- one step ----------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        encoder = [self.encoder_budget]  # what is left of this step's encoder budget

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget)
            if not chunked and n < remaining:
                break
            if self.prefix_cache is not None:  # at most one snapshot inside the chunk
                n = self.prefix_cache.limit_chunk(seq, seq.num_computed_tokens, n)
            cut = self._limit_encoder(seq, seq.num_computed_tokens, n, encoder)
            if cut < n and cut == 0:  # its next image waits for the next step's encoder budget
                i += 1
                continue
            n = cut
            while not self._allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.items.append(ScheduledRow(seq, n, drafts_in_row(seq, n)))
                self._checkpoint(batch, seq, seq.num_computed_tokens, n)
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted; everything after it is gone too

        while self.waiting and budget > 0 and not batch.preempted:
            if len(self.running) >= self.max_running:
                break
            seq = self.waiting[0]
            # a pool that cannot take the sequence at all (no free slot) stops admission first
            if not all(p.can_allocate(seq, 0) for p in self.pools):
                break
            hit = NO_HIT
            if self.prefix_cache is not None and seq.prompt_logprobs is None:
                # NOTE: prompt logprobs need every prompt position computed: no cache hits
                hit = self.prefix_cache.match(seq)
            num_cached = hit.num_tokens
            remaining = seq.num_tokens - num_cached
            n = min(remaining, budget)
            if not chunked and n < remaining:
                break
            if self.prefix_cache is not None:
                n = self.prefix_cache.limit_chunk(seq, num_cached, n)
            cut = self._limit_encoder(seq, num_cached, n, encoder)
            if cut < n and cut == 0:  # its first image waits for the next step's budget
                break
            n = cut
            if not self._allocate(seq, n, hit):
                break
            self.waiting.popleft()
            if self.prefix_cache is not None and seq.prompt_logprobs is None:
                self.prefix_cache.record_admission(seq, hit)
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = max(seq.num_cached_tokens, num_cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.items.append(ScheduledRow(seq, n, drafts_in_row(seq, n)))
            self._checkpoint(batch, seq, num_cached, n)
            budget -= n
        if batch.items:
            batch.cache_ops, self._pending_ops = self._pending_ops, []
        return batch

    def _checkpoint(self, batch: ScheduledBatch, seq: Sequence, start: int, n: int) -> None:
        """Ask the prefix cache for a state snapshot inside the row just scheduled."""
        if self.prefix_cache is None:
            return
        checkpoint = self.prefix_cache.checkpoint(seq, start, n)
        if checkpoint is not None:
            batch.checkpoints[seq.seq_id] = checkpoint

    def _limit_encoder(self, seq: Sequence, start: int, n: int, left: list) -> int:
        """Cut the chunk [start, start + n) before the first image that begins in it and does
        not fit what is left of the step's encoder budget (`left[0]`, merged tokens; charged
        here). An image larger than the whole budget runs alone in a step. Images begun before
        `start` are encoded already (cached)."""
        if seq.mm is None or left[0] is None:
            return n
        for item in seq.mm.items:
            if item.offset < start or item.offset >= start + n:
                continue
            if item.num_tokens > left[0] and left[0] < self.encoder_budget:
                return item.offset - start
            left[0] -= item.num_tokens
        return n

    def _allocate(self, seq: Sequence, n: int, hit: PrefixHit | None = None) -> bool:
        """Units in every pool for `n` more tokens of `seq` (after `hit`), or False with
        nothing changed."""
        if not all(p.can_allocate(seq, n, hit) for p in self.pools):
            return False
        for pool in self.pools:
            pool.allocate_for(seq, n, hit)
        return True

    def _release(self, seq: Sequence) -> None:
        for pool in self.pools:
            pool.release(seq)
        seq.state_slot = 0
        for hook in self.release_hooks:
            hook(seq)

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
        by an overlapped step's late results, are skipped: their blocks are gone).

        `num_rejected` maps seq_id -> how many of its row's drafts the step rejected: they
        (and any later drafts) are removed from the end of `seq.token_ids`, the sequence's
        computed tokens advance over the kept ones only, and its units past the new length are
        freed (a `TruncateBlocks` op tells the next batch)."""
        num_rejected = num_rejected or {}
        for row in batch.items:
            seq, n = row
            if seq.is_finished:
                continue
            rejected = num_rejected.get(seq.seq_id, 0)
            if not 0 <= rejected <= row.num_draft:
                raise ValueError(
                    f"{seq}: {rejected} rejected drafts, but its row carried {row.num_draft}"
                )
            kept = seq.num_computed_tokens + n - rejected
            if rejected:
                # NOTE: drafts are the tail of token_ids, so everything past `kept` is a
                # rejected (or unverified, later) draft
                del seq.token_ids[kept:]
                seq.num_draft_tokens = 0
                for pool in self.pools:
                    pool.truncate(seq, kept)
                self._pending_ops.append(TruncateBlocks(seq.seq_id, kept))
            else:
                # verified: ordinary tokens now
                seq.num_draft_tokens = max(0, seq.num_draft_tokens - row.num_draft)
            seq.num_computed_tokens = kept
            if self.prefix_cache is not None:
                self.prefix_cache.insert(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its units in every pool at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED

    def reset(self, pools: list[PoolManager], prefix_cache: PrefixCache | None) -> None:
        """Start afresh on new, empty pools and prefix cache (`build_pools` of the same plan):
        nothing cached, free units in their first order, the queued cache ops and counters
        dropped. Nothing may be running or waiting (the engine's warm-up, engine/warmup.py)."""
        if self.has_unfinished():
            raise RuntimeError("the scheduler can be reset only with no sequence in it")
        if [p.kind for p in pools] != [p.kind for p in self.pools]:
            raise ValueError(f"reset with pools {[p.kind for p in pools]}, not the same kinds")
        self.pools = list(pools)
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            prefix_cache.bind(self.add_cache_op)
        self._pending_ops = []
        self.num_preemptions = 0


def build_scheduler(config: EngineConfig, plan: CachePlan, specs: list[CacheSpec]) -> Scheduler:
    """The scheduler over one manager per pool of `plan`, with a prefix cache when every pool
    can serve prefix hits (and the config does not turn it off).

    Raises ValueError when prefix caching is asked for and some pool cannot serve it."""
    kinds = [kind for name, kind in POOL_KINDS.items() if plan.units.get(name)]
    # a pool that cannot serve a hit by itself is served by one that shares its tensors
    # (recurrent-state slots by state snapshots, cache/snapshots.py)
    served = {k.shares for k in kinds if k.shares is not None and k.supports_prefix_caching}
    blockers = {k.name for k in kinds if not k.supports_prefix_caching} - served
    prefix = config.cache.enable_prefix_caching
    if prefix is not False and blockers:
        names = (s.display_name or type(s).__name__ for s in specs if s.pool in blockers)
        layers = " and ".join(dict.fromkeys(names))
        why = (
            f"{config.model.architecture} has {layers} layers, whose prefixes need recurrent-"
            "state snapshots, and the cache memory holds none (raise prefix_state_memory)"
        )
        if prefix:
            raise ValueError(f"enable_prefix_caching: {why}")
        logger.info("prefix caching off: %s", why)
        prefix = False
    pools, cache = build_pools(config, plan, prefix is not False)
    return Scheduler(config.scheduler, pools, cache)


def build_pools(
    config: EngineConfig, plan: CachePlan, prefix: bool
) -> tuple[list[PoolManager], PrefixCache | None]:
    """One new manager per pool of `plan`, in the pool kinds' order, and their prefix cache
    (None unless `prefix`)."""
    kinds = [kind for name, kind in POOL_KINDS.items() if plan.units.get(name)]
    pools = [k.build(plan.units[k.name], config, prefix) for k in kinds]
    caches = [p.prefix_cache for p in pools if p.prefix_cache is not None]
    if len(caches) > 1:
        raise ValueError("prefix caching over more than one pool is not supported yet")
    cache = caches[0] if caches else None
    for pool in pools:
        cache = pool.wrap_prefix_cache(cache, pools)
    return pools, cache
