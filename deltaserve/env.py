"""Every DELTASERVE_* environment variable, typed, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def _bool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from e


def _choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The variable's value, one of `choices` (`default` when unset), else a ValueError naming
    them."""
    raw = os.environ.get(name, default)
    if raw not in choices:
        quoted = [repr(c) for c in choices]
        allowed = ", ".join(quoted[:-1]) + " or " + quoted[-1]
        raise ValueError(f"{name} must be {allowed}, got {raw!r}")
    return raw


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as e:
        raise ValueError(f"{name} must be a number, got {raw!r}") from e


def runtime_stats() -> bool:
    """DELTASERVE_RUNTIME_STATS=1: log batch composition, tokens/s and cache usage."""
    return _bool("DELTASERVE_RUNTIME_STATS")


def runtime_stats_interval() -> int:
    """DELTASERVE_RUNTIME_STATS_INTERVAL=N: log runtime stats every N engine steps (default 50)."""
    return max(1, _int("DELTASERVE_RUNTIME_STATS_INTERVAL", 50))


def cache_dir() -> Path:
    """DELTASERVE_CACHE_DIR, else $XDG_CACHE_HOME/deltaserve, else ~/.cache/deltaserve."""
    explicit = os.environ.get("DELTASERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "deltaserve"


def cache_memory_gb() -> float:
    """DELTASERVE_CACHE_MEMORY_GB: memory for KV blocks plus recurrent-state slots when no GPU
    memory fraction applies (CPU runs) and no kv_cache_memory_bytes is given. Default 2 GiB."""
    return _float("DELTASERVE_CACHE_MEMORY_GB", 2.0)


def log_level() -> str:
    """DELTASERVE_LOG_LEVEL (default INFO)."""
    return os.environ.get("DELTASERVE_LOG_LEVEL", "INFO").upper()


def api_key() -> str | None:
    """DELTASERVE_API_KEY: the key `deltaserve serve` requires when --api-key is not given
    (None when unset; an empty value is returned as is, for the caller to refuse)."""
    return os.environ.get("DELTASERVE_API_KEY")


def moe_decode_configs() -> str:
    """DELTASERVE_MOE_DECODE_CONFIGS=all|base: the configurations the Triton moe decode kernels'
    autotuner measures (deltaserve.ops.moe.triton_decode): every one (default) or only the
    original list, to compare the two."""
    return _choice("DELTASERVE_MOE_DECODE_CONFIGS", ("all", "base"), "all")


def moe_one_token() -> str:
    """DELTASERVE_MOE_ONE_TOKEN=auto|gemv|tile: the Triton moe backend's kernels for one token
    routed from its router logits (batch-1 decode): the GEMV-style pair of
    deltaserve.ops.moe.triton_decode_one_token or the decode path's tile kernels; auto
    (default) takes the GEMV pair for experts of width <= ONE_TOKEN_GEMV_MAX_INTER (where it
    measured faster) and the tile kernels above."""
    return _choice("DELTASERVE_MOE_ONE_TOKEN", ("auto", "gemv", "tile"), "auto")


def mla_prep() -> str:
    """DELTASERVE_MLA_PREP=fused|separate: the CUDA MLA backends' step preparation for steps of
    up to 64 rows: the rope / latent norm and the W_UK product in one launch (fused, default;
    ops/mla/triton_head_matmul.py) or two, to compare."""
    return _choice("DELTASERVE_MLA_PREP", ("fused", "separate"), "fused")


def norm_gemv() -> str:
    """DELTASERVE_NORM_GEMV: `fused` (default) runs a decoder layer's residual add and RMSNorm
    inside its block's first projection at one-row decode steps (ops/linear/triton_gemv_norm.py);
    `separate` keeps the norm kernel then the GEMV."""
    return _choice("DELTASERVE_NORM_GEMV", ("fused", "separate"), "fused")


def gdn_conv_gemv() -> str:
    """DELTASERVE_GDN_CONV_GEMV: `fused` runs a GDN layer's conv1d update inside its in_proj's
    one-row GEMV at batch-1 decode steps (the conv epilogue of ops/linear/triton_gemv.py and
    triton_gemv_norm.py: one launch fewer per GDN layer); `separate` (default: with the norm
    fusion, level at batch 1 on an H200, docs/benchmarks.md) keeps the GEMV then the conv
    kernel."""
    return _choice("DELTASERVE_GDN_CONV_GEMV", ("fused", "separate"), "separate")


def gdn_decode_norm() -> str:
    """DELTASERVE_GDN_DECODE_NORM: `fused` runs a GDN layer's output norm (`w * norm(o) *
    silu(z)`) inside the Triton GDN decode at all-decode steps of one token per sequence (the
    last of each head's programs applies it: one launch fewer per GDN layer); `separate`
    (default: level at batch 1 with the conv fusion on an H200) keeps the gated-norm kernel."""
    return _choice("DELTASERVE_GDN_DECODE_NORM", ("fused", "separate"), "separate")


def mla_store() -> str:
    """DELTASERVE_MLA_STORE: `fused` (default) has the Triton MLA decode write an all-decode
    step's new latents into the cache itself (one launch fewer per layer); `separate` runs the
    latent writer first."""
    return _choice("DELTASERVE_MLA_STORE", ("fused", "separate"), "fused")


def mla_merge() -> str:
    """DELTASERVE_MLA_MERGE=fused|separate: the Triton MLA decode's split merge and the W_UV
    product for steps of at most 4 rows in one launch (fused, default: DeepSeek-V2-Lite decode
    batch 1 451.3 against 437.1 / 429.7 tok/s separate, one H200; ops/mla/triton_merge_out.py)
    or two (separate)."""
    return _choice("DELTASERVE_MLA_MERGE", ("fused", "separate"), "fused")


def autotune_cache() -> bool:
    """DELTASERVE_AUTOTUNE_CACHE=0 turns off the on-disk cache of our Triton kernels' autotuning
    results (deltaserve.ops.autotune; on by default: a later start-up on the same machine and
    Triton reuses the measured choice and compiles only the chosen configuration)."""
    return _bool("DELTASERVE_AUTOTUNE_CACHE", True)


def autotune_bench() -> str:
    """DELTASERVE_AUTOTUNE_BENCH: how the autotuner times a configuration of our Triton kernels
    (deltaserve.ops.autotune): `graph` (default: replays from a CUDA graph, L2 flushed before
    each launch; ops/graph_bench.py) or `events` (Triton's own per-launch event timing)."""
    raw = os.environ.get("DELTASERVE_AUTOTUNE_BENCH", "").strip().lower() or "graph"
    if raw not in ("graph", "events"):
        raise ValueError(f"DELTASERVE_AUTOTUNE_BENCH must be graph or events, got {raw!r}")
    return raw


def gdn_short_row_tokens() -> int | None:
    """DELTASERVE_GDN_SHORT_ROW_TOKENS=N: the `fla` GDN prefill sends rows of at most N new
    tokens to the one-launch Triton kernel (deltaserve.ops.gdn.row_split; 0: fla for every
    row). Unset: None, the measured default `row_split.SHORT_ROW_MAX_TOKENS`."""
    if not os.environ.get("DELTASERVE_GDN_SHORT_ROW_TOKENS"):
        return None
    n = _int("DELTASERVE_GDN_SHORT_ROW_TOKENS", 0)
    if n < 0:
        raise ValueError(f"DELTASERVE_GDN_SHORT_ROW_TOKENS must be >= 0, got {n}")
    return n


def decode_gemm_kernel() -> str:
    """DELTASERVE_DECODE_GEMM_KERNEL=auto|splitk|base: the Triton decode GEMM's kernel
    (deltaserve.ops.linear.triton_gemm.decode_gemm): auto (default: the GEMV kernel at one row,
    the autotuned base kernel at 2-16, its wide tiles above 16 rows, and cuBLAS above 16 rows
    for weights of more than 2048 output rows), splitk (the split-K kernel where its
    configuration splits K and above 16 rows) or base (the base kernel always, whatever the
    weight and row count), to compare."""
    return _choice("DELTASERVE_DECODE_GEMM_KERNEL", ("auto", "splitk", "base"), "auto")


def decode_gemm_max_rows() -> int:
    """DELTASERVE_DECODE_GEMM_MAX_ROWS=N: the Triton decode GEMM serves steps of up to N rows
    (16 to deltaserve.ops.linear.WIDE_MAX_ROWS, the default: above 16 rows it runs only on
    weights of at most 2048 output rows, cuBLAS the others; 16 sends every wider step to
    cuBLAS)."""
    from deltaserve.ops.linear import MAX_ROWS, WIDE_MAX_ROWS

    n = _int("DELTASERVE_DECODE_GEMM_MAX_ROWS", WIDE_MAX_ROWS)
    if not MAX_ROWS <= n <= WIDE_MAX_ROWS:
        raise ValueError(
            f"DELTASERVE_DECODE_GEMM_MAX_ROWS must be in {MAX_ROWS}..{WIDE_MAX_ROWS}, got {n}"
        )
    return n


def tp_all_reduce() -> str:
    """DELTASERVE_TP_ALL_REDUCE: `auto` (default: where every rank can, decode's small
    all-reduces at the end of row-parallel blocks fused with the next residual add and RMSNorm
    in our kernel over symmetric memory, the other small ones in PyTorch's one-shot kernel;
    NCCL otherwise), `oneshot` (PyTorch's one-shot kernel for all small ones, the norms
    separate) or `nccl`."""
    raw = os.environ.get("DELTASERVE_TP_ALL_REDUCE", "").strip().lower() or "auto"
    if raw not in ("auto", "oneshot", "nccl"):
        raise ValueError(f"DELTASERVE_TP_ALL_REDUCE must be auto, oneshot or nccl, got {raw!r}")
    return raw


def mla_prefill() -> str:
    """DELTASERVE_MLA_PREFILL: how MLA layers attend a step's prefill rows: `auto` (the
    default: expanded when the step's longest prefill query has at least the `mla` backend's
    `expanded_min_query` tokens and its expansion fits in memory, absorbed otherwise;
    deltaserve.layers.mla `MLAttention.expands`), `absorbed` (the `mla` backend, as decode)
    or `expanded` (keys and values rebuilt from the latents, then PyTorch's
    scaled_dot_product_attention: deltaserve.ops.mla.expanded)."""
    raw = os.environ.get("DELTASERVE_MLA_PREFILL", "").strip().lower() or "auto"
    if raw not in ("auto", "absorbed", "expanded"):
        raise ValueError(f"DELTASERVE_MLA_PREFILL must be auto, absorbed or expanded, got {raw!r}")
    return raw


def emulate_cuda_graphs() -> bool:
    """DELTASERVE_EMULATE_CUDA_GRAPHS=1: run the decode-graph path without a GPU or capture:
    the same buckets, static buffers and padding rows, with the forward run eagerly at each
    "replay" (tests of the graph bookkeeping on CPU, tensor parallelism's lockstep included).
    Speculative verify graphs of any q are "captured" then, whatever the attention backend
    captures for real, and a DFlash drafter's block-forward graphs are emulated too."""
    return _bool("DELTASERVE_EMULATE_CUDA_GRAPHS")


def pdl() -> str:
    """DELTASERVE_PDL: programmatic dependent launch of our Triton decode kernels
    (deltaserve.ops.pdl): `auto` (default: on CUDA devices of compute capability 9.0 and up)
    or `0` (off: every kernel waits for the previous one to finish before it launches)."""
    raw = os.environ.get("DELTASERVE_PDL", "").strip().lower() or "auto"
    if raw not in ("auto", "0", "off"):
        raise ValueError(f"DELTASERVE_PDL must be auto or 0, got {raw!r}")
    return "off" if raw in ("0", "off") else "auto"


def blas_library() -> str:
    """DELTASERVE_BLAS_LIBRARY=default|cublas|cublaslt: the library PyTorch's CUDA matmuls
    (F.linear: prefill projections, and decode steps on the weights the decode GEMM leaves to
    cuBLAS) go through, set once per process when the model loads (torch's
    `preferred_blas_library`); `default` leaves PyTorch's own choice (cuBLAS). cuBLASLt is the
    default: the 9B's batch-64 decode (context 2048) ran 7,961 / 7,957 tok/s with it against
    7,855 / 7,865 without, alternating in one H200 call, prefill 1 x 512 level
    (docs/benchmarks.md, "Where a batch-64 step goes")."""
    return _choice("DELTASERVE_BLAS_LIBRARY", ("default", "cublas", "cublaslt"), "cublaslt")


def log_compiles() -> bool:
    """DELTASERVE_LOG_COMPILES=1: log one line per Triton JIT compile (the kernel, its
    specialisation and the compile time; deltaserve.ops.compile_log), to find kernels that
    compile while serving."""
    return _bool("DELTASERVE_LOG_COMPILES")


def row_buckets() -> str:
    """DELTASERVE_ROW_BUCKETS: eager forwards run over token rows rounded up to a bucket
    (deltaserve.engine.row_buckets: cuBLAS chooses its GEMM algorithms once per bucket, not per
    step): `auto` (default: on CUDA devices), `1` (on, any device: tests of the padding on CPU)
    or `0` (off)."""
    raw = os.environ.get("DELTASERVE_ROW_BUCKETS", "").strip().lower() or "auto"
    if raw not in ("auto", "0", "off", "1", "on"):
        raise ValueError(f"DELTASERVE_ROW_BUCKETS must be auto, 1 or 0, got {raw!r}")
    return {"0": "off", "1": "on"}.get(raw, raw)


def piecewise_graph_tokens() -> int:
    """DELTASERVE_PIECEWISE_GRAPH_TOKENS: eager steps of at most this many tokens run their dense
    part from piecewise CUDA graphs (deltaserve.engine.piecewise_graphs), where decode graphs
    are captured; default 1024, 0: off."""
    n = _int("DELTASERVE_PIECEWISE_GRAPH_TOKENS", 1024)
    if n < 0:
        raise ValueError(f"DELTASERVE_PIECEWISE_GRAPH_TOKENS must be >= 0, got {n}")
    return n
