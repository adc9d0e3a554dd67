"""Token-row buckets for eager forwards: cuBLAS sees a few GEMM shapes, not a new one per step.

cuBLAS chooses a GEMM's algorithm on the host the first time it sees a shape, and a serving
step's token count is new almost every step (a chat turn's prompt plus the decode rows beside
it). Measured on an H200 (scripts/probe_linear_host.py): `F.linear` at a row count seen before
costs 20-30 us of host time, at a new one 130-840 us; a 9B Qwen3.5 step has 129 GEMMs, so an
unbucketed 150-token prefill spent tens of milliseconds of host time choosing algorithms.

An eager forward on CUDA therefore runs its dense layers over `padded_rows(T)` rows: T rounded up
to a multiple of 1/16 of the largest power of two <= T, and of 16 (below 256 tokens, where a
GEMM streams its weight and a few more rows cost nearly nothing), so above 256 tokens padding
adds at most 1/16 of the rows, and token counts up to 8192 fall into 95 buckets; `prime_gemms`
shows cuBLAS every bucket of every projection shape at start-up. The padded rows carry token id 0 at
position 0; norms, projections, activations and expert layers treat them as any row (each output
row depends on its input row only), and the mixers (attention, GDN, MLA) hand only the first T
rows to their cache-touching kernels and fill the padded rows of their outputs with zeros
(ForwardContext.num_tokens). The caller sees the first T rows of the result.

Token counts up to `MIN_PADDED` are left alone: the decode GEMM takes them (ops/linear) and
cuBLAS has seen each of those few shapes after a few steps.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.logger import get_logger

if TYPE_CHECKING:
    from deltaserve.config import EngineConfig
    from deltaserve.engine.model_instance import ModelInstance

logger = get_logger(__name__)

MIN_PADDED = 16  # token counts above this are padded
STEPS_PER_OCTAVE = 16  # buckets between consecutive powers of two


def padded_rows(num_tokens: int) -> int:
    """The bucket of `num_tokens` rows: itself up to MIN_PADDED, else rounded up to a multiple of
    max(MIN_PADDED, 2^floor(log2 num_tokens) / STEPS_PER_OCTAVE)."""
    if num_tokens <= MIN_PADDED:
        return num_tokens
    step = max(MIN_PADDED, (1 << (num_tokens.bit_length() - 1)) // STEPS_PER_OCTAVE)
    return -(-num_tokens // step) * step


def bucket_sizes(max_tokens: int) -> list[int]:
    """Every bucket above MIN_PADDED that a step of at most `max_tokens` tokens can use."""
    sizes, n = [], MIN_PADDED + 1
    while n <= max_tokens:
        b = padded_rows(n)
        sizes.append(b)
        n = b + 1
    return sizes


def prime_gemms(model: nn.Module, max_tokens: int, device: torch.device) -> int:
    """Run `F.linear` once per (bucket, distinct 2-D projection weight shape) of `model` so that
    cuBLAS has chosen its algorithms before serving; returns the GEMMs run. Each weight shape is
    primed with a zero input against the model's own weight (no new weight memory)."""
    seen: dict[tuple, torch.Tensor] = {}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and isinstance(w, torch.Tensor) and w.dim() == 2:
            seen.setdefault((tuple(w.shape), w.dtype), w)
    sizes = bucket_sizes(max_tokens)
    if not seen or not sizes:
        return 0
    start = time.perf_counter()
    count = 0
    with torch.inference_mode():
        for (shape, dtype), w in seen.items():
            x = torch.zeros(sizes[-1], shape[1], dtype=dtype, device=device)
            for rows in sizes:
                F.linear(x[:rows], w)
                count += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info(
        "GEMM row buckets: %d buckets up to %d tokens x %d projection shapes primed in %.1f s",
        len(sizes),
        max_tokens,
        len(seen),
        time.perf_counter() - start,
    )
    return count


def prime_instance(instance: ModelInstance, config: EngineConfig) -> int:
    """`prime_gemms` for `instance` when its eager forwards pad rows to buckets (every bucket
    up to the step token budget); 0 GEMMs otherwise. The warm-up calls it on rank 0, each
    tensor-parallel worker on its own shard (engine/warmup.py, distributed/worker.py)."""
    if not instance.row_buckets:
        return 0
    budget = config.scheduler.max_num_batched_tokens
    return prime_gemms(instance.model, budget, config.model.device)
