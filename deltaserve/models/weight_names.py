"""Checkpoint tensor names -> model parameters (and back, to name what is missing).

A model declares its mapping with class attributes of `CausalLM`, applied in this order to every
checkpoint name:

1. `skip_prefixes`: names under these prefixes are recognised and skipped;
2. `prefix_map`: (checkpoint prefix, model prefix) pairs, the first match rewritten;
3. `weight_rules`: `WeightRule`s, the first that matches decides (e.g. per-expert tensors
   `mlp.experts.{e}.gate_proj.weight` -> shard "gate_proj" of expert e of a stacked parameter);
4. `packed_modules`: checkpoint sub-module -> (fused sub-module, shard name), for projections
   fused into one column-parallel linear (q/k/v, gate/up);
5. otherwise the name is the parameter's name.

`WeightNameMap.checkpoint_name` inverts 2-4, so a missing slot is reported by the checkpoint
name it should have had.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from deltaserve.layers.weight_loading import WeightName


@dataclass(frozen=True)
class WeightRule:
    """Rewrite a name ending in `checkpoint` (after a '.') to one ending in `param`, filling
    `shard`; `{e}` in `checkpoint` matches an expert index, which the slot then carries.

    `WeightRule("experts.{e}.gate_proj.weight", "experts.w13", "gate_proj")` maps
    `model.layers.3.mlp.experts.7.gate_proj.weight` to shard "gate_proj" of expert 7 of
    parameter `model.layers.3.mlp.experts.w13`.
    """

    checkpoint: str
    param: str
    shard: str | None = None
    _pattern: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        body = re.escape(self.checkpoint).replace(re.escape("{e}"), r"(?P<e>\d+)")
        object.__setattr__(self, "_pattern", re.compile(rf"^(?P<prefix>(?:.*\.)?){body}$"))

    @property
    def has_expert(self) -> bool:
        return "{e}" in self.checkpoint

    def map(self, name: str) -> WeightName | None:
        """The slot `name` fills, or None when this rule does not apply to it."""
        m = self._pattern.match(name)
        if m is None:
            return None
        expert = int(m.group("e")) if self.has_expert else None
        return WeightName(m.group("prefix") + self.param, self.shard, expert)

    def unmap(self, target: WeightName) -> str | None:
        """The checkpoint name of slot `target`, or None when this rule does not make it."""
        if target.shard != self.shard or (target.expert is not None) != self.has_expert:
            return None
        param = target.param
        if param != self.param and not param.endswith("." + self.param):
            return None
        prefix = param[: len(param) - len(self.param)]
        return prefix + self.checkpoint.replace("{e}", str(target.expert))


class WeightNameMap:
    """A model's checkpoint-name mapping (see the module docstring for the order)."""

    def __init__(
        self,
        skip_prefixes: tuple[str, ...] = (),
        prefix_map: tuple[tuple[str, str], ...] = (),
        packed_modules: dict[str, tuple[str, str]] | None = None,
        rules: tuple[WeightRule, ...] = (),
    ) -> None:
        self.skip_prefixes = skip_prefixes
        self.prefix_map = prefix_map
        self.packed_modules = packed_modules or {}
        self.rules = rules

    def skipped_prefix(self, name: str) -> str | None:
        """The skip prefix `name` falls under, or None."""
        return next((p for p in self.skip_prefixes if name.startswith(p)), None)

    def map(self, name: str) -> WeightName | None:
        """checkpoint name -> the slot it fills; None when the name is skipped."""
        if self.skipped_prefix(name) is not None:
            return None
        for src, dst in self.prefix_map:
            if name.startswith(src):
                name = dst + name[len(src) :]
                break
        for rule in self.rules:
            target = rule.map(name)
            if target is not None:
                return target
        parts = name.split(".")
        for i, part in enumerate(parts):
            packed = self.packed_modules.get(part)
            if packed is not None:
                parts[i] = packed[0]
                return WeightName(".".join(parts), packed[1])
        return WeightName(name)

    def checkpoint_name(self, target: WeightName) -> str:
        """The inverse of `map`: the checkpoint name expected for a slot."""
        name = next((n for n in (r.unmap(target) for r in self.rules) if n is not None), None)
        if name is None:
            name = target.param
            packed = self.packed_modules.get(target.shard) if target.shard is not None else None
            if packed is not None:
                name = ".".join(target.shard if p == packed[0] else p for p in name.split("."))
        for src, dst in self.prefix_map:
            if name.startswith(dst):
                return src + name[len(dst) :]
        return name


# The routed experts of a MoE block (a `MoEExperts` under `mlp.experts`: w13 [E, 2I, H], gate
# rows first, and w2 [E, H, I]), from per-expert tensors (released Qwen3-Next and DeepSeek
# checkpoints, HF save_pretrained) or fused ones (released Qwen3.5-MoE checkpoints).
EXPERT_WEIGHT_RULES: tuple[WeightRule, ...] = (
    WeightRule("mlp.experts.{e}.gate_proj.weight", "mlp.experts.w13", "gate_proj"),
    WeightRule("mlp.experts.{e}.up_proj.weight", "mlp.experts.w13", "up_proj"),
    WeightRule("mlp.experts.{e}.down_proj.weight", "mlp.experts.w2"),
    WeightRule("mlp.experts.gate_up_proj", "mlp.experts.w13"),
    WeightRule("mlp.experts.down_proj", "mlp.experts.w2"),
)
