"""What every model class declares: its layers' cache specs and its weight-name mapping.

Model files describe math only (docs/architecture.md, "Invariants"): config -> layers
(deltaserve.layers), the checkpoint-name mapping, and the forward over them. The loader applies
the mapping declared here; the model runner allocates the caches the layers' specs describe.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.cache.spec import AttentionSpec, CacheSpec, GDNSpec, LayerSpec
from deltaserve.forward_context import ForwardContext
from deltaserve.models.weight_names import WeightNameMap, WeightRule

__all__ = ["AttentionSpec", "CacheSpec", "CausalLM", "GDNSpec", "LayerSpec", "WeightRule"]


class CausalLM(nn.Module):
    """Base of every model. Subclasses set the mapping attributes, build `self.model` (a
    `deltaserve.layers.decoder.DecoderStack` or anything with `layers` whose items have a
    `mixer` with a `cache_spec`, and `vocab_size`) and implement `forward` and `compute_logits`.

    Weight mapping, applied by the loader to every checkpoint tensor name (in this order, see
    deltaserve.models.weight_names):
    - `skip_prefixes`: tensors under these prefixes are recognised and skipped (one log line);
    - `prefix_map`: (checkpoint prefix, model prefix) pairs, first match rewritten;
    - `weight_rules`: `WeightRule`s (first match decides), e.g. per-expert tensors onto a
      parameter stacked over experts;
    - `packed_modules`: checkpoint sub-module -> (fused sub-module, shard name), for projections
      fused into one column-parallel linear.
    How each tensor then lands in its parameter is the layer's business
    (deltaserve.layers.weight_loading).
    """

    skip_prefixes: tuple[str, ...] = ()
    prefix_map: tuple[tuple[str, str], ...] = ()
    weight_rules: tuple[WeightRule, ...] = ()
    packed_modules: dict[str, tuple[str, str]] = {}

    def weight_name_map(self) -> WeightNameMap:
        """The checkpoint-name mapping the loader applies (override for a custom one)."""
        return WeightNameMap(
            self.skip_prefixes, self.prefix_map, self.packed_modules, self.weight_rules
        )

    def layer_specs(self) -> list[LayerSpec]:
        """One cache spec per decoder layer, in order (this rank's heads), from its mixer."""
        return [layer.mixer.cache_spec for layer in self.model.layers]

    def capability_specs(self) -> list:
        """What backend selection reads (grouped by `layer_kind`): the cache specs, plus the
        op specs of feed-forward blocks that declare one (`ffn.op_spec`, e.g. a MoESpec)."""
        ffn = [getattr(layer, "mlp", None) for layer in self.model.layers]
        return [*self.layer_specs(), *(f.op_spec for f in ffn if hasattr(f, "op_spec"))]

    @property
    def vocab_size(self) -> int:
        """The global vocabulary (logits have this many columns on every rank)."""
        return self.model.vocab_size

    def tied_parameters(self) -> dict[str, str]:
        """Parameters that alias another (name -> source name): not expected in the checkpoint."""
        return {}

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]. Fills
        `ctx.hidden_states[i]` (the output of decoder layer i) for each i in
        `ctx.hidden_layers`."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32."""
        raise NotImplementedError
