"""Kernel backends: one registry of op families, capability checks with reasons, the selector.

`OP_FAMILIES` declares each op family once: its name, the layer kind it serves
(`CacheSpec.layer_kind`, or None for every model), a one-line description, whether it runs inside
the captured decode graph, and its backends in priority order. Everything else is generated from
it: the `--<family>-backend` flags of every command (deltaserve.cli), the `<family>_backend=`
keywords of `LLM(...)` / `create_engine_config(...)`, the validation of the user's choices
(deltaserve.config) and `deltaserve backends`. Adding an op family is one `OpFamily(...)`
entry here.

Each backend declares what it can serve through a `check` that returns None (able) or a one-line
reason (unable). For each op family the selector walks the priority list, records the reason for
every backend it passes over and ends at the torch reference, which accepts everything. A backend
forced by the user that cannot serve the model fails start-up with its reason. Selection returns
a decision and changes no global state; backends are imported lazily, only when chosen.

NOTE: this module imports no torch at import time (`deltaserve --help` builds its flags from the
registry and must stay light): torch is imported inside the functions that need it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from deltaserve.backend_checks import (
    _dtype_name,
    check_fla_prefill,
    check_flashinfer_attention,
    check_flashinfer_gdn,
    check_flashinfer_mla,
    check_grouped_mm_moe,
    check_split_mla,
    check_triton_attention,
    check_triton_conv1d,
    check_triton_decode_gemm,
    check_triton_fused,
    check_triton_gdn,
    check_triton_gdn_prefill,
    check_triton_mla,
    check_triton_moe,
    defer_triton_mla,
    flashinfer_notes,
    split_mla_notes,
    triton_mla_notes,
)
from deltaserve.capabilities import Capabilities

AUTO = "auto"


@dataclass(frozen=True)
class BackendSpec:
    """One backend of one op family. `target` is "module:Class", imported only when chosen."""

    name: str
    op: str
    target: str
    check: Callable[[Capabilities], str | None] = lambda caps: None
    # remarks on how the chosen backend will serve (e.g. a kernel variant picked per shape)
    notes: Callable[[Capabilities], list[str]] = lambda caps: []
    # auto selection only: a reason to let a later able backend serve (a measured preference,
    # not an inability: a user who forces this backend still gets it), None to serve
    defer: Callable[[Capabilities], str | None] = lambda caps: None

    def load(self) -> Any:
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(module), cls)()


@dataclass(frozen=True)
class OpFamily:
    """One op family, selected on its own: the `--{name}-backend` flag (underscores as dashes)
    and the `{name}_backend=` keyword are generated from it."""

    name: str
    layer_kind: str | None  # the CacheSpec.layer_kind it serves; None: every model uses it
    description: str  # one line, shown in the flag's help
    backends: tuple[BackendSpec, ...]  # priority order, fastest first; the last accepts all
    # NOTE: False only for families that never run in an all-decode step (prefill kernels):
    # graph_blocker ignores them
    in_decode_graph: bool = True

    def __post_init__(self) -> None:
        names = [b.name for b in self.backends]
        if not names:
            raise ValueError(f"op family {self.name!r} has no backend")
        if len(set(names)) != len(names) or AUTO in names:
            raise ValueError(f"op family {self.name!r}: backend names {names} must be unique")
        wrong = [b.name for b in self.backends if b.op != self.name]
        if wrong:
            raise ValueError(f"op family {self.name!r}: backends {wrong} declare another op")

    @property
    def backend_names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.backends)

    @property
    def flag(self) -> str:
        """The command-line flag, e.g. `--gdn-decode-backend`."""
        return f"--{self.name.replace('_', '-')}-backend"

    @property
    def keyword(self) -> str:
        """The `LLM(...)` / `create_engine_config(...)` keyword, e.g. `gdn_decode_backend`."""
        return f"{self.name}_backend"


@dataclass(frozen=True)
class BackendDecision:
    op: str
    chosen: BackendSpec
    passed_over: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # (name, reason)

    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        skipped = "; ".join(f"{n}: {r}" for n, r in self.passed_over)
        text = f"{self.op}: {self.chosen.name}" + (f" (passed over {skipped})" if skipped else "")
        return text + "".join(f"; {n}" for n in self.notes)


class BackendUnavailable(ValueError):
    """A backend forced by the user cannot serve this model on this device."""


def _families(*families: OpFamily) -> dict[str, OpFamily]:
    return {f.name: f for f in families}


OP_FAMILIES: dict[str, OpFamily] = _families(
    OpFamily(
        "attention",
        "attention",
        "paged attention over the KV cache (prefill and decode)",
        (
            BackendSpec(
                "flashinfer",
                "attention",
                "deltaserve.ops.attention.flashinfer_backend:FlashInferAttentionBackend",
                check_flashinfer_attention,
                flashinfer_notes,
            ),
            BackendSpec(
                "triton",
                "attention",
                "deltaserve.ops.attention.triton_backend:TritonAttentionBackend",
                check_triton_attention,
            ),
            BackendSpec(
                "torch", "attention", "deltaserve.ops.attention.reference:TorchAttentionBackend"
            ),
        ),
    ),
    OpFamily(
        "gdn_prefill",
        "gdn",
        "GDN chunked delta rule of prefill chunks",
        # NOTE: fla sends rows of at most SHORT_ROW_MAX_TOKENS (ops/gdn/row_split.py) to the
        # triton kernels itself; triton alone takes every row, slower than fla for long ones
        (
            BackendSpec(
                "fla",
                "gdn_prefill",
                "deltaserve.ops.gdn.fla_prefill:FlaGDNPrefill",
                check_fla_prefill,
            ),
            BackendSpec(
                "triton",
                "gdn_prefill",
                "deltaserve.ops.gdn.row_split:TritonRowsGDNPrefill",
                check_triton_gdn_prefill,
            ),
            BackendSpec("torch", "gdn_prefill", "deltaserve.ops.gdn.reference:TorchGDNPrefill"),
        ),
        in_decode_graph=False,  # prefills run eagerly
    ),
    OpFamily(
        "gdn_decode",
        "gdn",
        "GDN one-token recurrent step on the state pool",
        # NOTE: the order is the measured one, on the H200 (one layer, HV 32, K = V = 128,
        # float32 pool, CUDA graphs; docs/benchmarks.md): triton 3.6 / 38 / 139 / 542 us and
        # flashinfer 6.8 / 40 / 140 / 536 us at batch 1 / 32 / 128 / 512: ours is 1.9x faster
        # at batch 1 and within 1% elsewhere, so triton comes first.
        (
            BackendSpec(
                "triton",
                "gdn_decode",
                "deltaserve.ops.gdn.triton_decode:TritonGDNDecode",
                check_triton_gdn,
            ),
            BackendSpec(
                "flashinfer",
                "gdn_decode",
                "deltaserve.ops.gdn.flashinfer_decode:FlashInferGDNDecode",
                check_flashinfer_gdn,
            ),
            BackendSpec("torch", "gdn_decode", "deltaserve.ops.gdn.reference:TorchGDNDecode"),
        ),
    ),
    OpFamily(
        "gdn_replay",
        "gdn",
        "GDN state replay of accepted tokens after a speculative verify step (rollback)",
        (
            BackendSpec(
                "triton",
                "gdn_replay",
                "deltaserve.ops.gdn.triton_replay:TritonGDNReplay",
                check_triton_gdn,
            ),
            BackendSpec("torch", "gdn_replay", "deltaserve.ops.gdn.replay:TorchGDNReplay"),
        ),
        in_decode_graph=False,  # runs after the verify step, eagerly
    ),
    OpFamily(
        "conv1d",
        "gdn",
        "GDN causal conv1d over the conv-state pool",
        (
            BackendSpec(
                "triton",
                "conv1d",
                "deltaserve.ops.gdn.triton_conv1d:TritonConv1d",
                check_triton_conv1d,
            ),
            BackendSpec("torch", "conv1d", "deltaserve.ops.gdn.reference:TorchConv1d"),
        ),
    ),
    OpFamily(
        "fused",
        None,
        "elementwise ops of every layer (residual add + RMSNorm, gates, q/k norm + rope)",
        (
            BackendSpec(
                "triton",
                "fused",
                "deltaserve.ops.fused.triton_ops:TritonFusedOps",
                check_triton_fused,
            ),
            BackendSpec("torch", "fused", "deltaserve.ops.fused:TorchFusedOps"),
        ),
    ),
    OpFamily(
        "decode_gemm",
        None,
        "projections of decode steps of up to 16 rows (weight streaming)",
        (
            BackendSpec(
                "triton",
                "decode_gemm",
                "deltaserve.ops.linear.triton_gemm:TritonDecodeGemm",
                check_triton_decode_gemm,
            ),
            BackendSpec("torch", "decode_gemm", "deltaserve.ops.linear:TorchDecodeGemm"),
        ),
    ),
    OpFamily(
        "moe",
        "moe",  # only models whose layers declare a MoESpec (deltaserve.ops.moe)
        "routed experts of MoE feed-forward layers (routing + expert GEMMs)",
        # NOTE: triton before grouped_mm is a guess until `bench kernels --only moe` decides
        (
            BackendSpec(
                "triton", "moe", "deltaserve.ops.moe.triton_backend:TritonMoE", check_triton_moe
            ),
            BackendSpec(
                "grouped_mm",
                "moe",
                "deltaserve.ops.moe.grouped_mm:GroupedMmMoE",
                check_grouped_mm_moe,
            ),
            BackendSpec("torch", "moe", "deltaserve.ops.moe.reference:TorchMoE"),
        ),
    ),
    OpFamily(
        "mla",
        "mla",  # only models whose layers declare an MLASpec (deltaserve.ops.mla)
        "multi-head latent attention over the paged latent cache (prefill and decode)",
        # NOTE: split first (FlashInfer's MLA for steps with prefill rows, our Triton decode
        # for all-decode steps) wherever both serve at <= 32 heads per rank: V2-Lite on an H200
        # measured FlashInfer's prefill (8192 tokens: 51,351 against triton's 19,946 tok/s)
        # and triton's decode (batch 1: 405.8 against flashinfer's 333.5 tok/s) with it. With
        # triton's prefill rows expanded from 4096-token queries, one call (docs/benchmarks.md
        # "MLA prefill") gave split 1.12-1.13x triton at 2048 / 4096 tokens, 0.78x at 8192 and
        # level decode; split expands too, from 6144 (ops/mla/split_backend.py). Then triton,
        # which auto selection passes over for flashinfer where that can serve
        # (defer_triton_mla: above 32 heads FlashInfer's decode is 3x faster at batch 16-64)
        (
            BackendSpec(
                "split",
                "mla",
                "deltaserve.ops.mla.split_backend:SplitMLABackend",
                check_split_mla,
                split_mla_notes,
            ),
            BackendSpec(
                "triton",
                "mla",
                "deltaserve.ops.mla.triton_backend:TritonMLABackend",
                check_triton_mla,
                triton_mla_notes,
                defer=defer_triton_mla,
            ),
            BackendSpec(
                "flashinfer",
                "mla",
                "deltaserve.ops.mla.flashinfer_backend:FlashInferMLABackend",
                check_flashinfer_mla,
            ),
            BackendSpec("torch", "mla", "deltaserve.ops.mla.reference:TorchMLABackend"),
        ),
    ),
)


def __getattr__(name: str) -> Any:
    # Views derived from OP_FAMILIES on every access (never a stale copy): OPS, the op family
    # names in order; OP_LAYERS, op family -> layer kind; REGISTRY, op family -> backends.
    if name == "OPS":
        return tuple(OP_FAMILIES)
    if name == "OP_LAYERS":
        return {n: f.layer_kind for n, f in OP_FAMILIES.items()}
    if name == "REGISTRY":
        return {n: list(f.backends) for n, f in OP_FAMILIES.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- selection ---------------------------------------------------------------------------------


def select(
    op: str,
    caps: Capabilities,
    forced: str = AUTO,
    registry: Mapping[str, list[BackendSpec]] | None = None,
) -> BackendDecision:
    """Choose the backend for `op`: the user's if forced (or fail with its reason), else the
    first able one in priority order, with a reason for each passed over."""
    if registry is not None:
        candidates = registry.get(op)
    else:
        candidates = OP_FAMILIES[op].backends if op in OP_FAMILIES else None
    if not candidates:
        raise ValueError(f"unknown op family {op!r}; known: {', '.join(OP_FAMILIES)}")
    names = [b.name for b in candidates]
    if forced != AUTO:
        spec = next((b for b in candidates if b.name == forced), None)
        if spec is None:
            raise BackendUnavailable(
                f"{op} backend {forced!r} does not exist; choose from auto, " + ", ".join(names)
            )
        reason = spec.check(caps)
        if reason is not None:
            raise BackendUnavailable(f"{op} backend {forced!r} cannot serve this model: {reason}")
        others = tuple((b.name, "not requested") for b in candidates if b is not spec)
        return BackendDecision(op, spec, others, tuple(spec.notes(caps)))
    passed: list[tuple[str, str]] = []
    for spec in candidates:
        reason = spec.check(caps) or spec.defer(caps)
        if reason is None:
            return BackendDecision(op, spec, tuple(passed), tuple(spec.notes(caps)))
        passed.append((spec.name, reason))
    raise BackendUnavailable(
        f"no {op} backend can serve this model: " + "; ".join(f"{n}: {r}" for n, r in passed)
    )


def select_all(
    caps: Capabilities, forced: Mapping[str, str] | None = None
) -> dict[str, BackendDecision]:
    """A decision for every op family the model uses (those serving one of its layer kinds, and
    those serving every model), in registry order."""
    forced = forced or {}
    unknown = sorted(set(forced) - set(OP_FAMILIES))
    if unknown:
        raise ValueError(f"unknown op families {unknown}; known: {', '.join(OP_FAMILIES)}")
    used = [f for f in OP_FAMILIES.values() if f.layer_kind is None or caps.specs(f.layer_kind)]
    return {f.name: select(f.name, caps, forced.get(f.name, AUTO)) for f in used}


def load_backends(decisions: Mapping[str, BackendDecision]) -> dict[str, Any]:
    """Op family -> the chosen backend object (each imported and built here, once)."""
    return {op: decision.chosen.load() for op, decision in decisions.items()}


def graph_blocker(backends: Mapping[str, Any]) -> str | None:
    """Why an all-decode step cannot be captured in a CUDA graph with these backends (op family
    -> loaded backend object), or None when it can. Families that never run in a decode step
    (`in_decode_graph=False`, e.g. gdn_prefill) are ignored; an unknown family counts as one
    that does; a backend without a `supports_cuda_graph` attribute counts as unable."""
    for op, backend in backends.items():
        family = OP_FAMILIES.get(op)
        if backend is None or (family is not None and not family.in_decode_graph):
            continue
        if not getattr(backend, "supports_cuda_graph", False):
            name = getattr(backend, "name", type(backend).__name__)
            return f"{op} backend {name} cannot be captured in a CUDA graph"
    return None


def format_backend_table(
    model: str,
    device: str = "auto",
    dtype: str = "auto",
    forced: Mapping[str, str] | None = None,
    state_dtype: str = "float32",
    compute_capability: tuple[int, int] | None = None,
) -> str:
    """The backend table `deltaserve backends --model DIR` prints, without loading weights.
    A forced backend that cannot serve the model raises BackendUnavailable with its reason.
    With `compute_capability` (e.g. (9, 0)), the table is for a pretend CUDA device of that
    capability, labelled as such, and CUDA is not touched (a preview on a machine without a
    GPU; packages are those installed here)."""
    import torch

    from deltaserve.config import resolve_device, resolve_dtype
    from deltaserve.loader.hf_config import load_hf_config
    from deltaserve.models.registry import get_model_class

    hf_config, text_config, arch = load_hf_config(model)
    dev = torch.device("cuda") if compute_capability else resolve_device(device)
    run_dtype = resolve_dtype(dtype, getattr(text_config, "dtype", None), dev)
    with torch.device("meta"):
        specs = get_model_class(arch)(text_config).capability_specs()
    state = torch.bfloat16 if state_dtype in ("bfloat16", "bf16") else torch.float32
    caps = Capabilities.from_specs(specs, dev, run_dtype, state, 16, compute_capability)
    width = max(12, *(len(op) + 1 for op in OP_FAMILIES))
    shown = str(dev)
    if compute_capability:
        major, minor = compute_capability
        shown += f" (pretend device, compute capability {major}.{minor})"
    lines = [f"model: {arch}, device: {shown}, dtype: {_dtype_name(run_dtype)}"]
    lines.append(f"{'op':<{width}} {'backend':<11} passed over / notes")
    for op, decision in select_all(caps, forced).items():
        skipped = "; ".join(f"{n}: {r}" for n, r in decision.passed_over) or "-"
        notes = "".join(f"; {n}" for n in decision.notes)
        lines.append(f"{op:<{width}} {decision.chosen.name:<11} {skipped}{notes}")
    return "\n".join(lines)
