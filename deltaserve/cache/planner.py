"""Sizing and allocating every cache pool from the layers' cache specs.

`plan_caches` adds up, per pool kind, the bytes each layer's spec needs per unit
(`CacheSpec.unit_bytes`) and lets the pool kinds (cache/pools.py) size themselves within the
memory budget; `allocate_caches` builds each layer's tensors from `CacheSpec.tensors`. Nothing
here knows a concrete spec class: a new cache kind is a new spec (and maybe a new pool kind).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from deltaserve import env
from deltaserve.cache.pools import POOL_KINDS, PoolBudget, in_sizing_order, pool_kind
from deltaserve.cache.spec import CacheSpec, dtype_bytes
from deltaserve.config import EngineConfig
from deltaserve.forward_context import LayerCache
from deltaserve.logger import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class CachePlan:
    """Units (null unit included) and bytes per unit of each pool the model uses, by pool name.

    A pool is present when some layer's spec uses it; `num_blocks` / `num_slots` /
    `block_bytes` / `slot_bytes` read the "paged" and "slots" pools (0 when absent)."""

    units: Mapping[str, int] = field(default_factory=dict)
    unit_bytes: Mapping[str, int] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return self.units.get("paged", 0)

    @property
    def num_slots(self) -> int:
        return self.units.get("slots", 0)

    @property
    def block_bytes(self) -> int:
        return self.unit_bytes.get("paged", 0)

    @property
    def slot_bytes(self) -> int:
        return self.unit_bytes.get("slots", 0)

    @property
    def total_bytes(self) -> int:
        return sum(n * self.unit_bytes[name] for name, n in self.units.items())

    def with_units(self, units: Mapping[str, int]) -> CachePlan:
        """The same plan with the unit counts of the pools it has taken from `units` (e.g. the
        fewest any tensor-parallel rank holds)."""
        return CachePlan({name: int(units[name]) for name in self.units}, dict(self.unit_bytes))


def pool_unit_bytes(specs: list[CacheSpec], config: EngineConfig) -> dict[str, int]:
    """Pool name -> bytes all layers together need per unit of it (pools without bytes are
    left out), in the order pool kinds are registered."""
    cc, mc = config.cache, config.model
    total: dict[str, int] = {}
    for s in specs:
        total[s.pool] = total.get(s.pool, 0) + s.unit_bytes(cc.block_size, mc.dtype, cc.state_dtype)
    for name in total:
        pool_kind(name)  # an unknown pool fails here, by name
    for kind in POOL_KINDS.values():  # pools whose units are extra rows of another pool's
        if kind.shares is not None and total.get(kind.shares):
            total[kind.name] = total[kind.shares]
    ordered = [name for name in POOL_KINDS if total.get(name)]
    return {name: total[name] for name in ordered}


def plan_caches(specs: list[CacheSpec], config: EngineConfig) -> CachePlan:
    """Decide how many units of each pool to allocate within the memory budget."""
    unit_bytes = pool_unit_bytes(specs, config)
    if config.model.device.type == "cuda":
        budget = _cuda_cache_budget(config)
    elif config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    else:
        budget = int(env.cache_memory_gb() * 2**30)
    units: dict[str, int] = {}
    left = budget
    for kind in in_sizing_order(list(unit_bytes)):
        n = kind.size(unit_bytes[kind.name], PoolBudget(budget, left), config)
        units[kind.name] = n
        left -= n * unit_bytes[kind.name]
    return CachePlan({name: units[name] for name in unit_bytes}, unit_bytes)


def activation_reserve_bytes(config: EngineConfig) -> int:
    """Memory kept free for one step's activations: the widest per-token intermediates of the
    largest step, fp32 logits for every sequence, and 1 GiB of slack for kernels' workspaces."""
    mc, sc = config.model, config.scheduler
    tc = mc.text_config
    hidden = int(tc.hidden_size)
    inter = int(getattr(tc, "intermediate_size", 4 * hidden))
    width = 4 * hidden + 3 * inter  # residual, normed input, projections, gate/up output
    per_token = width * dtype_bytes(mc.dtype) * 2  # x2: the allocator's fragmentation
    vocab = int(getattr(tc, "vocab_size", 0))
    from deltaserve.multimodal.budget import encoder_reserve_bytes

    encoder = encoder_reserve_bytes(config)  # image models: encoder cache + activations
    return sc.max_num_batched_tokens * per_token + sc.max_num_seqs * vocab * 4 * 2 + 2**30 + encoder


def _cuda_cache_budget(config: EngineConfig) -> int:
    """`--gpu-memory-utilization` of the device, less the weights (loaded first), what other
    processes hold, and the activation reserve: what is left goes to the cache pools. With
    `--kv-cache-memory-bytes`, that size instead, if the device has it free beyond the
    activation reserve."""
    dev = config.model.device
    free, total = torch.cuda.mem_get_info(dev)
    if config.kv_cache_memory_bytes is not None:
        want, reserve = config.kv_cache_memory_bytes, activation_reserve_bytes(config)
        logger.info(
            "GPU memory: %.2f GiB for caches (kv_cache_memory_bytes), %.2f GiB free, %.2f "
            "reserved for activations",
            want / 2**30,
            free / 2**30,
            reserve / 2**30,
        )
        if want + reserve > free:
            raise ValueError(
                f"kv_cache_memory_bytes ({want / 2**30:.2f} GiB) and the activation reserve "
                f"({reserve / 2**30:.2f} GiB) exceed the device's free memory "
                f"({free / 2**30:.2f} GiB)"
            )
        return want
    ours = torch.cuda.memory_reserved(dev)  # weights (and anything else this process holds)
    others = total - free - ours
    reserve = activation_reserve_bytes(config)
    budget = int(total * config.gpu_memory_utilization) - ours - others - reserve
    logger.info(
        "GPU memory: %.1f GiB total, %.2f used by weights, %.2f by other processes, "
        "%.2f reserved for activations, %.2f for caches (gpu_memory_utilization %.2f)",
        total / 2**30,
        ours / 2**30,
        others / 2**30,
        reserve / 2**30,
        max(budget, 0) / 2**30,
        config.gpu_memory_utilization,
    )
    if budget <= 0:
        raise ValueError(
            "no GPU memory left for the KV cache and state pool after the weights "
            f"({ours / 2**30:.1f} GiB) and activations ({reserve / 2**30:.1f} GiB); raise "
            "gpu_memory_utilization or lower max_num_batched_tokens / max_num_seqs"
        )
    return budget


def describe_capacity(plan: CachePlan, config: EngineConfig) -> str:
    """What fits: how many sequences of what length the cache pools hold at once."""
    parts = [
        kind.describe(plan.units[name], plan.unit_bytes[name], config)
        for name, kind in POOL_KINDS.items()
        if plan.units.get(name)
    ]
    return "; ".join(parts)


def plan_rows(plan: CachePlan, pool: str) -> int:
    """Rows the tensors of pool `pool` have: its units, then the units of every pool that
    shares its tensors (e.g. "snapshots" after "slots")."""
    rows = plan.units.get(pool, 0)
    for kind in POOL_KINDS.values():
        if kind.shares == pool:
            rows += plan.units.get(kind.name, 0)
    return rows


def allocate_caches(
    specs: list[CacheSpec], plan: CachePlan, config: EngineConfig
) -> list[LayerCache]:
    """One LayerCache (name -> tensor, as the spec declares) per decoder layer, zero-filled on
    the model's device; every layer of a pool gets the plan's units of that pool (plus those of
    the pools sharing its tensors, `plan_rows`)."""
    mc, cc = config.model, config.cache
    caches = []
    for s in specs:
        shapes = s.tensors(plan_rows(plan, s.pool), cc.block_size, mc.dtype, cc.state_dtype)
        caches.append(
            {
                name: torch.zeros(shape, dtype=dtype, device=mc.device)
                for name, (shape, dtype) in shapes.items()
            }
        )
    return caches
