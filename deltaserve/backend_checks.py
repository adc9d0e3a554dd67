"""Capability checks of the kernel backends (deltaserve.backends' registry): each returns None
when its backend can serve the model on this device, else a one-line reason.

NOTE: no torch at import time (`deltaserve --help` builds its flags from the registry).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from deltaserve.capabilities import Capabilities

if TYPE_CHECKING:
    import torch


def package_installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


_HALF = ("bfloat16", "float16")


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
    if _dtype_name(caps.dtype) not in _HALF:
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


def check_triton_gdn_prefill(caps: Capabilities) -> str | None:
    """The one-launch Triton prefill kernels (ops/gdn/row_split.py `TritonRowsGDNPrefill`: the
    chunked kernel or the token-by-token one): CUDA (the interpreter runs them in tests, with
    this check lifted), bfloat16 / float16 / float32 activations, a float32 or bfloat16 state,
    K and V of at most 256 (one [BV, K] tile in registers)."""
    reason = _cuda_reason(caps, "triton")
    if reason:
        return reason
    if _dtype_name(caps.dtype) not in (*_HALF, "float32"):
        return f"{_dtype_name(caps.dtype)} unsupported (bfloat16 / float16 / float32)"
    state = _dtype_name(caps.state_dtype)
    if state not in ("float32", "bfloat16"):
        return f"state dtype {state} unsupported (float32 or bfloat16)"
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


def flashinfer_gdn_kernel_reason(state_dtype: str) -> str | None:
    """Why FlashInfer's GDN decode kernels cannot run here (None: they imported). They are CuTe
    DSL kernels: flashinfer imports without the CuTe DSL runtime, and then leaves them unset.
    Imports flashinfer (only asked on a CUDA device where it is installed)."""
    try:
        import flashinfer.gdn_decode as fi_gdn
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        return f"flashinfer.gdn_decode failed to import ({type(e).__name__}: {e})"
    needed = {"float32": ("_PRETRANSPOSE_AVAILABLE", "_MTP_AVAILABLE")}.get(
        state_dtype, ("_GDN_DECODE_BF16_STATE_AVAILABLE",)
    )
    if all(getattr(fi_gdn, flag, False) for flag in needed):
        return None
    try:  # the import error of the kernels, for the reason
        import flashinfer.gdn_kernels.gdn_decode_pretranspose  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"no CuTe DSL runtime (its GDN kernels failed to import: {type(e).__name__}: {e})"
    return f"no CuTe DSL runtime ({', '.join(needed)} unset in flashinfer.gdn_decode)"


def check_flashinfer_gdn(caps: Capabilities) -> str | None:
    """FlashInfer's GDN decode (deltaserve.ops.gdn.flashinfer_decode, whose docstring says what
    its source does): Hopper or newer, bfloat16 activations, K = V = 128, a float32 or bfloat16
    state pool, and the CuTe DSL runtime. Slot indices never refuse it: the backend passes int32
    (the bf16 kernels do not compile with int64) and the kernels widen to 64 bits before the
    slot stride. CUDA graphs: capturable once compiled (a graph's warm-up run compiles)."""
    reason = _cuda_reason(caps, "flashinfer", (9, 0))
    if reason:
        return reason
    if _dtype_name(caps.dtype) != "bfloat16":
        return (
            f"{_dtype_name(caps.dtype)} activations unsupported "
            "(bfloat16 only: its kernels read q, k, v and write the output as bfloat16)"
        )
    for s in caps.gdn:
        if (s.head_k_dim, s.head_v_dim) != (128, 128):
            return (
                f"head dims K={s.head_k_dim}, V={s.head_v_dim} unsupported (K = V = 128 only: "
                "its kernels cover one 128-wide tile)"
            )
    state = _dtype_name(caps.state_dtype)
    if state not in ("float32", "bfloat16"):
        return f"state dtype {state} unsupported (float32 or bfloat16)"
    return flashinfer_gdn_kernel_reason(state)


def check_triton_conv1d(caps: Capabilities) -> str | None:
    return _cuda_reason(caps, "triton")


check_triton_fused = check_triton_conv1d  # elementwise kernels: any shape, any float dtype


def check_triton_decode_gemm(caps: Capabilities) -> str | None:
    reason = _cuda_reason(caps, "triton")
    if reason:
        return reason
    if _dtype_name(caps.dtype) not in _HALF:
        # NOTE: a float32 tl.dot would round through TF32, unlike the reference
        return f"{_dtype_name(caps.dtype)} unsupported (bfloat16 / float16 only)"
    return None


def check_triton_moe(caps: Capabilities) -> str | None:
    reason = _cuda_reason(caps, "triton")
    if reason:
        return reason
    if _dtype_name(caps.dtype) not in (*_HALF, "float32"):
        return f"{_dtype_name(caps.dtype)} unsupported (bfloat16 / float16 / float32)"
    return None


def check_grouped_mm_moe(caps: Capabilities) -> str | None:
    import torch

    if caps.device.type != "cuda":
        return "no CUDA device"
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if not package_installed("triton"):
        return "triton not installed (its routing kernel)"
    if _dtype_name(caps.dtype) != "bfloat16":
        return f"{_dtype_name(caps.dtype)} unsupported (bfloat16 only: torch._grouped_mm's kernel)"
    cc = caps.compute_capability
    if cc is not None and cc[0] not in (9, 10):
        # NOTE: elsewhere torch._grouped_mm falls back to a loop that reads offsets on the host
        return f"compute capability {cc[0]}.{cc[1]} unsupported (9.x or 10.x)"
    for s in caps.specs("moe"):
        if s.hidden_size % 8 or s.intermediate_size % 8:
            return (
                f"hidden {s.hidden_size} / expert intermediate {s.intermediate_size} "
                "not multiples of 8 (16-byte rows)"
            )
    return None


# the latent widths the Triton MLA kernels keep in registers ([rows, R] float32 accumulator)
TRITON_MLA_MAX_RANK = 512
TRITON_MLA_MAX_ROPE = 128
# more query heads per rank than this make the absorbed decode compute-bound, where FlashInfer's
# kernel leads ours (measured at 16 and 128 heads; the step between is not measured)
TRITON_MLA_DECODE_MAX_HEADS = 32


def _mla_heads(caps: Capabilities) -> int:
    """The most query heads per rank of the model's MLA layers (0 without any)."""
    return max((s.num_heads for s in caps.specs("mla")), default=0)


def check_triton_mla(caps: Capabilities) -> str | None:
    """The Triton MLA kernels (deltaserve.ops.mla.triton_*): CUDA, bfloat16 / float16 /
    float32, kv_lora_rank at most 512 and rope dim at most 128 (any H, any page size)."""
    reason = _cuda_reason(caps, "triton")
    if reason:
        return reason
    if _dtype_name(caps.dtype) not in (*_HALF, "float32"):
        return f"{_dtype_name(caps.dtype)} unsupported (bfloat16 / float16 / float32)"
    for s in caps.specs("mla"):
        if s.kv_lora_rank > TRITON_MLA_MAX_RANK:
            return f"kv_lora_rank {s.kv_lora_rank} unsupported (at most {TRITON_MLA_MAX_RANK})"
        if s.rope_dim > TRITON_MLA_MAX_ROPE:
            return f"rope dim {s.rope_dim} unsupported (at most {TRITON_MLA_MAX_ROPE})"
    return None


def defer_triton_mla(caps: Capabilities) -> str | None:
    """Auto selection lets FlashInfer's MLA serve above TRITON_MLA_DECODE_MAX_HEADS query heads
    per rank where it can (its decode is faster there, and its prefill leads ours at every
    head count). At fewer heads `split` comes first (our decode, FlashInfer's prefill), so
    triton serves only where FlashInfer cannot."""
    if check_flashinfer_mla(caps) is not None:
        return None
    heads = _mla_heads(caps)
    if heads > TRITON_MLA_DECODE_MAX_HEADS:
        return (
            f"{heads} query heads per rank: FlashInfer's MLA decode is faster there (3x at 128 "
            "heads, batch 16-64, bench kernels --only mla on an H200) and is available"
        )
    return None


def _mla_prefill_notes(min_query: int) -> list[str]:
    """How an `mla` backend's prefill rows attend under DELTASERVE_MLA_PREFILL, given its
    `expanded_min_query` (the layer decides per step, deltaserve.layers.mla
    `MLAttention.expands`)."""
    from deltaserve import env

    mode = env.mla_prefill()
    if mode == "auto":
        return [
            f"prefill rows of a step whose longest prefill query has >= {min_query} "
            "tokens: expanded (keys and values rebuilt, PyTorch's attention); shorter: absorbed"
        ]
    return [f"prefill rows: {mode} (DELTASERVE_MLA_PREFILL)"]


def triton_mla_notes(caps: Capabilities) -> list[str]:
    """The Triton MLA backend's prefill policy (`_mla_prefill_notes`)."""
    from deltaserve.ops.mla.triton_backend import EXPANDED_MIN_QUERY

    return _mla_prefill_notes(EXPANDED_MIN_QUERY)


def split_mla_notes(caps: Capabilities) -> list[str]:
    """The split MLA backend's prefill policy: FlashInfer's prefill below its threshold."""
    from deltaserve.ops.mla.split_backend import SPLIT_EXPANDED_MIN_QUERY

    return _mla_prefill_notes(SPLIT_EXPANDED_MIN_QUERY)


def check_flashinfer_mla(caps: Capabilities) -> str | None:
    """FlashInfer's `BatchMLAPagedAttentionWrapper` (deltaserve.ops.mla.flashinfer_backend):
    CUDA with compute capability >= 8.0, bfloat16 / float16, kv_lora_rank 512 and rope dim 64
    (the only latent widths its MLA kernels are built for). It reads c_kv and k_pe as two
    strided views of our one `[c_kv | k_pe]` cache (its run takes page and row strides)."""
    reason = _cuda_reason(caps, "flashinfer")
    if reason:
        return reason
    if _dtype_name(caps.dtype) not in _HALF:
        return f"{_dtype_name(caps.dtype)} unsupported (bfloat16 / float16 only)"
    for s in caps.specs("mla"):
        if (s.kv_lora_rank, s.rope_dim) != (512, 64):
            return (
                f"kv_lora_rank {s.kv_lora_rank} / rope dim {s.rope_dim} unsupported (512 / 64 only)"
            )
    return None


def check_split_mla(caps: Capabilities) -> str | None:
    """The `split` MLA backend (deltaserve.ops.mla.split_backend): FlashInfer's MLA for steps
    with prefill rows, the Triton decode for all-decode steps; both must serve, and at most
    TRITON_MLA_DECODE_MAX_HEADS query heads per rank (above, FlashInfer's decode leads)."""
    reason = check_flashinfer_mla(caps) or check_triton_mla(caps)
    if reason:
        return reason
    heads = _mla_heads(caps)
    if heads > TRITON_MLA_DECODE_MAX_HEADS:
        return (
            f"{heads} query heads per rank: FlashInfer's MLA decode is faster above "
            f"{TRITON_MLA_DECODE_MAX_HEADS} (use flashinfer)"
        )
    return None


# --- the registry: every op family once, backends fastest first, the torch reference last -----
