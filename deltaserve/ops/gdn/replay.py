"""GDN state replay: the recurrence of the first n_r tokens of each row from a saved state,
written to another slot (the rollback of a speculative verify step, spec/gdn_rollback.py).

`GDNReplayBackend.forward` reads `ssm_state[src[r]]`, applies the gated delta rule (math in
`deltaserve.ops.gdn`) for tokens 0 .. num_kept[r] - 1 of row r and writes the result to
`ssm_state[dst[r]]` (num_kept[r] = 0 copies the state). No outputs: only the state matters.
Inputs are prepared once by the caller: keys L2-normalised and expanded to the value heads, the
gates computed; all float32. Rows never share a dst slot, and no dst is another row's src.

The torch reference below; the Triton kernel in triton_replay.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class GDNReplayBackend(ABC):
    """Replays the first num_kept[r] tokens of each row on the state pool (src -> dst)."""

    name: str = "?"
    supports_cuda_graph: bool = False
    # NOTE: a backend that also rolls a whole layer back in fused kernels (conv, gates and
    # replay from the verify records) sets this and defines `rollback_layer`
    # (ops/gdn/triton_rollback.py states its contract); spec/gdn_rollback.py then uses it
    supports_fused_rollback: bool = False

    @abstractmethod
    def forward(
        self,
        k: torch.Tensor,  # [R, Q, HV, K] float32, L2-normalised, expanded to the value heads
        v: torch.Tensor,  # [R, Q, HV, V]
        g: torch.Tensor,  # [R, Q, HV] float32 log decay
        beta: torch.Tensor,  # [R, Q, HV] float32
        num_kept: torch.Tensor,  # [R] int64 in 0 .. Q
        src_slots: torch.Tensor,  # [R] int64
        dst_slots: torch.Tensor,  # [R] int64
        ssm_state: torch.Tensor,  # [num_slots, HV, V, K]
    ) -> None:
        """ssm_state[dst[r]] = the state after tokens 0 .. num_kept[r] - 1 from ssm_state[src]."""


def replay_states_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    num_kept: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    ssm_state: torch.Tensor,
) -> None:
    """The reference: vectorised over rows, a masked loop over the Q token positions (no host
    reads)."""
    state = ssm_state[src_slots].float()  # [R, HV, V, K]
    Q = k.shape[1]
    for t in range(Q):
        kt, gt, bt = k[:, t].float(), g[:, t].float(), beta[:, t].float()  # [R, HV, K], [R, HV]
        new = state * gt.exp()[..., None, None]
        predicted = torch.einsum("rhvk,rhk->rhv", new, kt)  # S k: [R, HV, V]
        delta = bt[..., None] * (v[:, t].float() - predicted)  # [R, HV, V]
        new = new + delta[..., None] * kt[:, :, None, :]  # + delta k^T
        keep = (num_kept > t)[:, None, None, None]  # [R, 1, 1, 1]
        state = torch.where(keep, new, state)
    ssm_state.index_copy_(0, dst_slots, state.to(ssm_state.dtype))


class TorchGDNReplay(GDNReplayBackend):
    """The torch reference (`replay_states_ref`)."""

    name = "torch"
    supports_cuda_graph = True

    def forward(self, k, v, g, beta, num_kept, src_slots, dst_slots, ssm_state) -> None:
        replay_states_ref(k, v, g, beta, num_kept, src_slots, dst_slots, ssm_state)
