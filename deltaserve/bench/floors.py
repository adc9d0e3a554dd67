"""The floors every throughput figure is stated against (../shared/GPU.md, DESIGN.md).

- decode step: (weights streamed + KV read + recurrent state read and written) / copy bandwidth,
  where the weights streamed are every parameter except the embedding table (a gather of a few
  rows), unless it is tied to the lm_head; KV read is every attention layer's K and V for the
  whole context of every sequence; the state is each GDN layer's SSM state (in the state dtype)
  and conv state (in the model dtype), read and written once per sequence.
- prefill: (2 x params x tokens + causal attention FLOPs) / matmul rate, where params counts
  every parameter once (GPU.md's definition, so figures compare with its peers) and the
  attention FLOPs are QK^T and PV over the causal triangle: 2 x 2 x Hq x D x P (P + 1) / 2 per
  attention layer.

Ceilings measured on our H200 (GPU.md): 4.27 TB/s device copy, 773 TFLOP/s bf16 matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only when costs are computed (`deltaserve --help` is fast)
    import torch
    from torch import nn

    from deltaserve.models.base import LayerSpec

H200_COPY_BYTES_PER_S = 4.27e12
H200_MATMUL_FLOP_PER_S = 773e12


def _itemsize(dtype: torch.dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class ModelCosts:
    """What one token / one sequence costs a model in bytes and FLOPs."""

    num_params: int  # every parameter once (a tied lm_head is the embedding)
    embedding_params: int
    tied: bool
    weight_bytes: int  # every parameter, in the model dtype
    streamed_weight_bytes: int  # per decode step: all but the embedding table unless tied
    kv_bytes_per_token: int  # K + V of one token over all attention layers
    ssm_state_bytes_per_seq: int  # over all GDN layers, in the state dtype
    conv_state_bytes_per_seq: int  # over all GDN layers, in the model dtype
    attention_qd: tuple[int, ...]  # Hq x head_dim of each attention layer (for FLOPs)

    @property
    def state_bytes_per_seq(self) -> int:
        return self.ssm_state_bytes_per_seq + self.conv_state_bytes_per_seq


def model_costs(
    model: nn.Module,
    specs: list[LayerSpec],
    dtype: torch.dtype,
    state_dtype: torch.dtype,
) -> ModelCosts:
    """Costs of `model` (any device, meta included) run in `dtype` with `state_dtype` state."""
    from deltaserve.models.base import AttentionSpec, GDNSpec

    num_params = sum(p.numel() for p in model.parameters())  # shared tensors counted once
    embed = model.model.embed_tokens.weight.numel()
    tied = getattr(model, "lm_head", None) is None
    item, state_item = _itemsize(dtype), _itemsize(state_dtype)
    kv = ssm = conv = 0
    attention_qd = []
    for s in specs:
        if isinstance(s, AttentionSpec):
            kv += 2 * s.num_kv_heads * s.head_dim * item
            attention_qd.append(s.num_heads * s.head_dim)
        elif isinstance(s, GDNSpec):
            ssm += s.num_v_heads * s.head_v_dim * s.head_k_dim * state_item
            conv += s.conv_dim * (s.conv_kernel - 1) * item
    streamed = num_params if tied else num_params - embed
    return ModelCosts(
        num_params=num_params,
        embedding_params=embed,
        tied=tied,
        weight_bytes=num_params * item,
        streamed_weight_bytes=streamed * item,
        kv_bytes_per_token=kv,
        ssm_state_bytes_per_seq=ssm,
        conv_state_bytes_per_seq=conv,
        attention_qd=tuple(attention_qd),
    )


def decode_step_bytes(costs: ModelCosts, batch: int, context: float) -> float:
    """Bytes one decode step of `batch` sequences at `context` cached tokens must move."""
    kv = batch * context * costs.kv_bytes_per_token
    state = batch * 2 * costs.state_bytes_per_seq  # read and written
    return costs.streamed_weight_bytes + kv + state


def decode_floor_tok_s(
    costs: ModelCosts, batch: int, context: float, copy_bw: float = H200_COPY_BYTES_PER_S
) -> float:
    """Tokens per second no decode of `batch` sequences at `context` can beat."""
    return batch / (decode_step_bytes(costs, batch, context) / copy_bw)


def prefill_flops(costs: ModelCosts, tokens: int) -> tuple[float, float]:
    """(2 x params x tokens, causal attention FLOPs) of one prompt of `tokens` tokens."""
    dense = 2.0 * costs.num_params * tokens
    attention = sum(2.0 * qd * tokens * (tokens + 1) for qd in costs.attention_qd)
    return dense, attention


def prefill_floor_tok_s(
    costs: ModelCosts, tokens: int, matmul_rate: float = H200_MATMUL_FLOP_PER_S
) -> float:
    """Tokens per second no prefill of one `tokens`-token prompt can beat."""
    return tokens / (sum(prefill_flops(costs, tokens)) / matmul_rate)
