"""Pool kinds: how each pool is sized, described, and which manager hands out its units.

A cache spec names its pool kind (`CacheSpec.pool`); the planner (cache/planner.py) sizes each
pool kind that some spec uses, in `sizing_order`, from the bytes its specs need per unit, and
the scheduler's factory (engine/scheduler.py `build_scheduler`) builds its manager. A new pool
kind is one `register_pool_kind` call: neither the planner nor the scheduler changes.

Built in:
- "paged": per token, in blocks of `block_size` tokens (`BlockManager`); block 0 is null;
- "slots": one per running sequence (`StatePool`); slot 0 is null;
- "snapshots": copies of a sequence's recurrent state for prefix caching of hybrid models
  (cache/snapshots.py); it `shares` the "slots" pool's tensors: its units are extra rows of
  them, after the slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deltaserve.cache.manager import PoolManager
from deltaserve.config import EngineConfig
from deltaserve.engine.block_manager import BlockManager, cdiv
from deltaserve.engine.state_pool import StatePool
from deltaserve.logger import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class PoolBudget:
    """Cache memory in bytes: all of it, and what pools sized earlier left."""

    total: int
    left: int


@dataclass(frozen=True)
class PoolKind:
    """One pool kind: its sizing policy, its capacity line and its manager."""

    name: str
    # (bytes per unit, budget, config) -> units including the null unit; raises ValueError when
    # the budget cannot serve the config
    size: Callable[[int, PoolBudget, EngineConfig], int]
    # (units, bytes per unit, config) -> one clause of the start-up capacity line
    describe: Callable[[int, int, EngineConfig], str]
    # (units, config, prefix caching on) -> the scheduler's manager of the pool
    build: Callable[[int, EngineConfig, bool], PoolManager]
    manager: type[PoolManager]
    sizing_order: int  # pools with a lower order are sized first
    # another pool whose tensors this one's units extend (extra rows after that pool's units,
    # at the same bytes per unit); None: the specs naming this pool have tensors of their own
    shares: str | None = None

    @property
    def supports_prefix_caching(self) -> bool:
        return self.manager.supports_prefix_caching


POOL_KINDS: dict[str, PoolKind] = {}  # in the order the capacity line lists them


def register_pool_kind(kind: PoolKind) -> PoolKind:
    """Add (or replace) a pool kind."""
    POOL_KINDS[kind.name] = kind
    return kind


def pool_kind(name: str) -> PoolKind:
    try:
        return POOL_KINDS[name]
    except KeyError:
        known = ", ".join(POOL_KINDS)
        raise ValueError(f"no cache pool kind {name!r} is registered (known: {known})") from None


def in_sizing_order(names: list[str]) -> list[PoolKind]:
    """The pool kinds named, in the order the planner sizes them."""
    return sorted((pool_kind(n) for n in names), key=lambda k: k.sizing_order)


# ---- "slots": one per sequence, sized first ---------------------------------------------
def slots_per_sequence(config: EngineConfig) -> int:
    """Slots each running sequence needs: 2 while speculating (its own and a scratch slot for
    the pre-verify state of a GDN rollback), else 1."""
    return 2 if config.speculative is not None else 1


def scratch_slots(num_slots: int, config: EngineConfig) -> range:
    """The scratch slots of a "slots" pool of `num_slots` (the last ones; none without
    speculative decoding)."""
    num_scratch = (num_slots - 1) // 2 if slots_per_sequence(config) == 2 else 0
    return range(num_slots - num_scratch, num_slots)


def _size_slots(unit_bytes: int, budget: PoolBudget, config: EngineConfig) -> int:
    """One slot per sequence (max_num_seqs, plus the null slot; two per sequence while
    speculating), but at most half the budget."""
    max_seqs = config.scheduler.max_num_seqs
    per_seq = slots_per_sequence(config)
    num_slots = per_seq * max_seqs + 1
    if num_slots * unit_bytes > budget.total // 2:
        num_slots = max(1 + per_seq, (budget.total // 2) // unit_bytes + 1)
        logger.info(
            "recurrent state for %d sequences exceeds half the cache memory; "
            "at most %d sequences run at once",
            max_seqs,
            (num_slots - 1) // per_seq,
        )
    return num_slots


def _describe_slots(units: int, unit_bytes: int, config: EngineConfig) -> str:
    scratch = len(scratch_slots(units, config))
    extra = f", {scratch} of them scratch slots for speculative rollback" if scratch else ""
    return (
        f"{units - 1} recurrent-state slots "
        f"({units * unit_bytes / 2**30:.2f} GiB{extra}): at most "
        f"{units - 1 - scratch} sequences of any length at once"
    )


# ---- "paged": blocks of block_size tokens, take the rest --------------------------------
def _size_paged(unit_bytes: int, budget: PoolBudget, config: EngineConfig) -> int:
    """What the budget has left, up to max_num_seqs full-length sequences (or
    num_gpu_blocks_override); at least one max_model_len sequence must fit."""
    mc, cc, sc = config.model, config.cache, config.scheduler
    per_seq = cdiv(mc.max_model_len, cc.block_size)
    if cc.num_gpu_blocks_override is not None:
        num_blocks = cc.num_gpu_blocks_override
    else:
        wanted = sc.max_num_seqs * per_seq + 1
        fit = budget.left // unit_bytes
        num_blocks = int(min(wanted, fit))
    if num_blocks - 1 < per_seq:
        raise ValueError(
            f"the KV cache holds {max(num_blocks - 1, 0)} blocks of {cc.block_size} tokens, "
            f"fewer than one sequence of max_model_len={mc.max_model_len} needs ({per_seq}); "
            "lower max_model_len or give the cache more memory"
        )
    return num_blocks


def _describe_paged(units: int, unit_bytes: int, config: EngineConfig) -> str:
    cc, mc = config.cache, config.model
    tokens = (units - 1) * cc.block_size
    per_seq = cdiv(mc.max_model_len, cc.block_size) * cc.block_size
    return (
        f"{units - 1} KV blocks of {cc.block_size} tokens "
        f"({units * unit_bytes / 2**30:.2f} GiB) = {tokens} tokens: "
        f"{tokens // per_seq} sequences of max_model_len {mc.max_model_len} at once"
    )


register_pool_kind(
    PoolKind(
        name="paged",
        size=_size_paged,
        describe=_describe_paged,
        build=lambda units, config, prefix: BlockManager(units, config.cache.block_size, prefix),
        manager=BlockManager,
        sizing_order=2,
    )
)
register_pool_kind(
    PoolKind(
        name="slots",
        size=_size_slots,
        describe=_describe_slots,
        build=lambda units, config, prefix: StatePool(units, len(scratch_slots(units, config))),
        manager=StatePool,
        sizing_order=0,
    )
)

# NOTE: registered last, after the pools it builds on ("snapshots" shares "slots")
from deltaserve.cache import snapshots as _snapshots  # noqa: E402, F401
