"""Cache specs: what one layer caches, in which pool, and the tensors that hold it.

Each layer that caches something declares a spec. A spec names its pool kind (`pool`):
- "paged": per token, in blocks of `block_size` tokens shared by every layer of that pool
  (attention K / V, an MLA latent); a sequence holds a list of block ids;
- "slots": one unit per sequence, whatever its length (GDN recurrent and conv state); a sequence
  holds one slot id.
The planner sizes each pool from the bytes its specs need per unit, and allocates each layer's
tensors from `tensors()`: adding a cache kind is a new spec class, not an edit of the planner.
`layer_kind` groups specs for backend selection (deltaserve.backends.Capabilities).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

TensorShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CacheSpec:
    """Base of every cache spec (frozen dataclasses: equal specs share backend planning)."""

    pool: ClassVar[str] = "?"  # pool kind: "paged" or "slots" (deltaserve.cache.pools)
    layer_kind: ClassVar[str] = "?"  # capability group: "attention", "gdn", ...
    display_name: ClassVar[str] = ""  # what its layers are called in messages

    def tensors(
        self, num_units: int, block_size: int, dtype: torch.dtype, state_dtype: torch.dtype
    ) -> TensorShapes:
        """name -> (shape, dtype) of this layer's cache tensors for `num_units` units of its
        pool (blocks of `block_size` tokens, or slots); `dtype` is the model's run dtype."""
        raise NotImplementedError

    def unit_bytes(self, block_size: int, dtype: torch.dtype, state_dtype: torch.dtype) -> int:
        """Bytes this layer needs per unit of its pool."""
        total = 0
        for shape, dt in self.tensors(1, block_size, dtype, state_dtype).values():
            n = 1
            for d in shape:
                n *= d
            total += n * dtype_bytes(dt)
        return total


@dataclass(frozen=True)
class AttentionSpec(CacheSpec):
    """Paged-KV attention layer: cache block [block_size, num_kv_heads, head_dim] for K and V."""

    pool: ClassVar[str] = "paged"
    layer_kind: ClassVar[str] = "attention"
    display_name: ClassVar[str] = "attention"

    num_heads: int
    num_kv_heads: int
    head_dim: int

    def tensors(self, num_units, block_size, dtype, state_dtype) -> TensorShapes:
        shape = (num_units, block_size, self.num_kv_heads, self.head_dim)
        return {"k_cache": (shape, dtype), "v_cache": (shape, dtype)}


@dataclass(frozen=True)
class GDNSpec(CacheSpec):
    """Gated DeltaNet layer: conv state [conv_dim, conv_kernel - 1], SSM state [HV, V, K]."""

    pool: ClassVar[str] = "slots"
    layer_kind: ClassVar[str] = "gdn"
    display_name: ClassVar[str] = "Gated DeltaNet"

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def tensors(self, num_units, block_size, dtype, state_dtype) -> TensorShapes:
        return {
            "ssm_state": (
                (num_units, self.num_v_heads, self.head_v_dim, self.head_k_dim),
                state_dtype,
            ),
            "conv_state": ((num_units, self.conv_dim, self.conv_kernel - 1), dtype),
        }


@dataclass(frozen=True)
class MLASpec(CacheSpec):
    """Multi-head latent attention layer (DeepSeek-V2): one latent per token shared by all heads,
    cache block [block_size, kv_lora_rank + rope_dim] (`[c_kv | k_pe]`; deltaserve.ops.mla).
    `num_heads` is this rank's query heads (the latent is replicated under tensor parallelism)."""

    pool: ClassVar[str] = "paged"
    layer_kind: ClassVar[str] = "mla"
    display_name: ClassVar[str] = "latent attention"

    num_heads: int
    kv_lora_rank: int
    rope_dim: int

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def tensors(self, num_units, block_size, dtype, state_dtype) -> TensorShapes:
        return {"latent_cache": ((num_units, block_size, self.latent_dim), dtype)}


LayerSpec = CacheSpec
