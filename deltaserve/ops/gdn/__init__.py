"""Gated DeltaNet (GDN) kernels: the interfaces every GDN backend implements.

Recurrence per value head h (state S is [V, K], "K-last"), for each token t:
    g_t    = -exp(A_log[h]) * softplus(a_t[h] + dt_bias[h])      (log decay, <= 0)
    beta_t = sigmoid(b_t[h])
    q_t, k_t = l2norm(q_t), l2norm(k_t) (over K); q_t *= K ** -0.5
    S      = exp(g_t) * S
    S      = S + beta_t * (v_t - S k_t) k_t^T
    o_t    = S q_t
Value head h reads key head h // (HV / HK). All state math is float32.

Three op families, each selected on its own (deltaserve.backends): the causal conv1d over the
whole batch, the chunked prefill over the prefill sequences and the recurrent decode over the
decode sequences. `GDNKernels` puts them behind the two calls a model makes.

A step that takes prefix-cache state snapshots inside its prefill rows (checkpoints,
`BatchMetadata.checkpoints`) hands them to a backend that stores them from inside its kernel
(`takes_checkpoints`); for any other backend it runs the op as a HEAD and a TAIL sub-batch
with the state copy between them (ops/gdn/checkpoints.py), and that backend never sees them.

Decode rows: the first `meta.num_decodes` sequences each carry `meta.decode_query_len` (q)
tokens, rows b * q .. b * q + q - 1 (q = 1: a plain decode; q = 1 + k: verifying k drafts). Every
op gives exactly what feeding those q tokens one at a time would give, outputs and states.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from deltaserve.forward_context import BatchMetadata, PrefillMetadata
from deltaserve.ops.gdn.checkpoints import CheckpointSplit, checkpoint_split


class Conv1dBackend(ABC):
    """Depthwise causal conv1d + SiLU over a ragged batch, continuing from the conv-state pool.

    conv_state is [num_slots, conv_dim, W - 1], the last W - 1 *inputs* of each sequence (oldest
    first), updated in place for the slots in `meta.state_slots`. Sequences whose
    `has_initial_state` is False start from zeros (their slot's old contents, even NaN, are
    ignored). Decode sequences are the first `meta.num_decodes` ones, `meta.decode_query_len`
    (q) tokens each: a decode row convolves `[its state | its q inputs]`, outputs q rows and
    keeps its last W - 1 inputs as the new state.
    """

    name: str = "?"
    supports_cuda_graph: bool = False  # True: the all-decode path never reads host lists
    # True: the prefill path stores the step's in-step snapshots itself (the prefill part's
    # `checkpoint_tensors()`: the window after a row's first h inputs to its destination row)
    takes_checkpoints: bool = False

    @abstractmethod
    def forward(
        self,
        x: torch.Tensor,  # [T, conv_dim]
        weight: torch.Tensor,  # [conv_dim, W]
        conv_state: torch.Tensor,  # [num_slots, conv_dim, W - 1]
        meta: BatchMetadata,
    ) -> torch.Tensor:  # [T, conv_dim] in x's dtype, SiLU applied
        """`out[t] = silu(sum_j weight[:, j] * xpad[t + j])` with `xpad = [state | x_b]`."""


class GDNPrefillBackend(ABC):
    """Gates, q/k L2 norm and the chunked delta rule for the prefill sequences of a batch.

    Initial states come from `ssm_state[meta.state_slots]` (zeros where `has_initial_state` is
    False, whatever the slot holds); final states are written back to the same slots.
    """

    name: str = "?"

    def takes_checkpoints(self, meta: PrefillMetadata) -> bool:
        """True when `forward` on `meta` stores the step's in-step snapshots itself (the state
        after a row's first h tokens to its destination row: `meta.checkpoint_tensors()`);
        False (the default) has the GDN face split the step around them instead."""
        return False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [Tp, HK, K] (the prefill rows only)
        k: torch.Tensor,  # [Tp, HK, K]
        v: torch.Tensor,  # [Tp, HV, V]
        a: torch.Tensor,  # [Tp, HV] raw (pre-softplus) decay input
        b: torch.Tensor,  # [Tp, HV] raw (pre-sigmoid) beta input
        A_log: torch.Tensor,  # [HV]
        dt_bias: torch.Tensor,  # [HV]
        ssm_state: torch.Tensor,  # [num_slots, HV, V, K]
        meta: PrefillMetadata,
    ) -> torch.Tensor:  # [Tp, HV, V] in v's dtype
        """Run every prefill sequence from its initial state; store its final state."""


class OutputNorm(NamedTuple):
    """A GDN layer's output norm `w * norm(o) * silu(z)` per head, for a decode backend that
    runs it in the delta rule's launch (`GDNDecodeBackend.fuses_gated_norm`)."""

    z: torch.Tensor  # [N, HV, V] the output gate, unit last stride
    weight: torch.Tensor  # [V]
    eps: float


class GDNDecodeBackend(ABC):
    """The recurrence over q tokens per sequence, reading and writing `ssm_state` in place by
    slot (the state is read once, carried through the q tokens and written once).

    Every sequence has exactly q tokens (rows n * q .. n * q + q - 1) and an initial state (a
    decode continues a context). Rows whose slot is 0 (the null slot) are padding: their
    result is ignored.
    """

    name: str = "?"
    supports_cuda_graph: bool = False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [N * query_len, HK, K]
        k: torch.Tensor,  # [N * query_len, HK, K]
        v: torch.Tensor,  # [N * query_len, HV, V]
        a: torch.Tensor,  # [N * query_len, HV]
        b: torch.Tensor,  # [N * query_len, HV]
        A_log: torch.Tensor,  # [HV]
        dt_bias: torch.Tensor,  # [HV]
        ssm_state: torch.Tensor,  # [num_slots, HV, V, K]
        state_slots: torch.Tensor,  # [N] int64
        query_len: int = 1,
        norm: OutputNorm | None = None,
    ) -> torch.Tensor:  # [N * query_len, HV, V] in v's dtype
        """The gated delta rule over `query_len` tokens per sequence, in place on the pool;
        with `norm` (one token per sequence, given only to a backend that `fuses_gated_norm`)
        the layer's output norm applied in the same launch."""

    def fuses_gated_norm(self) -> bool:
        """Whether `forward` takes `norm` (no backend here unless it says so)."""
        return False


class GDNKernels:
    """The face a GDN layer sees: conv1d over the batch, then the delta rule, with decode rows
    (the first `num_decodes` sequences, `decode_query_len` tokens each: the first
    `num_decode_tokens` token rows) sent to the decode backend and the rest to the prefill
    backend. With checkpoints, an op whose backend takes them runs the step whole; any other
    runs over the step's HEAD sub-batch, copies the checkpointed rows' states to their
    snapshot rows, then runs over the TAIL sub-batch (ops/gdn/checkpoints.py)."""

    def __init__(
        self, conv1d: Conv1dBackend, prefill: GDNPrefillBackend, decode: GDNDecodeBackend
    ) -> None:
        self.conv = conv1d
        self.prefill = prefill
        self.decode = decode

    @property
    def supports_cuda_graph(self) -> bool:
        return self.conv.supports_cuda_graph and self.decode.supports_cuda_graph

    def conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        conv_state: torch.Tensor,
        meta: BatchMetadata,
    ) -> torch.Tensor:
        split = _split(meta, self.conv.takes_checkpoints)
        if split is None:
            return self.conv.forward(x, weight, conv_state, meta)
        head = self.conv.forward(split.gather_head(x), weight, conv_state, split.head)
        split.copy_state(conv_state)  # the conv state after each checkpointed row's head
        tail = self.conv.forward(split.gather_tail(x), weight, conv_state, split.tail)
        return split.merge(head, tail, x.shape[0])

    def decode_fuses_gated_norm(self, meta: BatchMetadata) -> bool:
        """Whether this step's delta rule can run the layer's output norm in its launch: a
        `one_token_decodes` step and a decode backend that fuses it."""
        return one_token_decodes(meta) and self.decode.fuses_gated_norm()

    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        ssm_state: torch.Tensor,
        meta: BatchMetadata,
        norm: OutputNorm | None = None,
    ) -> torch.Tensor:  # [T, HV, V]
        """The delta rule over the step; with `norm` (only where `decode_fuses_gated_norm`)
        the layer's output norm in the decode backend's launch."""
        if norm is not None:
            if not self.decode_fuses_gated_norm(meta):
                raise ValueError("this step's GDN decode cannot run the output norm in its launch")
            slots = meta.state_slots[: meta.num_decodes]
            return self.decode.forward(q, k, v, a, b, A_log, dt_bias, ssm_state, slots, norm=norm)
        part = meta.prefill_part() if meta.checkpoints else None
        split = _split(meta, part is not None and self.prefill.takes_checkpoints(part))
        if split is None:
            return self._delta_rule(q, k, v, a, b, A_log, dt_bias, ssm_state, meta)
        h = split.gather_head
        head = self._delta_rule(h(q), h(k), h(v), h(a), h(b), A_log, dt_bias, ssm_state, split.head)
        split.copy_state(ssm_state)  # the SSM state after each checkpointed row's head
        t = split.gather_tail
        part = split.tail.prefill_part()
        tail = self.prefill.forward(t(q), t(k), t(v), t(a), t(b), A_log, dt_bias, ssm_state, part)
        return split.merge(head, tail, q.shape[0])

    def _delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        ssm_state: torch.Tensor,
        meta: BatchMetadata,
    ) -> torch.Tensor:  # [T, HV, V]
        """Decode rows to the decode backend, the rest to the prefill backend."""
        nd, ql = meta.num_decodes, meta.decode_query_len
        part = meta.prefill_part()
        if part is None:  # all decodes (the CUDA-graph case): no copies
            return self.decode.forward(
                q, k, v, a, b, A_log, dt_bias, ssm_state, meta.state_slots[:nd], ql
            )
        nt = part.token_offset  # = num_decode_tokens: prefill token rows start here
        pre = self.prefill.forward(
            q[nt:], k[nt:], v[nt:], a[nt:], b[nt:], A_log, dt_bias, ssm_state, part
        )
        if nd == 0:
            return pre
        dec = self.decode.forward(
            q[:nt],
            k[:nt],
            v[:nt],
            a[:nt],
            b[:nt],
            A_log,
            dt_bias,
            ssm_state,
            meta.state_slots[:nd],
            ql,
        )
        return torch.cat([dec, pre], dim=0)


def one_token_decodes(meta: BatchMetadata) -> bool:
    """Whether every row of the step is a decode of one token and no checkpoint is taken: the
    steps the decode fusions serve (the conv in the in_proj's GEMV, the output norm in the
    delta rule's launch)."""
    return meta.num_prefills == 0 and meta.decode_query_len == 1 and not meta.checkpoints


def _split(meta: BatchMetadata, in_kernel: bool) -> CheckpointSplit | None:
    """The step's HEAD / TAIL split, or None when it takes no checkpoint or the op's backend
    takes them inside its kernel (which trusts them: building the prefill part, once per step,
    checks them)."""
    if not meta.checkpoints:
        return None
    if in_kernel:
        meta.prefill_part()
        return None
    return checkpoint_split(meta)
