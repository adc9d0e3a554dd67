"""PyTorch reference for Gated DeltaNet: fp32 math, runs anywhere (CPU included).

This is the oracle the Triton kernels are tested against; it favours clarity over speed. The
math is the one stated in `deltaserve.ops.gdn`. The per-sequence functions take one sequence;
the backend loops over the ragged batch in Python using the host copies of the batch layout,
so it never syncs the device.

Shapes (one sequence of L tokens): q, k [L, HV, K] (already L2-normalised and expanded to the HV
value heads), v [L, HV, V], g and beta [L, HV], state [HV, V, K] ("K-last": S[v, k], o = S q).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.forward_context import BatchMetadata, PrefillMetadata
from deltaserve.ops.gdn import Conv1dBackend, GDNDecodeBackend, GDNKernels, GDNPrefillBackend


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x * rsqrt(sum(x * x) + eps)` over the last dim (as FLA and HF do), in float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log decay and write strength per token and value head, float32.

    Args:
        a, b: [T, HV] raw decay and beta inputs. A_log, dt_bias: [HV].

    Returns:
        g = -exp(A_log) * softplus(a + dt_bias) (<= 0) and beta = sigmoid(b), both [T, HV].
    """
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    return g, beta


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc_cpu: list[int],
    state_slots_cpu: list[int],
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU over each sequence of a ragged batch, from the conv pool.

    Args:
        x: [T, conv_dim] the step's pre-activation inputs; sequence b owns rows
            `query_start_loc_cpu[b] : [b + 1]`.
        weight: [conv_dim, W] depthwise taps (tap W - 1 multiplies the newest input).
        conv_state: [num_slots, conv_dim, W - 1] the previous W - 1 *inputs* of each sequence,
            oldest first; updated in place for `state_slots_cpu` with the last W - 1 entries of
            `[old_state | x_b]`.
        has_initial_state: [B] bool (device); False means the old state is read as zeros.

    Returns:
        [T, conv_dim] in x's dtype: `out[t] = silu(sum_j weight[:, j] * xpad[t + j])` with
        `xpad = [state | x_b]`. Rows past `query_start_loc_cpu[-1]` are zero.
    """
    width = weight.shape[1]
    w = weight.float()  # [C, W]
    out = torch.zeros_like(x)
    for b, slot in enumerate(state_slots_cpu):
        start, end = query_start_loc_cpu[b], query_start_loc_cpu[b + 1]
        if end == start:
            continue
        old = conv_state[slot].float()  # [C, W - 1]
        # NOTE: torch.where (not a multiply) so that garbage, even NaN, in a fresh slot is ignored.
        old = torch.where(has_initial_state[b], old, torch.zeros_like(old))
        xpad = torch.cat([old.t(), x[start:end].float()], dim=0)  # [W - 1 + L, C]
        windows = xpad.unfold(0, width, 1)  # [L, C, W]: windows[t, c, j] = xpad[t + j, c]
        out[start:end] = F.silu((windows * w).sum(dim=-1)).to(x.dtype)
        conv_state[slot].copy_(xpad[xpad.shape[0] - (width - 1) :].t())
    return out


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule for ONE sequence (fp32).

    Args:
        q, k: [L, HV, K], already L2-normalised and expanded to the value heads; `scale` is
            applied to q here.
        v: [L, HV, V]. g, beta: [L, HV] log decay and write strength.
        initial_state: [HV, V, K] or None (zeros).

    Returns:
        o [L, HV, V] float32 and the final state [HV, V, K] float32.
    """
    L, num_heads, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q = q * scale
    if initial_state is None:
        state = q.new_zeros(num_heads, dv, dk)
    else:
        state = initial_state.float().clone()
    out = q.new_empty(L, num_heads, dv)
    for t in range(L):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hvk,hk->hv", state, k[t])  # S k_t: [HV, V]
        delta = beta[t][:, None] * (v[t] - predicted)  # [HV, V]
        state = state + delta[:, :, None] * k[t][:, None, :]  # + delta k_t^T
        out[t] = torch.einsum("hvk,hk->hv", state, q[t])  # S q_t
    return out, state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY / UT-transform) gated delta rule for ONE sequence; same contract and result as
    `recurrent_gated_delta_rule`. The last chunk may be shorter than `chunk_size`.

    Within a chunk of C tokens starting from state S0, with gamma_i = sum_{j<=i} g_j (log decay
    from the chunk start) and D_ij = exp(gamma_i - gamma_j) for j <= i:
        u_i = beta_i (v_i - exp(g_i) S_{i-1} k_i)      (what token i writes)
        S_i = exp(gamma_i) S0 + sum_{j<=i} D_ij u_j k_j^T
    Substituting S_{i-1} gives a unit lower-triangular system for U = [u_i] (rows):
        (I + A) U = beta V - (beta exp(gamma) K) S0^T,  A_ij = beta_i D_ij k_i.k_j (j < i)
    and then
        O   = (exp(gamma) Q) S0^T + ((Q K^T) * D) U
        S_C = exp(gamma_C) S0 + U^T (exp(gamma_C - gamma) K)
    Every exponent is <= 0, so nothing overflows.
    """
    L, num_heads, dk = k.shape
    dv = v.shape[-1]
    # heads first: [HV, L, *]
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))
    g, beta = (t.float().transpose(0, 1) for t in (g, beta))  # [HV, L]
    q = q * scale
    if initial_state is None:
        state = q.new_zeros(num_heads, dv, dk)
    else:
        state = initial_state.float().clone()
    out = q.new_empty(num_heads, L, dv)
    for start in range(0, L, chunk_size):
        end = min(start + chunk_size, L)
        C = end - start
        qc, kc, vc = q[:, start:end], k[:, start:end], v[:, start:end]  # [HV, C, *]
        bc = beta[:, start:end, None]  # [HV, C, 1]
        gamma = g[:, start:end].cumsum(dim=-1)  # [HV, C]
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= i
        diff = gamma[:, :, None] - gamma[:, None, :]  # [HV, C, C]: gamma_i - gamma_j
        decay = diff.masked_fill(~lower, float("-inf")).exp()  # D, zero above the diagonal

        A = (bc * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)  # [HV, C, C] strictly lower
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        rhs = bc * vc - (bc * gamma.exp()[..., None] * kc) @ state.transpose(-1, -2)  # [HV, C, V]
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)

        attn = (qc @ kc.transpose(-1, -2)) * decay  # [HV, C, C]
        out[:, start:end] = (gamma.exp()[..., None] * qc) @ state.transpose(-1, -2) + attn @ u

        gamma_last = gamma[:, -1:]  # [HV, 1]
        k_to_end = (gamma_last - gamma).exp()[..., None] * kc  # [HV, C, K]
        state = gamma_last.exp()[..., None] * state + u.transpose(-1, -2) @ k_to_end
    return out.transpose(0, 1), state  # [L, HV, V], [HV, V, K]


def _expand_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalise q, k [T, HK, K] and repeat them to the value heads: [T, HV, K] float32."""
    num_k_heads = k.shape[1]
    assert num_v_heads % num_k_heads == 0, f"HV={num_v_heads} not a multiple of HK={num_k_heads}"
    ratio = num_v_heads // num_k_heads  # value head j reads key head j // ratio
    return l2norm(q).repeat_interleave(ratio, dim=1), l2norm(k).repeat_interleave(ratio, dim=1)


class TorchConv1d(Conv1dBackend):
    """Reference causal conv1d: loops over the sequences of the batch (host lists)."""

    name = "torch"

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        conv_state: torch.Tensor,
        meta: BatchMetadata,
    ) -> torch.Tensor:
        return causal_conv1d_ref(
            x,
            weight,
            conv_state,
            meta.query_start_loc_cpu,
            meta.state_slots_cpu,
            meta.has_initial_state,
        )


class TorchGDNPrefill(GDNPrefillBackend):
    """Reference chunked prefill: fp32 math, one sequence at a time."""

    name = "torch"

    def __init__(self, chunk_size: int = 64) -> None:
        self.chunk_size = chunk_size

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        ssm_state: torch.Tensor,
        meta: PrefillMetadata,
    ) -> torch.Tensor:
        g, beta = gdn_gates(a, b, A_log, dt_bias)  # [T, HV] each
        q, k = _expand_qk(q, k, v.shape[1])  # [T, HV, K] each
        scale = k.shape[-1] ** -0.5
        out = torch.zeros_like(v)
        for i, slot in enumerate(meta.state_slots_cpu):
            start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
            if end == start:
                continue
            old = ssm_state[slot].float()  # [HV, V, K]
            # NOTE: torch.where (not a multiply) so that garbage, even NaN, in a fresh slot is
            # ignored when the sequence has no initial state.
            init = torch.where(meta.has_initial_state[i], old, torch.zeros_like(old))
            args = (q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end])
            o, final = chunk_gated_delta_rule(*args, init, scale, self.chunk_size)
            out[start:end] = o.to(v.dtype)
            ssm_state[slot].copy_(final)
        return out


def _delta_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One gated-delta-rule step for N sequences at once, float32.

    Args:
        state: [N, HV, V, K]. q (scaled), k: [N, HV, K] normalised. v: [N, HV, V].
        g, beta: [N, HV].

    Returns:
        o [N, HV, V] and the new state [N, HV, V, K].
    """
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("nhvk,nhk->nhv", state, k)  # S k: [N, HV, V]
    delta = beta[..., None] * (v.float() - predicted)  # [N, HV, V]
    state = state + delta[..., None] * k[:, :, None, :]  # + delta k^T
    out = torch.einsum("nhvk,nhk->nhv", state, q)  # S q: [N, HV, V]
    return out, state


class TorchGDNDecode(GDNDecodeBackend):
    """Reference decode, vectorised over the batch: gathers the states by slot, carries them in
    fp32 through each row's q tokens and scatters them back (no host reads, so it can be
    captured)."""

    name = "torch"
    supports_cuda_graph = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        ssm_state: torch.Tensor,
        state_slots: torch.Tensor,
        query_len: int = 1,
    ) -> torch.Tensor:
        g, beta = gdn_gates(a, b, A_log, dt_bias)  # [N * q, HV] each
        q, k = _expand_qk(q, k, v.shape[1])  # [N * q, HV, K] each
        q = q * k.shape[-1] ** -0.5
        state = ssm_state[state_slots].float()  # [N, HV, V, K]
        if query_len == 1:
            out, state = _delta_step(state, q, k, v, g, beta)  # [N, HV, V]
        else:
            n = state_slots.shape[0]
            # token rows of sequence i: i * q .. i * q + q - 1
            q, k, v, g, beta = (x.unflatten(0, (n, query_len)) for x in (q, k, v, g, beta))
            outs = []
            for t in range(query_len):
                o, state = _delta_step(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
                outs.append(o)
            out = torch.stack(outs, dim=1).flatten(0, 1)  # [N, q, HV, V] -> [N * q, HV, V]
        ssm_state.index_copy_(0, state_slots, state.to(ssm_state.dtype))
        return out.to(v.dtype)


def torch_gdn_kernels(chunk_size: int = 64) -> GDNKernels:
    """All three GDN op families from the torch reference, behind the model's face."""
    return GDNKernels(TorchConv1d(), TorchGDNPrefill(chunk_size), TorchGDNDecode())
