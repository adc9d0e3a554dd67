"""The "snapshots" pool: copies of a sequence's recurrent state, for prefix caching of hybrid
models (bookkeeping only; the copies are `CopySlot` cache ops applied by the runner, or
checkpoints the GDN layers copy inside a prefill step, ops/gdn/checkpoints.py).

A GDN layer's state after token p depends on every token before it, so a cached KV prefix can
be resumed only with the recurrent state (SSM + conv) at its end. A snapshot is one copy of
every GDN layer's state at a block boundary, keyed by the KV block hash chain up to that
boundary (engine/prefix_cache.py). Its units are extra rows of the "slots" pool's tensors, after
the slots (`PoolKind.shares`), so restoring one is `CopySlot(snapshot row -> slot)` and taking
one `CopySlot(slot -> snapshot row)`, on every tensor-parallel rank's own state shards.

Units are:
- free;
- registered: a snapshot under its key, with a reference count (a restore queued but not yet
  applied holds one); unreferenced ones wait in an LRU queue and are evicted, least recently
  used first, when a new snapshot needs a unit;
- private: a running sequence's trailing snapshot, rewritten at each block boundary its decode
  passes, registered when the sequence lets go of its units (finished, aborted, preempted).

The pool has its own memory budget (`prefix_state_memory`), so snapshots never compete with KV
blocks or slots: taking one never preempts a request, and when no unit can be had the snapshot
is simply not taken. The policy (where to snapshot, matching) is HybridPrefixCache's
(engine/hybrid_prefix_cache.py).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from deltaserve.cache.manager import PoolManager
from deltaserve.cache.pools import PoolBudget, PoolKind, register_pool_kind
from deltaserve.config import EngineConfig
from deltaserve.engine.prefix_cache import BlockPrefixCache, PrefixCache, PrefixHit
from deltaserve.engine.sequence import Sequence

if TYPE_CHECKING:
    from deltaserve.engine.hybrid_prefix_cache import HybridPrefixCache

DEFAULT_SHARE = 10  # without prefix_state_memory: a tenth of the cache memory ...
DEFAULT_MAX_OF_LEFT = 4  # ... at most a quarter of what the slots left ...
DEFAULT_PER_SEQUENCE = 4  # ... and at most 4 snapshots per max_num_seqs (64 at least)


class SnapshotPool(PoolManager):
    """Snapshot units (0 .. num_units - 1), stored at tensor rows `base + unit`."""

    kind = "snapshots"
    supports_prefix_caching = True

    def __init__(
        self,
        num_units: int,
        block_size: int = 16,
        interval: int = 0,
        decode_interval: int | None = None,
    ) -> None:
        if num_units < 1:
            raise ValueError(f"the snapshot pool needs at least 1 unit, got {num_units}")
        self.num_units = num_units
        self.block_size = block_size
        self.interval = interval
        self.decode_interval = block_size if decode_interval is None else decode_interval
        self.base = 0  # row of unit 0 in the "slots" tensors (set by wrap_prefix_cache)
        self._free: list[int] = list(range(num_units - 1, -1, -1))  # pop() yields 0, 1, ...
        self._key_of: dict[int, int] = {}  # registered unit -> key (block hash at its end)
        self._unit_of: dict[int, int] = {}  # key -> registered unit
        self._refs: dict[int, int] = {}  # registered unit -> references
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced registered units
        self._private: set[int] = set()
        # trailing snapshots may hold at most half the units: the rest stay for shared ones
        self.max_private = max(1, num_units // 2)
        self.num_taken = 0  # snapshots registered so far
        self.num_evicted = 0  # registered snapshots dropped for new ones
        self.prefix_cache: HybridPrefixCache | None = None

    # ---- rows ----------------------------------------------------------------------------
    def row(self, unit: int) -> int:
        return self.base + unit

    def unit(self, row: int) -> int:
        return row - self.base

    # ---- registered snapshots ------------------------------------------------------------
    def lookup(self, key: int) -> int | None:
        """The unit of the snapshot registered under `key`, or None."""
        return self._unit_of.get(key)

    def touch(self, unit: int) -> None:
        """`unit` was just used: it is evicted last."""
        if unit in self._lru:
            self._lru.move_to_end(unit)

    def ref(self, unit: int) -> None:
        if unit not in self._key_of:
            raise ValueError(f"snapshot unit {unit} is not registered")
        if self._refs[unit] == 0:
            del self._lru[unit]
        self._refs[unit] += 1

    def unref(self, unit: int) -> None:
        if self._refs.get(unit, 0) <= 0:
            raise ValueError(f"snapshot unit {unit} is not referenced")
        self._refs[unit] -= 1
        if self._refs[unit] == 0:
            self._lru[unit] = None

    def take(self) -> int | None:
        """A unit for new data: a free one, else the least recently used unreferenced snapshot
        (evicted); None when every unit is referenced or private."""
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        unit, _ = self._lru.popitem(last=False)
        key = self._key_of.pop(unit)
        del self._unit_of[key]
        del self._refs[unit]
        self.num_evicted += 1
        return unit

    def put_back(self, unit: int) -> None:
        """`unit`, taken but never registered (its snapshot is not kept), is free again."""
        if unit in self._key_of or unit in self._private or unit in self._free:
            raise ValueError(f"snapshot unit {unit} was not taken")
        self._free.append(unit)

    def register(self, unit: int, key: int) -> None:
        """`unit` (just taken, or private) now holds the snapshot at `key`, unreferenced."""
        if key in self._unit_of:
            raise ValueError(f"a snapshot is already registered under key {key}")
        self._private.discard(unit)
        self._key_of[unit] = key
        self._unit_of[key] = unit
        self._refs[unit] = 0
        self._lru[unit] = None
        self.num_taken += 1

    # ---- private (trailing) snapshots ----------------------------------------------------
    def take_private(self) -> int | None:
        if len(self._private) >= self.max_private:
            return None
        unit = self.take()
        if unit is not None:
            self._private.add(unit)
        return unit

    def free_private(self, unit: int) -> None:
        self._private.remove(unit)
        self._free.append(unit)

    # ---- PoolManager ---------------------------------------------------------------------
    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> bool:
        return True  # snapshots are best effort: never a reason to wait or preempt

    def allocate_for(
        self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> None:
        # NOTE: pools allocate in registration order: the slot is already the sequence's
        if hit is not None and self.prefix_cache is not None:
            self.prefix_cache.on_admit(seq, hit)

    def release(self, seq: Sequence) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.on_release(seq)

    @property
    def capacity(self) -> int:
        return self.num_units

    @property
    def num_free(self) -> int:
        """Free units plus unreferenced snapshots (evictable), as for cached KV blocks."""
        return len(self._free) + len(self._lru)

    @property
    def num_held(self) -> int:
        """Registered snapshots (referenced or not)."""
        return len(self._key_of)

    @property
    def num_private(self) -> int:
        return len(self._private)

    def wrap_prefix_cache(
        self, cache: PrefixCache | None, pools: list[PoolManager]
    ) -> PrefixCache | None:
        from deltaserve.engine.hybrid_prefix_cache import HybridPrefixCache

        if cache is None:
            return None
        if not isinstance(cache, BlockPrefixCache):
            raise ValueError(
                f"state snapshots extend a paged-block prefix cache, got {type(cache).__name__}"
            )
        slots = next((p for p in pools if p.kind == "slots"), None)
        if slots is None:
            raise ValueError("the snapshot pool needs the model's recurrent-state slots pool")
        self.base = slots.num_slots  # type: ignore[attr-defined]
        self.prefix_cache = HybridPrefixCache(cache, self, self.interval, self.decode_interval)
        return self.prefix_cache


# ---- the pool kind: sized after the slots, before the KV blocks ---------------------------
def _size_snapshots(unit_bytes: int, budget: PoolBudget, config: EngineConfig) -> int:
    cc = config.cache
    if not cc.prefix_caching:
        return 0
    if cc.prefix_state_memory is not None:
        wanted = cc.prefix_state_memory
        if wanted > budget.left:
            raise ValueError(
                f"prefix_state_memory ({wanted / 2**30:.2f} GiB) does not fit: the recurrent-"
                f"state slots left {max(budget.left, 0) / 2**30:.2f} GiB of cache memory"
            )
    else:
        wanted = min(budget.total // DEFAULT_SHARE, max(budget.left, 0) // DEFAULT_MAX_OF_LEFT)
        most = max(64, DEFAULT_PER_SEQUENCE * config.scheduler.max_num_seqs)
        return int(min(wanted // unit_bytes, most))
    return int(wanted // unit_bytes)


def _describe_snapshots(units: int, unit_bytes: int, config: EngineConfig) -> str:
    return (
        f"{units} prefix-state snapshots fit ({units * unit_bytes / 2**30:.2f} GiB): the "
        "recurrent state at that many cached prefix ends"
    )


register_pool_kind(
    PoolKind(
        name="snapshots",
        size=_size_snapshots,
        describe=_describe_snapshots,
        build=lambda units, config, prefix: SnapshotPool(
            units,
            config.cache.block_size,
            config.cache.prefix_snapshot_interval,
            config.cache.prefix_snapshot_decode_interval,
        ),
        manager=SnapshotPool,
        sizing_order=1,
        shares="slots",
    )
)
