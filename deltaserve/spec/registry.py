"""Proposer methods by name: the class (imported only when chosen) and the option keys each
accepts in `speculative_config` besides method / num_speculative_tokens / model.

A new method is one `register_proposer` call (tests and benchmarks register stub proposers
this way). NOTE: no torch import here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProposerMethod:
    """One proposer method. `target`: "module:Class" (a `Proposer` subclass built as
    `Class(spec_config, engine_config)`), or the class itself."""

    name: str
    target: Any
    keys: tuple[str, ...] = ()  # option keys of speculative_config this method accepts
    needs_model: bool = False  # a drafter checkpoint (speculative_config["model"])

    def load(self) -> type:
        if isinstance(self.target, str):
            module, cls = self.target.split(":")
            return getattr(importlib.import_module(module), cls)
        return self.target


PROPOSER_METHODS: dict[str, ProposerMethod] = {}


def register_proposer(method: ProposerMethod) -> ProposerMethod:
    """Add (or replace) a proposer method."""
    PROPOSER_METHODS[method.name] = method
    return method


register_proposer(
    ProposerMethod(
        "ngram",
        "deltaserve.spec.ngram:NgramProposer",
        keys=("prompt_lookup_min", "prompt_lookup_max"),
    )
)
register_proposer(
    ProposerMethod(
        "dflash",
        "deltaserve.spec.dflash:DFlashProposer",
        keys=("draft_seed",),
        needs_model=True,
    )
)
register_proposer(ProposerMethod("mtp", "deltaserve.spec.mtp:MTPProposer"))
