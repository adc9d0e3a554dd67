"""Gated DeltaNet (GDN) kernels: the interface every GDN backend implements.

Recurrence per value head h (state S is [V, K], "K-last"), for each token t:
    g_t    = -exp(A_log[h]) * softplus(a_t[h] + dt_bias[h])      (log decay, <= 0)
    beta_t = sigmoid(b_t[h])
    q_t, k_t = l2norm(q_t), l2norm(k_t) (over K); q_t *= K ** -0.5
    S      = exp(g_t) * S
    S      = S + beta_t * (v_t - S k_t) k_t^T
    o_t    = S q_t
Value head h reads key head h // (HV / HK). All state math is float32.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from deltaserve.forward_context import BatchMetadata


class GDNBackend(ABC):
    """Causal conv1d and the gated delta rule over the recurrent-state pool, by slot index.

    Pools: conv_state [num_slots, conv_dim, W - 1] and ssm_state [num_slots, HV, V, K], both
    updated in place for the slots in `meta.state_slots`. Sequences whose
    `has_initial_state` is False start from zeros (their slot's old contents are ignored).
    Decode sequences are the first `meta.num_decodes` ones, each with a single token.
    """

    name: str = "?"

    @abstractmethod
    def conv1d(
        self,
        x: torch.Tensor,  # [T, conv_dim]
        weight: torch.Tensor,  # [conv_dim, W]
        conv_state: torch.Tensor,  # [num_slots, conv_dim, W - 1]
        meta: BatchMetadata,
    ) -> torch.Tensor:  # [T, conv_dim], SiLU applied
        """Depthwise causal conv1d over each sequence, continuing from its conv state."""

    @abstractmethod
    def gated_delta_rule(
        self,
        q: torch.Tensor,  # [T, HK, K]
        k: torch.Tensor,  # [T, HK, K]
        v: torch.Tensor,  # [T, HV, V]
        a: torch.Tensor,  # [T, HV] raw (pre-softplus) decay input
        b: torch.Tensor,  # [T, HV] raw (pre-sigmoid) beta input
        A_log: torch.Tensor,  # [HV]
        dt_bias: torch.Tensor,  # [HV]
        ssm_state: torch.Tensor,  # [num_slots, HV, V, K]
        meta: BatchMetadata,
    ) -> torch.Tensor:  # [T, HV, V] in v's dtype
        """Gates, q/k L2 norm and the delta rule for every sequence of the batch; decodes use
        the recurrent form, prefill chunks the chunked form; final states go back to the pool."""
