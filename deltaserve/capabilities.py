"""What a run needs from a kernel: device, dtypes and the model's layer specs by layer kind.

Every backend's capability check (deltaserve.backends) reads one `Capabilities`. Specs are grouped
by their `layer_kind` (deltaserve.cache.spec), so a new kind of layer (e.g. "mla") reaches the
checks as `caps.specs("mla")` without an edit here.

NOTE: no torch import at import time (deltaserve.backends, and through it `deltaserve --help`,
import this module).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from deltaserve.cache.spec import CacheSpec


@dataclass(frozen=True, init=False)
class Capabilities:
    """What the run needs from a kernel: device, dtypes and the model's layer shapes, grouped by
    layer kind (`CacheSpec.layer_kind`). `caps.attention` / `caps.gdn` / `caps.specs(kind)` give
    the distinct specs of one kind (empty when the model has none)."""

    device: torch.device
    dtype: torch.dtype
    state_dtype: torch.dtype
    block_size: int
    # (layer kind, its distinct specs in layer order), sorted by kind; a tuple keeps it hashable
    layers: tuple[tuple[str, tuple[CacheSpec, ...]], ...]
    # a pretend device's compute capability (`deltaserve backends --compute-capability 9.0`):
    # the checks read it instead of asking CUDA
    pretend_compute_capability: tuple[int, int] | None = None

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        state_dtype: torch.dtype,
        block_size: int,
        attention: Iterable[CacheSpec] = (),
        gdn: Iterable[CacheSpec] = (),
        *,
        pretend_compute_capability: tuple[int, int] | None = None,
        **other_kinds: Iterable[CacheSpec],
    ) -> None:
        kinds = {"attention": attention, "gdn": gdn, **other_kinds}
        layers = tuple((kind, tuple(dict.fromkeys(specs))) for kind, specs in sorted(kinds.items()))
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "state_dtype", state_dtype)
        object.__setattr__(self, "block_size", block_size)
        object.__setattr__(self, "layers", tuple((k, s) for k, s in layers if s))
        object.__setattr__(self, "pretend_compute_capability", pretend_compute_capability)

    def specs(self, layer_kind: str) -> tuple[CacheSpec, ...]:
        """The distinct specs of `layer_kind` (empty when the model has no such layer)."""
        return next((specs for kind, specs in self.layers if kind == layer_kind), ())

    @property
    def attention(self) -> tuple[CacheSpec, ...]:
        return self.specs("attention")

    @property
    def gdn(self) -> tuple[CacheSpec, ...]:
        return self.specs("gdn")

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        if self.device.type != "cuda":
            return None
        if self.pretend_compute_capability is not None:
            return self.pretend_compute_capability
        import torch

        return torch.cuda.get_device_capability(self.device)

    @classmethod
    def from_specs(
        cls,
        specs: Iterable[CacheSpec],
        device: torch.device,
        dtype: torch.dtype,
        state_dtype: torch.dtype,
        block_size: int,
        pretend_compute_capability: tuple[int, int] | None = None,
    ) -> Capabilities:
        """Group `specs` by their `layer_kind`: a new kind needs no edit here."""
        groups: dict[str, list[CacheSpec]] = {}
        for spec in specs:
            groups.setdefault(spec.layer_kind, []).append(spec)
        return cls(
            device,
            dtype,
            state_dtype,
            block_size,
            pretend_compute_capability=pretend_compute_capability,
            **groups,
        )
