"""A new cache kind is an addition: toy specs (and a toy pool kind) defined here get planned,
allocated and scheduled without any change to the planner or the scheduler."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from deltaserve.cache import pools as pool_registry
from deltaserve.cache.manager import PoolManager
from deltaserve.cache.planner import allocate_caches, describe_capacity, plan_caches
from deltaserve.cache.pools import PoolKind
from deltaserve.cache.spec import AttentionSpec, CacheSpec
from deltaserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deltaserve.engine.scheduler import build_scheduler
from deltaserve.engine.sequence import Sequence
from deltaserve.sampling_params import SamplingParams

LATENT_DIM = 576  # an MLA-like compressed latent (512) plus its rope part (64)


@dataclass(frozen=True)
class LatentSpec(CacheSpec):
    """Paged per token: one latent vector per token, no heads."""

    pool: ClassVar[str] = "paged"
    layer_kind: ClassVar[str] = "latent"
    display_name: ClassVar[str] = "latent attention"

    dim: int = LATENT_DIM

    def tensors(self, num_units, block_size, dtype, state_dtype):
        return {"latent": ((num_units, block_size, self.dim), dtype)}


@dataclass(frozen=True)
class ScratchSpec(CacheSpec):
    """One slot per sequence: a small state in the state dtype plus an int16 counter row."""

    pool: ClassVar[str] = "slots"
    layer_kind: ClassVar[str] = "scratch"

    def tensors(self, num_units, block_size, dtype, state_dtype):
        return {
            "scratch": ((num_units, 3, 5), state_dtype),
            "counter": ((num_units, 2), torch.int16),
        }


def config(max_num_seqs=4, prefix=None, block_size=4, max_model_len=64) -> EngineConfig:
    model = ModelConfig(
        "m", None, None, "ToyArch", torch.float16, torch.device("cpu"), max_model_len, None, 0
    )
    cache = CacheConfig(block_size, prefix, None, torch.float32)
    return EngineConfig(model, cache, SchedulerConfig(max_num_seqs, 32, True))


def seq(n: int) -> Sequence:
    return Sequence("r", 0, list(range(n)), SamplingParams(max_tokens=4))


def test_toy_specs_planned_allocated_scheduled(monkeypatch):
    monkeypatch.setenv("DELTASERVE_CACHE_MEMORY_GB", "0.001")
    specs = [LatentSpec(), ScratchSpec(), LatentSpec(), ScratchSpec()]
    cfg = config(prefix=False)
    plan = plan_caches(specs, cfg)
    latent_block = 4 * LATENT_DIM * 2  # fp16
    scratch_slot = 3 * 5 * 4 + 2 * 2
    # the "snapshots" pool shares the "slots" tensors (none without prefix caching)
    assert plan.units["snapshots"] == 0
    assert plan.unit_bytes == {
        "paged": 2 * latent_block,
        "slots": 2 * scratch_slot,
        "snapshots": 2 * scratch_slot,
    }
    assert plan.num_slots == 4 + 1  # max_num_seqs + the null slot
    assert plan.num_blocks == 4 * (64 // 4) + 1  # max_num_seqs full-length sequences + null
    assert "64 KV blocks of 4 tokens" in describe_capacity(plan, cfg)

    caches = allocate_caches(specs, plan, cfg)
    assert caches[0]["latent"].shape == (plan.num_blocks, 4, LATENT_DIM)
    assert caches[0]["latent"].dtype == torch.float16
    assert caches[1]["scratch"].shape == (plan.num_slots, 3, 5)
    assert caches[1]["scratch"].dtype == torch.float32
    assert caches[1]["counter"].dtype == torch.int16
    for spec, cache in zip(specs, caches, strict=True):
        nbytes = sum(t.numel() * t.element_size() for t in cache.values())
        units = plan.units[spec.pool]
        assert nbytes == units * spec.unit_bytes(4, torch.float16, torch.float32)

    sched = build_scheduler(cfg, plan, specs)
    assert [p.kind for p in sched.pools] == ["paged", "slots"]
    assert sched.prefix_cache is None  # the slots pool cannot serve prefix hits
    a, b = seq(10), seq(5)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [(q, n) for q, n in batch.items] == [(a, 10), (b, 5)]
    assert (
        len(a.block_ids) == 3
        and len(b.block_ids) == 2
        and {a.state_slot, b.state_slot}
        == {
            1,
            2,
        }
    )
    sched.advance(batch)
    sched.finish(a)
    sched.finish(b)
    assert sched.usage() == {"paged": (0, 64), "slots": (0, 4)}


def test_prefix_caching_refused_names_the_layers(monkeypatch):
    monkeypatch.setenv("DELTASERVE_CACHE_MEMORY_GB", "0.001")
    specs = [LatentSpec(), ScratchSpec()]
    cfg = config(prefix=True)
    # a "slots" pool is served by state snapshots (extra rows of its tensors) ...
    sched = build_scheduler(cfg, plan_caches(specs, cfg), specs)
    assert [p.kind for p in sched.pools] == ["paged", "slots", "snapshots"]
    assert sched.prefix_cache is not None
    # ... and refused, naming its layers, when no snapshot fits
    no_room = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, prefix_state_memory=0))
    with pytest.raises(ValueError, match="ToyArch has ScratchSpec layers"):
        build_scheduler(no_room, plan_caches(specs, no_room), specs)
    only_paged = [LatentSpec(), AttentionSpec(2, 1, 8)]
    sched = build_scheduler(cfg, plan_caches(only_paged, cfg), only_paged)
    assert sched.prefix_cache is sched.block_manager.prefix_cache is not None


class TicketPool(PoolManager):
    """A toy pool kind: one ticket per sequence, kept in a dict (nothing on the Sequence)."""

    kind = "tickets"

    def __init__(self, units: int) -> None:
        self.units = units
        self.owner: dict[int, int] = {}  # seq_id -> ticket

    def can_allocate(self, seq, num_new_tokens, hit=None):
        return seq.seq_id in self.owner or len(self.owner) < self.capacity

    def allocate_for(self, seq, num_new_tokens, hit=None):
        if seq.seq_id not in self.owner:
            used = set(self.owner.values())
            self.owner[seq.seq_id] = next(t for t in range(1, self.units) if t not in used)

    def release(self, seq):
        self.owner.pop(seq.seq_id, None)

    @property
    def capacity(self):
        return self.units - 1

    @property
    def num_free(self):
        return self.capacity - len(self.owner)

    @property
    def max_sequences(self):
        return self.capacity


@dataclass(frozen=True)
class TicketSpec(CacheSpec):
    pool: ClassVar[str] = "tickets"
    layer_kind: ClassVar[str] = "ticket"

    def tensors(self, num_units, block_size, dtype, state_dtype):
        return {"ticket_state": ((num_units, 7), torch.float32)}


def test_a_new_pool_kind_is_one_registration(monkeypatch):
    monkeypatch.setenv("DELTASERVE_CACHE_MEMORY_GB", "0.001")
    kind = PoolKind(
        name="tickets",
        size=lambda unit_bytes, budget, cfg: 3,  # two tickets and a null one
        describe=lambda units, unit_bytes, cfg: f"{units - 1} tickets",
        build=lambda units, cfg, prefix: TicketPool(units),
        manager=TicketPool,
        sizing_order=2,
    )
    monkeypatch.setitem(pool_registry.POOL_KINDS, "tickets", kind)
    specs = [LatentSpec(), TicketSpec()]
    cfg = config()
    plan = plan_caches(specs, cfg)
    assert plan.units["tickets"] == 3 and plan.unit_bytes["tickets"] == 7 * 4
    assert describe_capacity(plan, cfg).endswith("; 2 tickets")
    assert allocate_caches(specs, plan, cfg)[1]["ticket_state"].shape == (3, 7)
    sched = build_scheduler(cfg, plan, specs)
    assert sched.max_running == 2 and sched.prefix_cache is None
    qs = [seq(3) for _ in range(3)]
    for q in qs:
        sched.add(q)
    batch = sched.schedule()
    assert [q for q, _ in batch.items] == qs[:2]  # the third waits for a ticket
    tickets = sched.pool("tickets")
    assert sorted(tickets.owner.values()) == [1, 2]
    sched.advance(batch)
    sched.finish(qs[0])
    assert [q for q, _ in sched.schedule().items] == [qs[1], qs[2]]


def test_unknown_pool_kind_fails_by_name(monkeypatch):
    monkeypatch.setenv("DELTASERVE_CACHE_MEMORY_GB", "0.001")
    with pytest.raises(ValueError, match="no cache pool kind 'tickets'"):
        plan_caches([TicketSpec()], config())
