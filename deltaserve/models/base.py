"""What every model class declares: its layer kinds, cache shapes and weight-name mapping.

Model files describe math only (DESIGN.md invariant 1). The loader applies the mapping declared
here; the model runner allocates the caches described here.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.cache.spec import AttentionSpec, CacheSpec, GDNSpec, LayerSpec
from deltaserve.forward_context import ForwardContext

__all__ = ["AttentionSpec", "CacheSpec", "CausalLM", "GDNSpec", "LayerSpec"]


class CausalLM(nn.Module):
    """Base of every model. Subclasses set the mapping attributes and implement `forward`.

    Weight mapping, applied by the loader to every checkpoint tensor name:
    - `skip_prefixes`: tensors under these prefixes are recognised and skipped (one log line);
    - `prefix_map`: (checkpoint prefix, model prefix) pairs, first match rewritten;
    - `packed_modules`: checkpoint sub-module -> (fused sub-module, shard name), for projections
      fused into one `MergedLinear`.
    """

    skip_prefixes: tuple[str, ...] = ()
    prefix_map: tuple[tuple[str, str], ...] = ()
    packed_modules: dict[str, tuple[str, str]] = {}

    def layer_specs(self) -> list[LayerSpec]:
        """One spec per decoder layer, in order."""
        raise NotImplementedError

    def tied_parameters(self) -> dict[str, str]:
        """Parameters that alias another (name -> source name): not expected in the checkpoint."""
        return {}

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32."""
        raise NotImplementedError
