"""Kernel backends: capability declarations, reasons, priority lists, the selector.

Each backend declares what it can serve through a `check` that returns None (able) or a one-line
reason (unable). For each op family the selector walks the priority list, records the reason for
every backend it passes over and ends at the torch reference, which accepts everything. A backend
forced by the user that cannot serve the model fails start-up with its reason. Selection returns
a decision and changes no global state; backends are imported lazily, only when chosen.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deltaserve.models.base import AttentionSpec, GDNSpec, LayerSpec

OPS = ("attention", "gdn")


@dataclass(frozen=True)
class Capabilities:
    """What the run needs from a kernel: device, dtypes and the model's layer shapes."""

    device: torch.device
    dtype: torch.dtype
    state_dtype: torch.dtype
    block_size: int
    attention: tuple[AttentionSpec, ...] = ()
    gdn: tuple[GDNSpec, ...] = ()

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.get_device_capability(self.device)

    @classmethod
    def from_specs(
        cls,
        specs: list[LayerSpec],
        device: torch.device,
        dtype: torch.dtype,
        state_dtype: torch.dtype,
        block_size: int,
    ) -> Capabilities:
        attn = tuple(dict.fromkeys(s for s in specs if isinstance(s, AttentionSpec)))
        gdn = tuple(dict.fromkeys(s for s in specs if isinstance(s, GDNSpec)))
        return cls(device, dtype, state_dtype, block_size, attn, gdn)


@dataclass(frozen=True)
class BackendSpec:
    """One backend of one op family. `target` is "module:Class", imported only when chosen."""

    name: str
    op: str
    target: str
    check: Callable[[Capabilities], str | None] = lambda caps: None

    def load(self):
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(module), cls)()


@dataclass(frozen=True)
class BackendDecision:
    op: str
    chosen: BackendSpec
    passed_over: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # (name, reason)

    def describe(self) -> str:
        skipped = "; ".join(f"{n}: {r}" for n, r in self.passed_over)
        return f"{self.op}: {self.chosen.name}" + (f" (passed over {skipped})" if skipped else "")


class BackendUnavailable(ValueError):
    """A backend forced by the user cannot serve this model on this device."""


def package_installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# Priority lists, fastest first; the torch reference is last and accepts everything.
REGISTRY: dict[str, list[BackendSpec]] = {
    "attention": [
        BackendSpec(
            "torch", "attention", "deltaserve.ops.attention.reference:TorchAttentionBackend"
        ),
    ],
    "gdn": [
        BackendSpec("torch", "gdn", "deltaserve.ops.gdn.reference:TorchGDNBackend"),
    ],
}


def select(
    op: str,
    caps: Capabilities,
    forced: str = "auto",
    registry: dict[str, list[BackendSpec]] | None = None,
) -> BackendDecision:
    """Choose the backend for `op`: the user's if forced (or fail with its reason), else the
    first able one in priority order, with a reason for each passed over."""
    candidates = (registry or REGISTRY).get(op)
    if not candidates:
        raise ValueError(f"unknown op family {op!r}; known: {', '.join(OPS)}")
    names = [b.name for b in candidates]
    if forced != "auto":
        spec = next((b for b in candidates if b.name == forced), None)
        if spec is None:
            raise BackendUnavailable(
                f"{op} backend {forced!r} does not exist; choose from auto, " + ", ".join(names)
            )
        reason = spec.check(caps)
        if reason is not None:
            raise BackendUnavailable(f"{op} backend {forced!r} cannot serve this model: {reason}")
        others = tuple((b.name, "not requested") for b in candidates if b is not spec)
        return BackendDecision(op, spec, others)
    passed: list[tuple[str, str]] = []
    for spec in candidates:
        reason = spec.check(caps)
        if reason is None:
            return BackendDecision(op, spec, tuple(passed))
        passed.append((spec.name, reason))
    raise BackendUnavailable(
        f"no {op} backend can serve this model: " + "; ".join(f"{n}: {r}" for n, r in passed)
    )


def select_all(
    caps: Capabilities, forced: dict[str, str] | None = None
) -> dict[str, BackendDecision]:
    """A decision for every op family the model uses."""
    forced = forced or {}
    used = [op for op in OPS if getattr(caps, op)]
    return {op: select(op, caps, forced.get(op, "auto")) for op in used}


def format_backend_table(model: str, device: str = "auto", dtype: str = "auto") -> str:
    """The backend table `deltaserve backends --model DIR` prints, without loading weights."""
    from deltaserve.config import resolve_device, resolve_dtype
    from deltaserve.loader.hf_config import load_hf_config
    from deltaserve.models.registry import get_model_class

    hf_config, text_config, arch = load_hf_config(model)
    dev = resolve_device(device)
    run_dtype = resolve_dtype(dtype, getattr(text_config, "dtype", None), dev)
    with torch.device("meta"):
        specs = get_model_class(arch)(text_config).layer_specs()
    caps = Capabilities.from_specs(specs, dev, run_dtype, torch.float32, 16)
    lines = [f"model: {arch}, device: {dev}, dtype: {str(run_dtype).removeprefix('torch.')}"]
    lines.append(f"{'op':<10} {'backend':<12} passed over")
    for op, decision in select_all(caps).items():
        skipped = "; ".join(f"{n}: {r}" for n, r in decision.passed_over) or "-"
        lines.append(f"{op:<10} {decision.chosen.name:<12} {skipped}")
    return "\n".join(lines)
