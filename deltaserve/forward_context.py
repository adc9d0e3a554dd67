"""What a model's forward sees besides token ids and positions: the batch layout, the cache
tensors of each layer and the kernels chosen for this run.

The model runner builds one `ForwardContext` per step. Model files read it and never allocate
caches or pick kernels themselves (docs/architecture.md, "Invariants").

Batch layout: the step's tokens are flattened into one ragged batch of T tokens from B sequences.
Sequences are ordered decode rows first (each `decode_query_len` = q new tokens on top of a
non-empty context: q = 1 is a plain decode, 1 + k verifies k drafts), then prefill chunks.
Sequence b owns tokens `query_start_loc[b] : query_start_loc[b + 1]`; those tokens sit at
absolute positions `context_lens[b] .. seq_lens[b] - 1`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from deltaserve.host_copy import to_device_async

if TYPE_CHECKING:  # the interfaces import this module: names for annotations only
    from deltaserve.ops.attention import AttentionBackend
    from deltaserve.ops.fused import FusedOps
    from deltaserve.ops.gdn import GDNKernels
    from deltaserve.ops.moe import MoEBackend


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
    num_decodes: int = 0  # the first num_decodes sequences are decode rows of q tokens each
    decode_query_len: int = 1  # q: the new tokens of every decode row
    max_query_len: int = 0  # host ints for kernel grids (0: derive from the host lists)
    max_seq_len: int = 0
    # prefix-cache state snapshots taken inside this step (engine/hybrid_prefix_cache.py): per
    # checkpointed prefill row, (batch row, head tokens, destination state row): the state of
    # the row's slot after its first `head tokens` new tokens is copied to the destination row
    checkpoints: list[tuple[int, int, int]] = field(default_factory=list)
    _prefill: PrefillMetadata | None = field(default=None, repr=False)
    _checkpoint_split: Any = field(default=None, repr=False)  # ops/gdn/checkpoints.py, memo

    def __post_init__(self) -> None:
        if self.query_start_loc_cpu and not self.max_query_len:
            q = self.query_start_loc_cpu
            self.max_query_len = max((b - a for a, b in zip(q, q[1:])), default=0)
        if self.seq_lens_cpu and not self.max_seq_len:
            self.max_seq_len = max(self.seq_lens_cpu)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes

    @property
    def num_decode_tokens(self) -> int:
        """Token rows of the decode part (decode row b owns rows b*q .. b*q + q - 1)."""
        return self.num_decodes * self.decode_query_len

    def check_checkpoints(self) -> None:
        """Raise ValueError naming a checkpoint that is not (prefill row, 0 < head < its new
        tokens), or a row with two."""
        qsl = self.query_start_loc_cpu
        rows = [b for b, _, _ in self.checkpoints]
        if len(set(rows)) != len(rows):
            raise ValueError(f"one checkpoint per row, got {self.checkpoints}")
        for b, h, _ in self.checkpoints:
            if b < self.num_decodes or b >= self.num_seqs or not 0 < h < qsl[b + 1] - qsl[b]:
                new = qsl[b + 1] - qsl[b] if 0 <= b < self.num_seqs else 0
                raise ValueError(
                    f"checkpoint of batch row {b} after {h} tokens: it must be a prefill row "
                    f"(rows {self.num_decodes}..) and 0 < head < its {new} new tokens"
                )

    def prefill_part(self) -> PrefillMetadata | None:
        """The prefill sequences (after the decodes), or None when the batch is all decodes.
        Built once per step; the step's checkpoints are checked then (`check_checkpoints`)."""
        if self._prefill is None and self.checkpoints:
            self.check_checkpoints()
        if self.num_prefills <= 0:
            return None
        if self._prefill is None:
            nd = self.num_decodes
            nt = self.num_decode_tokens  # prefill tokens start at row nd * q
            qsl_cpu = [x - nt for x in self.query_start_loc_cpu[nd:]]
            heads, rows = [0] * (self.num_seqs - nd), [0] * (self.num_seqs - nd)
            for b, head, row in self.checkpoints:
                heads[b - nd], rows[b - nd] = head, row
            self._prefill = PrefillMetadata(
                token_offset=nt,
                query_start_loc=self.query_start_loc[nd:] - nt,
                seq_lens=self.seq_lens[nd:],
                context_lens=self.context_lens[nd:],
                state_slots=self.state_slots[nd:],
                has_initial_state=self.has_initial_state[nd:],
                query_start_loc_cpu=qsl_cpu,
                context_lens_cpu=self.context_lens_cpu[nd:],
                state_slots_cpu=self.state_slots_cpu[nd:],
                max_query_len=max(b - a for a, b in zip(qsl_cpu, qsl_cpu[1:])),
                checkpoint_heads_cpu=heads if self.checkpoints else [],
                checkpoint_rows_cpu=rows if self.checkpoints else [],
            )
        return self._prefill


@dataclass
class PrefillMetadata:
    """The prefill part of a batch: sequences `num_decodes ..` of the full batch, whose tokens are
    rows `token_offset ..` of the step's token dimension. Offsets here are relative to that row."""

    token_offset: int
    query_start_loc: torch.Tensor  # [P + 1] int32, starts at 0
    seq_lens: torch.Tensor  # [P] int32
    context_lens: torch.Tensor  # [P] int32
    state_slots: torch.Tensor  # [P] int64
    has_initial_state: torch.Tensor  # [P] bool
    query_start_loc_cpu: list[int]
    context_lens_cpu: list[int]
    state_slots_cpu: list[int]
    max_query_len: int
    # in-step state snapshots (BatchMetadata.checkpoints), per prefill row: head tokens (0:
    # none) and destination state row; empty when the step takes none. The GDN face
    # (ops/gdn/__init__.py) hands them to backends that take them inside their kernels
    # (`takes_checkpoints`) and runs them as two sub-batches for the others.
    checkpoint_heads_cpu: list[int] = field(default_factory=list)
    checkpoint_rows_cpu: list[int] = field(default_factory=list)
    _checkpoint_dev: Any = field(default=None, repr=False)  # memo of checkpoint_tensors()

    @property
    def num_seqs(self) -> int:
        return len(self.state_slots_cpu)

    def checkpoint_tensors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The checkpoints on the device, (heads [P] int64, destination rows [P] int64), built
        with one host-to-device copy on the first call and reused by every layer of the step;
        None when the step takes none."""
        if not self.checkpoint_heads_cpu:
            return None
        if self._checkpoint_dev is None:
            host = torch.tensor(
                self.checkpoint_heads_cpu + self.checkpoint_rows_cpu, dtype=torch.int64
            )
            packed = to_device_async(host, self.state_slots.device)
            self._checkpoint_dev = torch.split(packed, self.num_seqs)
        return self._checkpoint_dev


# Cache tensors of one layer by name, as its spec declares them (deltaserve.cache.spec):
# attention "k_cache" / "v_cache" [num_blocks, block_size, num_kv_heads, head_dim]; GDN
# "ssm_state" [num_slots, HV, V, K] ("K-last") and "conv_state" [num_slots, conv_dim, kernel - 1].
LayerCache = dict[str, torch.Tensor]


@dataclass
class Kernels:
    """The kernel implementations chosen at start-up (see deltaserve.backends); None where the
    model has no layer of that kind."""

    attention: AttentionBackend | None = None
    gdn: GDNKernels | None = None  # conv1d + prefill + decode backends behind one face
    fused: FusedOps = field(default_factory=lambda: _torch_fused())
    moe: MoEBackend | None = None  # routed experts of MoE feed-forward layers
    mla: Any = None  # MLABackend (deltaserve.ops.mla) of latent-attention layers


def _torch_fused() -> FusedOps:
    """The reference fused ops (the default when no backend was chosen, e.g. in tests)."""
    from deltaserve.ops.fused import TorchFusedOps

    return TorchFusedOps()


@dataclass
class ForwardContext:
    """Everything a model's forward needs beyond input ids and positions."""

    meta: BatchMetadata
    caches: list[LayerCache]  # indexed by decoder-layer index
    kernels: Kernels
    # per-step values shared by layers (e.g. rotary cos / sin of the step's positions)
    memo: dict[Any, Any] = field(default_factory=dict)
    # decoder layers whose output hidden states the caller wants beside the last one (a drafter
    # reads the target's); the model stores each as hidden_states[layer index] [T, hidden]
    hidden_layers: tuple[int, ...] = ()
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)
    # a speculative verify step on a model with GDN layers: where each GDN layer saves its
    # pre-verify states and the draft rows' inputs (deltaserve.spec.gdn_rollback)
    spec_verify: Any = None
    # image embeddings that replace the input embeddings of placeholder tokens this step:
    # (token rows [N] int64, embeddings [N, hidden]) on the device, or None
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # the step's real tokens when the forward runs over more rows (engine/row_buckets.py: the
    # rows after them are padding), else None. Mixers hand only the real rows to kernels that
    # read the batch layout or touch caches, and return every row (`token_rows`, `pad_rows`).
    num_tokens: int | None = None

    def token_rows(self, rows: int) -> int:
        """How many of a forward's `rows` rows are the step's tokens (the rest are padding)."""
        return rows if self.num_tokens is None else self.num_tokens

    def padded_out(self, rows: int, like: torch.Tensor) -> torch.Tensor | None:
        """A zeroed [rows, *like.shape[1:]] buffer for a kernel to write its first
        `token_rows(rows)` rows into (`out=buffer[:T]`), or None when there is no padding."""
        if self.token_rows(rows) == rows:
            return None
        return like.new_zeros((rows, *like.shape[1:]))

    def pad_rows(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """x [T, ...] extended with zero rows to [rows, ...] (x itself when T == rows)."""
        if x.shape[0] == rows:
            return x
        out = x.new_zeros((rows, *x.shape[1:]))
        out[: x.shape[0]].copy_(x)
        return out
