"""Step preparation: scheduler decisions -> one step's forward in host form -> device tensors.

Rank 0 builds a `StepInput` from the scheduled batch and, under tensor parallelism, broadcasts
it (host lists, plus the block table and slot mapping as small host tensors); every rank turns
it into the same device tensors and metadata. Block and slot ids are decided by rank 0's block
manager and state pool and mean the same on every rank: each rank's caches hold its own heads at
the same indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaserve.engine.host_tables import batch_block_table
from deltaserve.engine.prefix_cache import StateCheckpoint
from deltaserve.engine.scheduler import ScheduledBatch
from deltaserve.engine.sequence import Sequence
from deltaserve.forward_context import BatchMetadata

PLACEHOLDER = -1  # the host's id for a token still pending on the device (engine/async_step.py)


@dataclass
class StepInput:
    """Token ids, positions and batch layout of one step (decode rows first: `num_decodes` rows
    of `decode_query_len` tokens each), and which hidden rows need logits, group by group (each
    group is one lm_head call on every rank)."""

    token_ids: list[int]
    positions: list[int]
    slot_mapping: torch.Tensor  # [T] int64 host: KV-cache slot per token ([0] w/o attention)
    query_start_loc: list[int]
    seq_lens: list[int]
    context_lens: list[int]
    state_slots: list[int]
    block_tables: torch.Tensor  # [B, W] int64 host, rows padded with the null block 0
    num_decodes: int
    decode_query_len: int = 1
    logits_rows: list[range | list[int]] = field(default_factory=list)
    # Overlapped decode (engine/async_step.py): per token, the row of the previous step's
    # sampled ids that holds it (the host has only a PLACEHOLDER for it), or -1.
    prev_rows: list[int] | None = None
    # the batch's cache operations (cache/ops.py), for the other tensor-parallel ranks to apply
    # before the forward as rank 0 did
    cache_ops: list = field(default_factory=list)
    # tensor parallelism: the decode-graph bucket rank 0 replays for this step (q =
    # decode_query_len), which every rank must replay too, or None (eager)
    graph_bucket: int | None = None
    # tensor parallelism, overlapped decode: rank 0 broadcasts this step's sampled ids on the
    # device group after it; the next step's pending tokens (`prev_rows`) index into them
    shares_sampled_ids: bool = False
    # rotary positions where they differ from `positions` (the token indices, which place the
    # K/V): [T] (image requests past their images: index + M-RoPE delta) or [3][T] (M-RoPE
    # temporal, height, width, when some token of the step is an image token); None: same
    rope_positions: list[int] | list[list[int]] | None = None
    # prefix-cache state snapshots taken inside the step: (batch row, head tokens, destination
    # state row) per checkpointed prefill row (BatchMetadata.checkpoints)
    checkpoints: list[tuple[int, int, int]] = field(default_factory=list)

    # NOTE: under TP rank 0 pickles a StepInput for the other ranks every step. torch's own
    # pickling of the two small host tensors cost 200-600 us to dump and ~300 us to load (of a
    # 0.6-1 ms control message on an H200 host); as raw bytes both take 19-37 us.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for name in _HOST_TENSORS:
            t = state[name]
            state[name] = (t.numpy().tobytes(), str(t.dtype).removeprefix("torch."), t.shape)
        return state

    def __setstate__(self, state: dict) -> None:
        for name in _HOST_TENSORS:
            raw, dtype, shape = state[name]
            dtype = getattr(torch, dtype)
            state[name] = (
                torch.frombuffer(bytearray(raw), dtype=dtype).view(shape)
                if raw
                else torch.empty(shape, dtype=dtype)
            )
        self.__dict__.update(state)


_HOST_TENSORS = ("slot_mapping", "block_tables")  # StepInput's host tensors


def is_decode_row(row: tuple[Sequence, int]) -> bool:
    """A decode row continues a computed context with one new token plus its drafts, if any
    (valid before `Scheduler.advance`)."""
    seq, n = row
    return ScheduledBatch.is_decode(seq, n, getattr(row, "num_draft", None))


def leading_decodes(items: list[tuple[Sequence, int]]) -> tuple[int, int]:
    """(num_decodes, q): the leading decode rows that share one query length q (the batch is
    ordered decodes first, grouped by q). Later rows run through the prefill kernels, which
    serve any row."""
    nd, q = 0, 1
    for row in items:
        if not is_decode_row(row) or (nd and row[1] != q):
            break
        q = row[1]
        nd += 1
    return nd, q


def step_checkpoints(
    items: list[tuple[Sequence, int]], checkpoints: dict[int, StateCheckpoint]
) -> list[tuple[int, int, int]]:
    """The batch's checkpoints (seq_id -> StateCheckpoint) as (batch row, head tokens,
    destination state row), rows in the order of `items` (the kernel order)."""
    if not checkpoints:
        return []
    rows = []
    for b, (seq, _) in enumerate(items):
        ck = checkpoints.get(seq.seq_id)
        if ck is not None:
            rows.append((b, ck.num_tokens, ck.row))
    return rows


def build_step_input(
    items: list[tuple[Sequence, int]], block_size: int, has_attention: bool
) -> StepInput:
    """The host side of a batch of (sequence, new tokens), in the given (kernel) order, in
    O(B + new tokens) Python work: block tables come from the sequences' host rows
    (engine/host_tables.py) and the slot mapping is computed on host tensors. Tokens still
    pending on the device are staged as PLACEHOLDER."""
    ids: list[int] = []
    positions: list[int] = []
    rope = _RopePositions()
    qsl = [0]
    seq_lens, ctx_lens, state_slots = [], [], []
    rows: list[int] = []  # [T]: each token's batch row
    for b, (seq, n) in enumerate(items):
        c = seq.num_computed_tokens
        known = seq.token_ids[c : c + n]
        ids.extend(known)
        if len(known) < n:  # the newest tokens are pending on the device
            ids.extend([PLACEHOLDER] * (n - len(known)))
        positions.extend(range(c, c + n))
        rows.extend([b] * n)
        rope.add(seq, c, n)
        qsl.append(qsl[-1] + n)
        seq_lens.append(c + n)
        ctx_lens.append(c)
        state_slots.append(seq.state_slot)
    B, bs = len(items), block_size
    if has_attention:
        table = batch_block_table([seq for seq, _ in items])  # [B, W] int64, host
        pos = torch.tensor(positions, dtype=torch.int64)  # [T]
        # NOTE: not torch.repeat_interleave: 0.1-6 ms per call on the host (torch 2.11-2.13)
        row = torch.tensor(rows, dtype=torch.int64)  # [T]
        slots = table[row, pos // bs] * bs + pos % bs  # [T]
    else:
        table = torch.zeros(B, 0, dtype=torch.int64)
        slots = torch.zeros(0, dtype=torch.int64)
    num_decodes, q = leading_decodes(items)
    return StepInput(
        token_ids=ids,
        positions=positions,
        slot_mapping=slots,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        context_lens=ctx_lens,
        state_slots=state_slots,
        block_tables=table,
        num_decodes=num_decodes,
        decode_query_len=q,
        rope_positions=rope.result(),
    )


class _RopePositions:
    """The step's rotary positions, row by row: None while every row is plain text (they equal
    the token indices), a list [T] when image requests shift them, three lists [3][T] once some
    token needs M-RoPE's distinct axes (the other rows repeated on the three axes)."""

    def __init__(self) -> None:
        self.rows: list = []
        self.shifted = False

    def add(self, seq: Sequence, c: int, n: int) -> None:
        mm = getattr(seq, "mm", None)
        if mm is None:
            self.rows.append(range(c, c + n))
        else:
            self.shifted = True
            self.rows.append(mm.rope_positions(c, n))

    @staticmethod
    def _is_3d(row) -> bool:
        return isinstance(row, list) and bool(row) and isinstance(row[0], list)

    def result(self) -> list[int] | list[list[int]] | None:
        if not self.shifted:
            return None
        if not any(self._is_3d(r) for r in self.rows):
            return [p for r in self.rows for p in r]
        axes: list[list[int]] = [[], [], []]
        for r in self.rows:
            for a in range(3):
                axes[a].extend(r[a] if self._is_3d(r) else r)
        return axes


class BatchStager:
    """Turns a `StepInput` into device tensors with one host-to-device copy: the fields are
    packed into a reusable int64 staging buffer (pinned on CUDA) and split on the device (int64
    on the host, narrowed to int32 on the device where the kernels want int32)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._staging: torch.Tensor | None = None
        self._staged: torch.cuda.Event | None = None

    def _host_buffer(self, n: int) -> torch.Tensor:
        """The staging buffer, at least n long. Before it is refilled, the previous step's
        asynchronous copy out of it must have finished (a step that samples nothing never
        syncs the device)."""
        if self._staged is not None:
            self._staged.synchronize()
        buf = self._staging
        if buf is None or buf.numel() < n:
            size = max(n, 2 * (buf.numel() if buf is not None else 4096))
            pin = self.device.type == "cuda"
            buf = self._staging = torch.empty(size, dtype=torch.int64, pin_memory=pin)
        return buf

    def tensors(
        self, step: StepInput, prev_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, BatchMetadata]:
        """input_ids [T], positions [T] and the batch metadata on the device. With
        `step.prev_rows`, tokens still unknown on the host are taken from `prev_ids` (the
        previous step's sampled ids, on the device)."""
        table, slots = step.block_tables, step.slot_mapping
        B, T = len(step.seq_lens), len(step.token_ids)
        width = table.shape[1]
        small = (
            step.token_ids
            + step.positions
            + step.state_slots
            + step.query_start_loc
            + step.seq_lens
            + step.context_lens
        )
        sizes = [T, T, B, B + 1, B, B, slots.numel(), B * width]
        if step.prev_rows is not None:
            sizes.append(T)  # packed last
        total = sum(sizes)
        host = self._host_buffer(total)
        n_small = len(small)
        host[:n_small] = torch.tensor(small, dtype=torch.int64)
        host[n_small : n_small + slots.numel()] = slots
        end = n_small + slots.numel() + table.numel()
        host[n_small + slots.numel() : end] = table.reshape(-1)
        if step.prev_rows is not None:
            host[end:total] = torch.tensor(step.prev_rows, dtype=torch.int64)
        dev = host[:total].to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()
        ids_t, pos_t, state_t, qsl_t, sl_t, ctx_t, slot_t, bt_t, *rest = torch.split(dev, sizes)
        if rest:
            if prev_ids is None:
                raise ValueError("step.prev_rows needs the previous step's sampled ids")
            rows = rest[0]  # [T], -1 where the host knows the token
            ids_t = torch.where(rows >= 0, prev_ids[rows.clamp(min=0)], ids_t)
        if step.rope_positions is not None:  # image requests: [T] or M-RoPE [3, T]
            pos_t = torch.tensor(step.rope_positions, dtype=torch.int64).to(self.device)
        ctx_i32 = ctx_t.to(torch.int32)
        meta = BatchMetadata(
            slot_mapping=slot_t,
            query_start_loc=qsl_t.to(torch.int32),
            seq_lens=sl_t.to(torch.int32),
            context_lens=ctx_i32,
            block_tables=bt_t.to(torch.int32).view(B, width),
            state_slots=state_t,
            has_initial_state=ctx_i32 > 0,
            query_start_loc_cpu=step.query_start_loc,
            seq_lens_cpu=step.seq_lens,
            context_lens_cpu=step.context_lens,
            state_slots_cpu=step.state_slots,
            num_decodes=step.num_decodes,
            decode_query_len=step.decode_query_len,
            checkpoints=step.checkpoints,
        )
        return ids_t, pos_t, meta


def select_rows(hidden: torch.Tensor, rows: range | list[int]) -> torch.Tensor:
    """hidden[rows] (a view for a range)."""
    if isinstance(rows, range) and rows.step == 1:
        return hidden[rows.start : rows.stop]
    return hidden[list(rows)]
