"""Prefix caching for hybrid models: KV blocks plus recurrent-state snapshots.

A hit needs both the KV blocks of a prefix (BlockPrefixCache) and a snapshot of the recurrent
state at the prefix's end (cache/snapshots.py). `match` walks the sequence's block hash chain
while its blocks are cached and keeps the longest prefix whose end has a snapshot; admitting
the sequence queues `CopySlot(snapshot -> slot)`, applied by the runner before the forward.

Where snapshots are taken, always on computed tokens (only rows without drafts are ever
snapshotted at a target, and `insert` runs in `Scheduler.advance`, after rejected drafts are
rolled back, so only accepted tokens are ever snapshotted):
- targets planned when a sequence is admitted, each a block boundary inside its prefill:
  the end of the cached KV prefix when it is longer than the snapshot hit (the point where
  this request's traffic diverged from an earlier one: the next request sharing it hits there),
  at multiples of `interval` tokens at least `interval` past the start (a long shared
  document; not a short chat turn that crosses one), and the last full block before its last
  token (the prompt's end: the same prompt again hits it). A chunk that strictly contains a
  target t carries a CHECKPOINT (`checkpoint`, asked by the scheduler once the row is in the
  batch): a unit is taken then, and the step's GDN ops copy the slot's state after the chunk's
  first t - start tokens into it inside the forward (ops/gdn/checkpoints.py); `insert`
  registers the unit under the block hash at t after the step. One checkpoint per row and
  step: `limit_chunk` ends a chunk at the second target inside it, and a chunk that ends
  exactly at a target is snapshotted by `insert` as `CopySlot(slot -> unit)` (the slot holds
  the boundary's state until the next step). When no unit can be had the snapshot is skipped
  (`num_skipped`), as everywhere here.
- a trailing snapshot during decode: at each block boundary its decode passes that is a
  multiple of `decode_interval` (the block size by default, `prefix_snapshot_decode_interval`;
  0: none), the sequence's private unit is rewritten, a copy of its whole recurrent state;
  when the sequence lets go of its units (finished: prompt plus answer, so the next chat turn
  hits; preempted: so its recompute hits) it is registered under the key of the last boundary
  so taken (by default the last full block of its computed tokens).

Copies are queued as cache ops (`emit`) in the order they are decided, so a copy out of a slot
is applied before anything later overwrites that slot, and a restore after the copy it reads;
in-step copies run inside the forward, after every cache op of the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deltaserve.cache.ops import CacheOp, CopySlot
from deltaserve.engine.prefix_cache import (
    NO_HIT,
    BlockPrefixCache,
    PrefixCache,
    PrefixCacheStats,
    PrefixHit,
    StateCheckpoint,
)
from deltaserve.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:  # a runtime import would be circular
    from deltaserve.cache.snapshots import SnapshotPool


@dataclass
class _Plan:
    """Block boundaries to snapshot inside one admission's prefill."""

    targets: list[int]  # ascending, all > the admission's cached tokens
    last: int  # the last of them (0: none): past it, boundaries are decode boundaries


@dataclass
class _Pending:
    """A unit taken for a checkpoint, filled inside the step, registered by `insert`."""

    unit: int
    key: int  # the block hash at the checkpoint's boundary
    boundary: int


@dataclass
class _Trailing:
    unit: int  # the sequence's private unit
    key: int | None  # the block hash at the boundary it holds (None: nothing worth keeping)


class HybridPrefixCache(PrefixCache):
    """Prefix cache over paged KV blocks and recurrent-state snapshots."""

    def __init__(
        self,
        blocks: BlockPrefixCache,
        snapshots: SnapshotPool,
        interval: int,
        decode_interval: int,
    ) -> None:
        self.blocks = blocks
        self.snapshots = snapshots
        self.block_size = blocks.block_size
        bs = self.block_size
        self.interval = (interval // bs) * bs if interval >= bs else 0
        # trailing snapshots at multiples of this (a multiple of the block size, checked with
        # the engine's config; 0: none)
        self.decode_interval = decode_interval
        self.stats = PrefixCacheStats()
        self.num_hit_tokens = 0
        self.num_skipped = 0  # snapshots not taken: no unit could be had
        self._emit: Callable[[CacheOp], None] | None = None
        self._kv_end: dict[int, int] = {}  # seq_id -> tokens of its cached KV prefix (match)
        self._plans: dict[int, _Plan] = {}
        self._restoring: dict[int, int] = {}  # seq_id -> snapshot unit referenced by its restore
        self._trailing: dict[int, _Trailing] = {}
        self._pending: dict[int, _Pending] = {}  # seq_id -> its step's checkpoint

    def bind(self, emit: Callable[[CacheOp], None]) -> None:
        """Where cache ops go: the scheduler's queue for the next batch."""
        self._emit = emit

    def _op(self, op: CacheOp) -> None:
        if self._emit is None:
            raise RuntimeError("HybridPrefixCache.bind() was not called")
        self._emit(op)

    def _key(self, seq: Sequence, boundary: int) -> int:
        """The block hash chain of `seq` up to `boundary` (a multiple of the block size)."""
        return self.blocks.block_hashes(seq, boundary // self.block_size)[-1]

    # ---- PrefixCache ---------------------------------------------------------------------
    def match(self, seq: Sequence) -> PrefixHit:
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs  # leave at least the last token to compute
        cached: list[int] = []
        best, best_unit = 0, None
        for i, h in enumerate(self.blocks.block_hashes(seq, max_blocks)):
            block = self.blocks.hash_to_block.get(h)
            if block is None:
                break
            cached.append(block)
            unit = self.snapshots.lookup(h)
            if unit is not None:
                best, best_unit = i + 1, unit
        self._kv_end[seq.seq_id] = len(cached) * bs
        if best_unit is None:
            return NO_HIT
        self.num_hit_tokens += best * bs
        return PrefixHit(best * bs, tuple(cached[:best]), self.snapshots.row(best_unit))

    def limit_chunk(self, seq: Sequence, start: int, num_new: int) -> int:
        if seq.num_draft_tokens:
            return num_new  # NOTE: a row with drafts is never cut (its boundaries are missed)
        if seq.status == SequenceStatus.WAITING:
            self._plans[seq.seq_id] = self._plan(seq, start)
        plan = self._plans.get(seq.seq_id)
        if plan is None:
            return num_new
        inside = [t for t in plan.targets if start < t < start + num_new]
        if len(inside) > 1:  # one checkpoint per row and step: end the chunk at the second
            return inside[1] - start
        return num_new

    def checkpoint(self, seq: Sequence, start: int, num_new: int) -> StateCheckpoint | None:
        if seq.num_draft_tokens or not seq.state_slot:
            return None
        plan = self._plans.get(seq.seq_id)
        if plan is None:
            return None
        t = next((t for t in plan.targets if start < t < start + num_new), None)
        if t is None:
            return None
        plan.targets.remove(t)  # decided now: taken in this step, cached already, or skipped
        key = self._key(seq, t)
        pool = self.snapshots
        existing = pool.lookup(key)
        if existing is not None:
            pool.touch(existing)
            return None
        unit = pool.take()
        if unit is None:
            self.num_skipped += 1
            return None
        self._pending[seq.seq_id] = _Pending(unit, key, t)
        return StateCheckpoint(t - start, pool.row(unit))

    def _plan(self, seq: Sequence, start: int) -> _Plan:
        bs = self.block_size
        # NOTE: the last full block before the last token: the same prompt again can hit it
        # (a hit leaves a token to compute); a block-aligned end is the trailing snapshot's
        last = ((seq.num_tokens - 1) // bs) * bs
        targets = {last} if last > start else set()
        kv_end = self._kv_end.get(seq.seq_id, 0)
        if start < kv_end <= last:
            targets.add(kv_end)
        if self.interval:
            # multiples of the interval at least one interval past the prefill's start: a
            # chat turn that resumes just before a multiple would otherwise carry it and its
            # prompt's end, two targets, and split its short prefill over two steps
            first = -(-(start + self.interval) // self.interval) * self.interval
            targets.update(range(first, last, self.interval))
        ordered = sorted(targets)
        return _Plan(ordered, ordered[-1] if ordered else 0)

    def insert(self, seq: Sequence) -> None:
        self.blocks.insert(seq)
        unit = self._restoring.pop(seq.seq_id, None)
        if unit is not None:  # its restore ran with the step that computed these tokens
            self.snapshots.unref(unit)
        pending = self._pending.pop(seq.seq_id, None)
        if pending is not None:  # the step copied the state at its boundary into the unit
            self._keep(pending, seq.num_computed_tokens)
        c = seq.num_computed_tokens
        if c == 0 or c % self.block_size or not seq.state_slot:
            return
        plan = self._plans.get(seq.seq_id)
        if plan is not None and c in plan.targets:
            plan.targets = [t for t in plan.targets if t > c]
            self._take_shared(seq, c)
        elif (plan is None or c > plan.last) and self._trailing_due(c):
            self._take_trailing(seq, c)

    def _trailing_due(self, boundary: int) -> bool:
        """Whether a sequence past its planned targets rewrites its trailing snapshot at this
        block boundary: at multiples of the decode interval (none when it is 0)."""
        return self.decode_interval > 0 and boundary % self.decode_interval == 0

    def _keep(self, pending: _Pending, num_computed: int) -> None:
        """Register a checkpoint's unit, unless another row of its step registered the same
        key first (identical prefixes) or the step did not reach its boundary."""
        pool = self.snapshots
        if num_computed < pending.boundary or pool.lookup(pending.key) is not None:
            pool.put_back(pending.unit)
        else:
            pool.register(pending.unit, pending.key)

    def _take_shared(self, seq: Sequence, boundary: int) -> None:
        key = self._key(seq, boundary)
        pool = self.snapshots
        existing = pool.lookup(key)
        if existing is not None:
            pool.touch(existing)
            return
        unit = pool.take()
        if unit is None:
            self.num_skipped += 1
            return
        pool.register(unit, key)
        self._op(CopySlot(seq.state_slot, pool.row(unit)))

    def _take_trailing(self, seq: Sequence, boundary: int) -> None:
        key = self._key(seq, boundary)
        pool = self.snapshots
        trailing = self._trailing.get(seq.seq_id)
        existing = pool.lookup(key)
        if existing is not None:  # already cached (e.g. the prompt's end): nothing to copy
            pool.touch(existing)
            if trailing is not None:
                trailing.key = None
            return
        if trailing is None:
            unit = pool.take_private()
            if unit is None:
                self.num_skipped += 1
                return
            trailing = self._trailing[seq.seq_id] = _Trailing(unit, None)
        trailing.key = key
        self._op(CopySlot(seq.state_slot, pool.row(trailing.unit)))

    def evict(self, unit: int) -> None:
        self.blocks.evict(unit)

    def lock(self, hit: PrefixHit) -> None:
        self.blocks.lock(hit)
        if hit.state:
            self.snapshots.ref(self.snapshots.unit(hit.state))

    def unlock(self, hit: PrefixHit) -> None:
        self.blocks.unlock(hit)
        if hit.state:
            self.snapshots.unref(self.snapshots.unit(hit.state))

    def forget(self, seq: Sequence, num_tokens: int = 0) -> None:
        self.blocks.forget(seq, num_tokens)

    # ---- the snapshot pool's hooks (it is a PoolManager the scheduler drives) -------------
    def on_admit(self, seq: Sequence, hit: PrefixHit) -> None:
        """`seq` was admitted with `hit` and holds its slot: restore the hit's snapshot into it
        (referenced until the step that runs with the restore has advanced)."""
        if not hit or not hit.state:
            return
        unit = self.snapshots.unit(hit.state)
        self.snapshots.ref(unit)
        self.snapshots.touch(unit)
        self._restoring[seq.seq_id] = unit
        self._op(CopySlot(hit.state, seq.state_slot))

    def on_release(self, seq: Sequence) -> None:
        """`seq` let go of its units: drop its references and plan; register its trailing
        snapshot (the state at the last full block of its computed tokens)."""
        sid = seq.seq_id
        unit = self._restoring.pop(sid, None)
        if unit is not None:
            self.snapshots.unref(unit)
        pending = self._pending.pop(sid, None)
        if pending is not None:  # its step never advanced it (e.g. aborted meanwhile)
            # NOTE: a copy into the unit still in flight is stream-ordered before any reuse
            self.snapshots.put_back(pending.unit)
        self._plans.pop(sid, None)
        self._kv_end.pop(sid, None)
        trailing = self._trailing.pop(sid, None)
        if trailing is None:
            return
        pool = self.snapshots
        if trailing.key is None or pool.lookup(trailing.key) is not None:
            pool.free_private(trailing.unit)
        else:
            pool.register(trailing.unit, trailing.key)
