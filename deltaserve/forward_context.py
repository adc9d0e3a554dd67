"""What a model's forward sees besides token ids and positions: the batch layout, the cache
tensors of each layer and the kernels chosen for this run.

The model runner builds one `ForwardContext` per step. Model files read it and never allocate
caches or pick kernels themselves (DESIGN.md invariant 1).

Batch layout: the step's tokens are flattened into one ragged batch of T tokens from B sequences.
Sequences are ordered decodes first (one new token on top of a non-empty context), then prefill
chunks. Sequence b owns tokens `query_start_loc[b] : query_start_loc[b + 1]`; those tokens sit at
absolute positions `context_lens[b] .. seq_lens[b] - 1`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class BatchMetadata:
    """Layout of one step's ragged batch (device tensors plus host copies for the reference)."""

    # per token
    slot_mapping: torch.Tensor  # [T] int64: KV-cache slot (block * block_size + offset) per token
    # per sequence
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new)
    context_lens: torch.Tensor  # [B] int32: tokens already cached before this step
    block_tables: torch.Tensor  # [B, max_blocks] int32 (attention layers; padded with 0)
    state_slots: torch.Tensor  # [B] int64: recurrent-state pool slot per sequence (GDN layers)
    has_initial_state: torch.Tensor  # [B] bool: context_lens > 0
    # host copies, so the reference kernels can loop without syncing the device
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    context_lens_cpu: list[int] = field(default_factory=list)
    state_slots_cpu: list[int] = field(default_factory=list)
    num_decodes: int = 0  # the first num_decodes sequences have exactly one new token each

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class LayerCache:
    """Cache tensors of one layer; which fields are set depends on the layer type."""

    k_cache: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads, head_dim]
    ssm_state: torch.Tensor | None = None  # [num_slots, HV, V, K] ("K-last")
    conv_state: torch.Tensor | None = None  # [num_slots, conv_dim, kernel - 1]


@dataclass
class Kernels:
    """The kernel implementations chosen at start-up (see deltaserve.backends)."""

    attention: Any = None  # ops.attention.AttentionBackend
    gdn: Any = None  # ops.gdn.GDNBackend


@dataclass
class ForwardContext:
    """Everything a model's forward needs beyond input ids and positions."""

    meta: BatchMetadata
    caches: list[LayerCache]  # indexed by decoder-layer index
    kernels: Kernels
