"""Sizing and allocating the KV cache and the recurrent-state pool for a model's layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve import env
from deltaserve.config import EngineConfig
from deltaserve.engine.block_manager import cdiv
from deltaserve.forward_context import LayerCache
from deltaserve.logger import get_logger
from deltaserve.models.base import AttentionSpec, GDNSpec, LayerSpec

logger = get_logger(__name__)


@dataclass(frozen=True)
class CachePlan:
    num_blocks: int  # KV blocks including the null block 0 (0 when no attention layer)
    num_slots: int  # state slots including the null slot 0 (0 when no GDN layer)
    block_bytes: int
    slot_bytes: int


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_caches(specs: list[LayerSpec], config: EngineConfig) -> CachePlan:
    """Decide how many KV blocks and state slots to allocate within the memory budget."""
    mc, cc, sc = config.model, config.cache, config.scheduler
    kv_bytes = _dtype_bytes(mc.dtype)
    block_bytes = sum(
        2 * cc.block_size * s.num_kv_heads * s.head_dim * kv_bytes
        for s in specs
        if isinstance(s, AttentionSpec)
    )
    st_bytes = _dtype_bytes(cc.state_dtype)
    slot_bytes = sum(
        s.num_v_heads * s.head_v_dim * s.head_k_dim * st_bytes
        + s.conv_dim * (s.conv_kernel - 1) * kv_bytes
        for s in specs
        if isinstance(s, GDNSpec)
    )
    if mc.device.type == "cuda":
        budget = _cuda_cache_budget(specs, config)
    else:
        budget = int(env.cache_memory_gb() * 2**30)

    num_slots = 0
    if slot_bytes:
        num_slots = sc.max_num_seqs + 1
        if num_slots * slot_bytes > budget // 2:
            num_slots = max(2, (budget // 2) // slot_bytes + 1)
            logger.info(
                "recurrent state for %d sequences exceeds half the cache memory; "
                "at most %d sequences run at once",
                sc.max_num_seqs,
                num_slots - 1,
            )
    num_blocks = 0
    if block_bytes:
        per_seq = cdiv(mc.max_model_len, cc.block_size)
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        else:
            wanted = sc.max_num_seqs * per_seq + 1
            fit = (budget - num_slots * slot_bytes) // block_bytes
            num_blocks = int(min(wanted, fit))
        if num_blocks - 1 < per_seq:
            raise ValueError(
                f"the KV cache holds {max(num_blocks - 1, 0)} blocks of {cc.block_size} tokens, "
                f"fewer than one sequence of max_model_len={mc.max_model_len} needs ({per_seq}); "
                "lower max_model_len or give the cache more memory"
            )
    return CachePlan(num_blocks, num_slots, block_bytes, slot_bytes)


def activation_reserve_bytes(config: EngineConfig) -> int:
    """Memory kept free for one step's activations: the widest per-token intermediates of the
    largest step, fp32 logits for every sequence, and 1 GiB of slack for kernels' workspaces."""
    mc, sc = config.model, config.scheduler
    tc = mc.text_config
    hidden = int(tc.hidden_size)
    inter = int(getattr(tc, "intermediate_size", 4 * hidden))
    width = 4 * hidden + 3 * inter  # residual, normed input, projections, gate/up output
    per_token = width * _dtype_bytes(mc.dtype) * 2  # x2: the allocator's fragmentation
    vocab = int(getattr(tc, "vocab_size", 0))
    return sc.max_num_batched_tokens * per_token + sc.max_num_seqs * vocab * 4 * 2 + 2**30


def _cuda_cache_budget(specs: list[LayerSpec], config: EngineConfig) -> int:
    """`--gpu-memory-utilization` of the device, less the weights (loaded first), what other
    processes hold, and the activation reserve: what is left goes to KV blocks and state slots."""
    dev = config.model.device
    free, total = torch.cuda.mem_get_info(dev)
    ours = torch.cuda.memory_reserved(dev)  # weights (and anything else this process holds)
    others = total - free - ours
    reserve = activation_reserve_bytes(config)
    budget = int(total * config.gpu_memory_utilization) - ours - others - reserve
    logger.info(
        "GPU memory: %.1f GiB total, %.2f used by weights, %.2f by other processes, "
        "%.2f reserved for activations, %.2f for caches (gpu_memory_utilization %.2f)",
        total / 2**30,
        ours / 2**30,
        others / 2**30,
        reserve / 2**30,
        max(budget, 0) / 2**30,
        config.gpu_memory_utilization,
    )
    if budget <= 0:
        raise ValueError(
            "no GPU memory left for the KV cache and state pool after the weights "
            f"({ours / 2**30:.1f} GiB) and activations ({reserve / 2**30:.1f} GiB); raise "
            "gpu_memory_utilization or lower max_num_batched_tokens / max_num_seqs"
        )
    return budget


def describe_capacity(plan: CachePlan, config: EngineConfig) -> str:
    """What fits: how many sequences of what length the cache and state pool hold at once."""
    cc, mc = config.cache, config.model
    parts = []
    if plan.num_blocks:
        tokens = (plan.num_blocks - 1) * cc.block_size
        per_seq = cdiv(mc.max_model_len, cc.block_size) * cc.block_size
        parts.append(
            f"{plan.num_blocks - 1} KV blocks of {cc.block_size} tokens "
            f"({plan.num_blocks * plan.block_bytes / 2**30:.2f} GiB) = {tokens} tokens: "
            f"{tokens // per_seq} sequences of max_model_len {mc.max_model_len} at once"
        )
    if plan.num_slots:
        parts.append(
            f"{plan.num_slots - 1} recurrent-state slots "
            f"({plan.num_slots * plan.slot_bytes / 2**30:.2f} GiB): at most "
            f"{plan.num_slots - 1} sequences of any length at once"
        )
    return "; ".join(parts)


def allocate_caches(
    specs: list[LayerSpec], plan: CachePlan, config: EngineConfig
) -> list[LayerCache]:
    """One LayerCache (name -> tensor, as the spec declares) per decoder layer, zero-filled on
    the model's device."""
    mc, cc = config.model, config.cache
    units = {"paged": plan.num_blocks, "slots": plan.num_slots}
    caches = []
    for s in specs:
        shapes = s.tensors(units[s.pool], cc.block_size, mc.dtype, cc.state_dtype)
        caches.append(
            {
                name: torch.zeros(shape, dtype=dtype, device=mc.device)
                for name, (shape, dtype) in shapes.items()
            }
        )
    return caches
