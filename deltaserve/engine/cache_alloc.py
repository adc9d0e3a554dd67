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
        free, _ = torch.cuda.mem_get_info(mc.device)
        budget = int(free * 0.85)
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


def allocate_caches(
    specs: list[LayerSpec], plan: CachePlan, config: EngineConfig
) -> list[LayerCache]:
    """One LayerCache per decoder layer, zero-filled on the model's device."""
    mc, cc = config.model, config.cache
    caches = []
    for s in specs:
        if isinstance(s, AttentionSpec):
            shape = (plan.num_blocks, cc.block_size, s.num_kv_heads, s.head_dim)
            caches.append(
                LayerCache(
                    k_cache=torch.zeros(shape, dtype=mc.dtype, device=mc.device),
                    v_cache=torch.zeros(shape, dtype=mc.dtype, device=mc.device),
                )
            )
        else:
            caches.append(
                LayerCache(
                    ssm_state=torch.zeros(
                        (plan.num_slots, s.num_v_heads, s.head_v_dim, s.head_k_dim),
                        dtype=cc.state_dtype,
                        device=mc.device,
                    ),
                    conv_state=torch.zeros(
                        (plan.num_slots, s.conv_dim, s.conv_kernel - 1),
                        dtype=mc.dtype,
                        device=mc.device,
                    ),
                )
            )
    return caches
