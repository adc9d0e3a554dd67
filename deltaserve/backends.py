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

# Op families, each selected on its own. attention: paged prefill + decode; gdn_prefill: chunked
# delta rule; gdn_decode: one-token recurrent step on the state pool; conv1d: GDN causal conv;
# fused: the elementwise ops of every layer (norms with the residual add, gates, q/k norm + rope).
# decode_gemm: the projections of decode steps of up to 16 rows (weight streaming).
OPS = ("attention", "gdn_prefill", "gdn_decode", "conv1d", "fused", "decode_gemm")
# which layer specs each op family serves (a field of Capabilities; None: every model)
OP_LAYERS = {
    "attention": "attention",
    "gdn_prefill": "gdn",
    "gdn_decode": "gdn",
    "conv1d": "gdn",
    "fused": None,
    "decode_gemm": None,
}


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
    # remarks on how the chosen backend will serve (e.g. a kernel variant picked per shape)
    notes: Callable[[Capabilities], list[str]] = lambda caps: []

    def load(self):
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(module), cls)()


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


def package_installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# --- capability checks: None when able, else a one-line reason ---------------------------------

_HALF = (torch.bfloat16, torch.float16)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cuda_reason(caps: Capabilities, package: str, min_cc: tuple[int, int] = (8, 0)) -> str | None:
    if caps.device.type != "cuda":
        return "no CUDA device"
    if not package_installed(package):
        return f"{package} not installed"
    cc = caps.compute_capability
    if cc is not None and cc < min_cc:
        return f"compute capability {cc[0]}.{cc[1]} < {min_cc[0]}.{min_cc[1]}"
    return None


def _pow2(n: int, lo: int, hi: int) -> bool:
    return lo <= n <= hi and n & (n - 1) == 0


def check_triton_attention(caps: Capabilities) -> str | None:
    reason = _cuda_reason(caps, "triton")
    if reason:
        return reason
    for s in caps.attention:
        if not _pow2(s.head_dim, 16, 256):
            return f"head dim {s.head_dim} unsupported (a power of two in 16..256)"
        group = s.num_heads // s.num_kv_heads
        if group > 16:
            return f"GQA group {group} unsupported (at most 16)"
    return None


def check_flashinfer_attention(caps: Capabilities) -> str | None:
    reason = _cuda_reason(caps, "flashinfer")
    if reason:
        return reason
    if caps.dtype not in _HALF:
        return f"{_dtype_name(caps.dtype)} unsupported (bfloat16 / float16 only)"
    for s in caps.attention:
        if s.head_dim not in (64, 128, 256):
            return f"head dim {s.head_dim} unsupported (64, 128 or 256)"
    return None


# group sizes FlashInfer's CUDA-core decode kernel is compiled for (0.7.2: DISPATCH_GQA_GROUP_SIZE
# in include/flashinfer/utils.cuh)
FLASHINFER_CUDA_CORE_GROUPS = (1, 2, 3, 4, 6, 8, 16)


def flashinfer_notes(caps: Capabilities) -> list[str]:
    notes = []
    for s in caps.attention:
        group = s.num_heads // s.num_kv_heads
        if group not in FLASHINFER_CUDA_CORE_GROUPS:
            notes.append(
                f"flashinfer decode (CUDA cores): GQA group {group} unsupported, "
                "using tensor-core path"
            )
    return notes


def check_fla_prefill(caps: Capabilities) -> str | None:
    reason = _cuda_reason(caps, "fla")
    if reason:
        return reason
    for s in caps.gdn:
        if s.head_k_dim > 256 or s.head_v_dim > 256:
            return f"head dims K={s.head_k_dim}, V={s.head_v_dim} unsupported (at most 256)"
    return None


def check_triton_gdn(caps: Capabilities) -> str | None:
    reason = _cuda_reason(caps, "triton")
    if reason:
        return reason
    for s in caps.gdn:
        if not (_pow2(s.head_k_dim, 16, 256) and _pow2(s.head_v_dim, 16, 256)):
            return (
                f"head dims K={s.head_k_dim}, V={s.head_v_dim} unsupported "
                "(powers of two in 16..256)"
            )
    return None


def check_triton_conv1d(caps: Capabilities) -> str | None:
    return _cuda_reason(caps, "triton")


check_triton_fused = check_triton_conv1d  # elementwise kernels: any shape, any float dtype


def check_triton_decode_gemm(caps: Capabilities) -> str | None:
    reason = _cuda_reason(caps, "triton")
    if reason:
        return reason
    if caps.dtype not in (torch.bfloat16, torch.float16):
        # NOTE: a float32 tl.dot would round through TF32, unlike the reference
        return f"{str(caps.dtype).removeprefix('torch.')} unsupported (bfloat16 / float16 only)"
    return None


# Priority lists, fastest first; the torch reference is last and accepts everything.
REGISTRY: dict[str, list[BackendSpec]] = {
    "attention": [
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
    ],
    "gdn_prefill": [
        BackendSpec(
            "fla", "gdn_prefill", "deltaserve.ops.gdn.fla_prefill:FlaGDNPrefill", check_fla_prefill
        ),
        BackendSpec("torch", "gdn_prefill", "deltaserve.ops.gdn.reference:TorchGDNPrefill"),
    ],
    "gdn_decode": [
        BackendSpec(
            "triton",
            "gdn_decode",
            "deltaserve.ops.gdn.triton_decode:TritonGDNDecode",
            check_triton_gdn,
        ),
        BackendSpec("torch", "gdn_decode", "deltaserve.ops.gdn.reference:TorchGDNDecode"),
    ],
    "fused": [
        BackendSpec(
            "triton", "fused", "deltaserve.ops.fused.triton_ops:TritonFusedOps", check_triton_fused
        ),
        BackendSpec("torch", "fused", "deltaserve.ops.fused:TorchFusedOps"),
    ],
    "decode_gemm": [
        BackendSpec(
            "triton",
            "decode_gemm",
            "deltaserve.ops.linear.triton_gemm:TritonDecodeGemm",
            check_triton_decode_gemm,
        ),
        BackendSpec("torch", "decode_gemm", "deltaserve.ops.linear:TorchDecodeGemm"),
    ],
    "conv1d": [
        BackendSpec(
            "triton",
            "conv1d",
            "deltaserve.ops.gdn.triton_conv1d:TritonConv1d",
            check_triton_conv1d,
        ),
        BackendSpec("torch", "conv1d", "deltaserve.ops.gdn.reference:TorchConv1d"),
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
        return BackendDecision(op, spec, others, tuple(spec.notes(caps)))
    passed: list[tuple[str, str]] = []
    for spec in candidates:
        reason = spec.check(caps)
        if reason is None:
            return BackendDecision(op, spec, tuple(passed), tuple(spec.notes(caps)))
        passed.append((spec.name, reason))
    raise BackendUnavailable(
        f"no {op} backend can serve this model: " + "; ".join(f"{n}: {r}" for n, r in passed)
    )


def select_all(
    caps: Capabilities, forced: dict[str, str] | None = None
) -> dict[str, BackendDecision]:
    """A decision for every op family the model uses."""
    forced = forced or {}
    unknown = sorted(set(forced) - set(OPS))
    if unknown:
        raise ValueError(f"unknown op families {unknown}; known: {', '.join(OPS)}")
    used = [op for op in OPS if OP_LAYERS[op] is None or getattr(caps, OP_LAYERS[op])]
    return {op: select(op, caps, forced.get(op, "auto")) for op in used}


def format_backend_table(
    model: str,
    device: str = "auto",
    dtype: str = "auto",
    forced: dict[str, str] | None = None,
    state_dtype: str = "float32",
) -> str:
    """The backend table `deltaserve backends --model DIR` prints, without loading weights.
    A forced backend that cannot serve the model raises BackendUnavailable with its reason."""
    from deltaserve.config import resolve_device, resolve_dtype
    from deltaserve.loader.hf_config import load_hf_config
    from deltaserve.models.registry import get_model_class

    hf_config, text_config, arch = load_hf_config(model)
    dev = resolve_device(device)
    run_dtype = resolve_dtype(dtype, getattr(text_config, "dtype", None), dev)
    with torch.device("meta"):
        specs = get_model_class(arch)(text_config).layer_specs()
    state = torch.bfloat16 if state_dtype in ("bfloat16", "bf16") else torch.float32
    caps = Capabilities.from_specs(specs, dev, run_dtype, state, 16)
    lines = [f"model: {arch}, device: {dev}, dtype: {str(run_dtype).removeprefix('torch.')}"]
    lines.append(f"{'op':<12} {'backend':<11} passed over / notes")
    for op, decision in select_all(caps, forced).items():
        skipped = "; ".join(f"{n}: {r}" for n, r in decision.passed_over) or "-"
        notes = "".join(f"; {n}" for n in decision.notes)
        lines.append(f"{op:<12} {decision.chosen.name:<11} {skipped}{notes}")
    return "\n".join(lines)
