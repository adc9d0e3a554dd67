"""How a checkpoint tensor lands in a module's parameters: each layer owns its weight loading.

The loader (deltaserve.loader.weights) maps a checkpoint name to a `WeightName`: a parameter,
plus the fused shard (a row slice of a fused projection) and the expert (an index into a
parameter stacked over experts) it fills. It then asks the parameter's module, through the three
functions below, which (shard, expert) slots the parameter expects, the full shape the
checkpoint tensor of a slot must have, and to copy one tensor in. A module customises any of
them by defining the method of the same name:

- `weight_slots(attr) -> list[(shard, expert)]`;
- `weight_shape(attr, shard, expert) -> tuple[int, ...]` (the checkpoint's full, unsharded
  shape);
- `load_weight(attr, tensor, shard, expert) -> None` (copy this rank's part in);
- `weight_covers(attr, shard, expert) -> list[(shard, expert)] | None`: for a checkpoint tensor
  whose slot is not one of `weight_slots`, the slots it fills at once (None: it is unexpected).
  By default a whole parameter stacked over experts (shard None, expert None: e.g. released
  fused experts `experts.gate_up_proj [E, 2I, H]`) covers every slot of that parameter.

The defaults cover plain parameters, fused shards (`shard_offsets`: shard -> (row offset, rows)
of every parameter of the module), tensor-parallel slicing (`tp_rules`: (attr, shard) ->
ShardRule, see deltaserve.distributed.sharding) and parameters stacked over experts
(`stacked_experts = E`: every parameter of the module is [E, ...] and each expert's tensor is a
separate checkpoint tensor, with the same shards and rules as one unstacked parameter).

After every tensor is in, `process_weights_after_loading(model)` calls the method of that name
on every module that defines it (children before their parents), for transforms that need the
whole weight: de-interleaving, absorption, re-layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deltaserve.distributed.parallel_state import tp_rank, tp_size
from deltaserve.distributed.sharding import ShardRule

Slot = tuple[str | None, int | None]  # (fused shard name or None, expert index or None)


@dataclass(frozen=True)
class WeightName:
    """Where one checkpoint tensor goes: a parameter (full dotted name), the fused shard it
    fills (None: the whole parameter) and the expert it belongs to (None: not stacked)."""

    param: str
    shard: str | None = None
    expert: int | None = None


def weight_slots(module: nn.Module, attr: str) -> list[Slot]:
    """The (shard, expert) slots of parameter `attr` the checkpoint must fill, in order."""
    custom = getattr(module, "weight_slots", None)
    if custom is not None:
        return custom(attr)
    shards = getattr(module, "shard_offsets", None) or [None]
    experts = getattr(module, "stacked_experts", None)
    if experts is None:
        return [(shard, None) for shard in shards]
    return [(shard, e) for e in range(experts) for shard in shards]


def weight_covers(
    module: nn.Module, attr: str, shard: str | None, expert: int | None
) -> list[Slot] | None:
    """The slots of `attr` that one checkpoint tensor for slot (shard, expert), itself not one
    of `weight_slots`, fills at once; None when no such tensor is expected."""
    custom = getattr(module, "weight_covers", None)
    if custom is not None:
        return custom(attr, shard, expert)
    if getattr(module, "stacked_experts", None) is None and not hasattr(module, "weight_slots"):
        return None
    if (shard, expert) != (None, None):
        return None
    return weight_slots(module, attr)


def _local_target(
    module: nn.Module, attr: str, shard: str | None, expert: int | None
) -> tuple[torch.Tensor, ShardRule | None]:
    """(this rank's part of the parameter that the slot fills, the rule that cuts the
    checkpoint tensor, or None when every rank holds all of it)."""
    target = getattr(module, attr).data
    if expert is not None:
        target = target[expert]  # [E, ...] -> this expert's [...]
    if shard is not None:
        offset, size = module.shard_offsets[shard]
        target = target.narrow(0, offset, size)
    rules = getattr(module, "tp_rules", None) or {}
    return target, rules.get((attr, shard))


def weight_shape(
    module: nn.Module, attr: str, shard: str | None = None, expert: int | None = None
) -> tuple[int, ...]:
    """The full shape the checkpoint tensor of a slot must have (every rank checks it)."""
    custom = getattr(module, "weight_shape", None)
    if custom is not None:
        return tuple(custom(attr, shard, expert))
    target, rule = _local_target(module, attr, shard, expert)
    shape = list(target.shape)
    if rule is not None:
        shape[rule.dim] = rule.global_size
    return tuple(shape)


def load_weight(
    module: nn.Module,
    attr: str,
    tensor: torch.Tensor,
    shard: str | None = None,
    expert: int | None = None,
) -> None:
    """Copy this rank's part of checkpoint `tensor` (already checked against `weight_shape`)
    into the slot of parameter `attr`."""
    custom = getattr(module, "load_weight", None)
    if custom is not None:
        custom(attr, tensor, shard, expert)
        return
    target, rule = _local_target(module, attr, shard, expert)
    if rule is not None:
        tensor = rule.slice(tensor, tp_rank(), tp_size())
        n = tensor.shape[rule.dim]
        if n < target.shape[rule.dim]:  # vocabulary padding of the last rank(s)
            target.narrow(rule.dim, n, target.shape[rule.dim] - n).zero_()
        target = target.narrow(rule.dim, 0, n)
    target.copy_(tensor)


@torch.no_grad()
def process_weights_after_loading(model: nn.Module) -> None:
    """Call `process_weights_after_loading()` on every module of `model` that defines it,
    children before their parents (so a parent sees its children's final weights)."""
    # NOTE: in `modules()` (pre-order) every module comes after its ancestors, so the reversed
    # order puts each module before its ancestors
    for module in reversed(list(model.modules())):
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None:
            hook()
