"""GDN chunked prefill through fla-core's `chunk_gated_delta_rule` (fla-core 0.6.0).

The prefill rows of a step form one varlen batch (batch dim 1, `cu_seqlens` from
`meta.query_start_loc`). fla-core 0.6.0 matches our math and layout directly:

- GVA: q, k keep their HK heads and v its HV heads; fla's kernels read key head
  `i_h // (HV // H)` for value head `i_h` (ops/common/chunk_delta_h.py), our
  `h // (HV / HK)` convention, so nothing is repeated.
- `state_v_first=True` keeps the state as [N, HV, V, K] (`h0 + o_v * K + o_k`), our "K-last"
  pool layout S[v, k]; its final state comes back float32 in the same layout.
- `use_gate_in_kernel=True` computes `g = -exp(A_log) * softplus(a + dt_bias)` in fp32 inside the
  chunk cumsum (ops/gated_delta_rule/gate.py), `use_beta_sigmoid_in_kernel=True` makes
  `beta = sigmoid(b)` in fp32 (ops/common/gate.py), and `use_qk_l2norm_in_kernel=True`
  normalises q and k with `x * rsqrt(sum(x^2) + 1e-6)`, as our reference does.
- `cu_seqlens_cpu` (the host copy) spares the chunk-index set-up a device sync.

The `fla` backend (`FlaGDNPrefill`) can send only rows of more than N new tokens here, shorter
ones to the one-launch Triton kernel (N = DELTASERVE_GDN_SHORT_ROW_TOKENS, 0 until that kernel
has run on a GPU), whose host cost is a fraction of
fla's 8 launches (deltaserve.ops.gdn.row_split says why and how).
"""

from __future__ import annotations

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule

from deltaserve import env
from deltaserve.forward_context import PrefillMetadata
from deltaserve.ops.gdn import GDNPrefillBackend
from deltaserve.ops.gdn.reference import gdn_gates
from deltaserve.ops.gdn.row_split import SHORT_ROW_MAX_TOKENS, ShortRowSplitPrefill


class FlaChunkGDNPrefill(GDNPrefillBackend):
    """Chunked gated delta rule for the prefill sequences of a batch, on fla-core's kernels
    (every row, whatever its length).

    Initial states are gathered from the pool by slot (zeros where `has_initial_state` is False,
    chosen with `torch.where` so that a fresh slot's garbage, even NaN, never leaks in); final
    states are scattered back with `index_copy_`, cast to the pool's dtype. Slots not in the
    batch are untouched.

    Args:
        fuse_gates: compute g and beta inside fla's kernels (True) or with `gdn_gates` in torch
            (fp32) before the call (False). Both follow the same math.
    """

    name = "fla-chunk"

    def __init__(self, fuse_gates: bool = True) -> None:
        self.fuse_gates = fuse_gates
        # the last two steps' metadata and their cu_seqlens (a step taking in-step snapshots
        # alternates its HEAD and TAIL sub-batches in every layer: ops/gdn/checkpoints.py)
        self._cu: list[tuple[PrefillMetadata, tuple[torch.Tensor, torch.Tensor]]] = []

    def _cu_seqlens(self, meta: PrefillMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(device, host) int64 cu_seqlens, the same tensor objects for every layer of a step:
        fla memoises its chunk-index set-up by argument identity (its last 4 calls), so new
        tensors per layer would redo that host-side work in each of them."""
        for seen, cu in self._cu:
            if seen is meta:
                return cu
        cu = (
            meta.query_start_loc.to(torch.int64),  # [P + 1]
            torch.tensor(meta.query_start_loc_cpu, dtype=torch.int64),
        )
        self._cu = [*self._cu[-1:], (meta, cu)]
        return cu

    def forward(
        self,
        q: torch.Tensor,  # [Tp, HK, K]
        k: torch.Tensor,  # [Tp, HK, K]
        v: torch.Tensor,  # [Tp, HV, V]
        a: torch.Tensor,  # [Tp, HV]
        b: torch.Tensor,  # [Tp, HV]
        A_log: torch.Tensor,  # [HV]
        dt_bias: torch.Tensor,  # [HV]
        ssm_state: torch.Tensor,  # [num_slots, HV, V, K]
        meta: PrefillMetadata,
    ) -> torch.Tensor:  # [Tp, HV, V] in v's dtype
        num_tokens, num_v_heads, head_v = v.shape
        head_k = k.shape[-1]
        if k.shape[1] == 0 or num_v_heads % k.shape[1]:
            raise ValueError(f"HV={num_v_heads} is not a multiple of HK={k.shape[1]}")
        if ssm_state.shape[1:] != (num_v_heads, head_v, head_k):
            raise ValueError(
                f"ssm_state {tuple(ssm_state.shape)} is not [num_slots, HV={num_v_heads}, "
                f"V={head_v}, K={head_k}]"
            )
        total = meta.query_start_loc_cpu[-1]  # tokens owned by the sequences (<= Tp)
        if meta.num_seqs == 0 or total == 0:
            return torch.zeros_like(v)

        slots = meta.state_slots  # [P] int64
        init = ssm_state.index_select(0, slots)  # [P, HV, V, K]
        fresh = ~meta.has_initial_state[:, None, None, None]  # [P, 1, 1, 1]
        init = torch.where(fresh, torch.zeros((), dtype=init.dtype, device=init.device), init)

        cu_seqlens, cu_seqlens_cpu = self._cu_seqlens(meta)  # [P + 1] each
        # varlen layout: batch dim 1 over the sequences' tokens
        q3, k3, v3 = q[None, :total], k[None, :total], v[None, :total]  # [1, total, H*, *]
        if self.fuse_gates:
            gate_args = dict(
                g=a[None, :total],  # raw; fla applies -exp(A_log) * softplus(a + dt_bias)
                beta=b[None, :total],  # raw; fla applies sigmoid
                use_gate_in_kernel=True,
                A_log=A_log,
                dt_bias=dt_bias,
                use_beta_sigmoid_in_kernel=True,
            )
        else:
            g, beta = gdn_gates(a[:total], b[:total], A_log, dt_bias)  # [total, HV] fp32
            gate_args = dict(g=g[None], beta=beta[None])
        out, final = chunk_gated_delta_rule(
            q3,
            k3,
            v3,
            scale=head_k**-0.5,
            initial_state=init,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            state_v_first=True,
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
            **gate_args,
        )  # out [1, total, HV, V]; final [P, HV, V, K] float32
        ssm_state.index_copy_(0, slots, final.to(ssm_state.dtype))
        out = out[0].to(v.dtype)  # [total, HV, V]
        if total < num_tokens:  # rows no sequence owns
            out = torch.cat([out, out.new_zeros(num_tokens - total, num_v_heads, head_v)])
        return out


class FlaGDNPrefill(ShortRowSplitPrefill):
    """The `fla` backend: rows of more than `max_short_tokens` new tokens through fla's chunked
    kernels (`FlaChunkGDNPrefill`), shorter ones through the one-launch Triton kernel.

    Args:
        fuse_gates: as `FlaChunkGDNPrefill`'s.
        max_short_tokens: the split point (0: fla for every row); None: the
            DELTASERVE_GDN_SHORT_ROW_TOKENS setting (deltaserve.env), else the measured
            default SHORT_ROW_MAX_TOKENS (ops/gdn/row_split.py).
    """

    name = "fla"

    def __init__(self, fuse_gates: bool = True, max_short_tokens: int | None = None) -> None:
        if max_short_tokens is None:
            max_short_tokens = env.gdn_short_row_tokens()
        if max_short_tokens is None:
            max_short_tokens = SHORT_ROW_MAX_TOKENS
        super().__init__(FlaChunkGDNPrefill(fuse_gates), max_short_tokens)
