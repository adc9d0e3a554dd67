"""In-step recurrent-state snapshots: a step's GDN ops as a HEAD and a TAIL sub-batch, for the
backends that cannot take them inside their kernels.

A prefix-cache snapshot needs the state of a sequence's slot at a block boundary `t` inside
the step's prefill chunk [start, start + n) (engine/hybrid_prefix_cache.py). The step carries
it as a checkpoint `(batch row, h = t - start, destination state row)`
(`BatchMetadata.checkpoints`), and the GDN face (`GDNKernels`) runs each of its two ops as:

1. HEAD: every row of the step, each checkpointed row cut to its first h tokens (decode rows
   and the other prefill rows whole);
2. the copy `state[destination rows] = state[slots of the checkpointed rows]` (index ops on the
   device, no host sync): the slot now holds the state after h tokens, the boundary's;
3. TAIL: the checkpointed rows' remaining n - h tokens, continuing from their slots.

A backend whose kernel stores the snapshot itself (`takes_checkpoints`: the Triton conv and
the token-by-token Triton prefill) gets the checkpoints on the step's prefill metadata instead
(`PrefillMetadata.checkpoint_tensors`) and runs the step whole: no gathers, no second launch.
Otherwise the backends are called through their unchanged interfaces, on sub-batch metadata
built here once per step from the step's metadata (memoised on it) and reused by every GDN
layer: per layer there is nothing on the host but the calls. The sub-batches' token rows are
gathered from the step's rows and their outputs put back at the same rows (plain slices when
the head is the step's first rows and the tail the rest, e.g. one checkpointed row that comes
last).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.forward_context import BatchMetadata
from deltaserve.host_copy import to_device_async


@dataclass
class CheckpointSplit:
    """The HEAD and TAIL sub-batches of a step with checkpoints (see the module docstring)."""

    head: BatchMetadata  # every row; checkpointed rows cut to their head tokens
    tail: BatchMetadata  # the checkpointed rows' remaining tokens (no decode rows)
    head_rows: slice | torch.Tensor  # the step's token rows of the head's tokens, in order
    tail_rows: slice | torch.Tensor  # ... of the tail's tokens
    num_tokens: int  # token rows the step's sequences own (rows past them are zero)
    src_slots: torch.Tensor  # [C] int64: the checkpointed rows' state slots
    dst_rows: torch.Tensor  # [C] int64: where their state after the head goes

    def gather_head(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] -> the head's rows [Th, ...]."""
        return _rows(x, self.head_rows)

    def gather_tail(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] -> the tail's rows [Tt, ...]."""
        return _rows(x, self.tail_rows)

    def copy_state(self, state: torch.Tensor) -> None:
        """state[dst_rows] <- state[src_slots] (a state pool [rows, ...], in place)."""
        state.index_copy_(0, self.dst_rows, state.index_select(0, self.src_slots))

    def merge(self, head: torch.Tensor, tail: torch.Tensor, num_rows: int) -> torch.Tensor:
        """The head's [Th, ...] and the tail's [Tt, ...] outputs at their rows of the step's
        [num_rows, ...] (rows past `num_tokens`, padding, are zero)."""
        if isinstance(self.head_rows, slice):
            parts = [head, tail]
            if num_rows > self.num_tokens:
                parts.append(head.new_zeros(num_rows - self.num_tokens, *head.shape[1:]))
            return torch.cat(parts)
        shape = (num_rows, *head.shape[1:])
        out = head.new_zeros(shape) if num_rows > self.num_tokens else head.new_empty(shape)
        out.index_copy_(0, self.head_rows, head)
        out.index_copy_(0, self.tail_rows, tail)
        return out


def _rows(x: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def checkpoint_split(meta: BatchMetadata) -> CheckpointSplit | None:
    """The step's split (built on the first call, then memoised on `meta`), or None when the
    step takes no checkpoint."""
    if not meta.checkpoints:
        return None
    if meta._checkpoint_split is None:
        meta._checkpoint_split = _build(meta)
    return meta._checkpoint_split


def _build(meta: BatchMetadata) -> CheckpointSplit:
    meta.check_checkpoints()
    qsl, B = meta.query_start_loc_cpu, meta.num_seqs
    checkpoints = {b: (h, row) for b, h, row in meta.checkpoints}
    head_qsl, head_seq_lens, head_ranges = [0], [], []
    tail_qsl, tail_seq_lens, tail_ctx, tail_ranges = [0], [], [], []
    batch_rows, src, dst = [], [], []
    for b in range(B):
        start, end = qsl[b], qsl[b + 1]
        ctx = meta.context_lens_cpu[b]
        if b not in checkpoints:
            head_qsl.append(head_qsl[-1] + end - start)
            head_seq_lens.append(meta.seq_lens_cpu[b])
            head_ranges.append((start, end))
            continue
        h, row = checkpoints[b]
        head_qsl.append(head_qsl[-1] + h)
        head_seq_lens.append(ctx + h)
        head_ranges.append((start, start + h))
        tail_qsl.append(tail_qsl[-1] + end - start - h)
        tail_seq_lens.append(meta.seq_lens_cpu[b])
        tail_ctx.append(ctx + h)
        tail_ranges.append((start + h, end))
        batch_rows.append(b)
        src.append(meta.state_slots_cpu[b])
        dst.append(row)
    num_tokens, num_head = qsl[-1], head_qsl[-1]
    # NOTE: contiguous when the head's ranges tile [0, Th) and the tail's [Th, T) in order
    spans = head_ranges + tail_ranges
    contiguous = all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and spans[0][0] == 0
    ints = head_qsl + head_seq_lens + tail_qsl + tail_seq_lens + tail_ctx + batch_rows + src + dst
    parts = [torch.tensor(ints, dtype=torch.int64)]
    sizes = [B + 1, B, len(tail_qsl), *[len(src)] * 5]
    if not contiguous:  # the token index maps: [Th] and [Tt]
        for ranges in (head_ranges, tail_ranges):
            parts += [torch.arange(a, b, dtype=torch.int64) for a, b in ranges]
            sizes.append(sum(b - a for a, b in ranges))
    device = meta.query_start_loc.device
    dev = to_device_async(torch.cat(parts), device)  # one host-to-device copy
    h_qsl, h_sl, t_qsl, t_sl, t_ctx, t_b, src_t, dst_t, *index = torch.split(dev, sizes)
    if contiguous:
        head_rows: slice | torch.Tensor = slice(0, num_head)
        tail_rows: slice | torch.Tensor = slice(num_head, num_tokens)
    else:
        head_rows, tail_rows = index
    has_slots = meta.slot_mapping.numel() >= num_tokens > 0  # attention layers' KV slots
    t_ctx32 = t_ctx.to(torch.int32)
    head = BatchMetadata(
        slot_mapping=_rows(meta.slot_mapping, head_rows) if has_slots else meta.slot_mapping,
        query_start_loc=h_qsl.to(torch.int32),
        seq_lens=h_sl.to(torch.int32),
        context_lens=meta.context_lens,
        block_tables=meta.block_tables,
        state_slots=meta.state_slots,
        has_initial_state=meta.has_initial_state,
        query_start_loc_cpu=head_qsl,
        seq_lens_cpu=head_seq_lens,
        context_lens_cpu=meta.context_lens_cpu,
        state_slots_cpu=meta.state_slots_cpu,
        num_decodes=meta.num_decodes,
        decode_query_len=meta.decode_query_len,
    )
    tail = BatchMetadata(
        slot_mapping=_rows(meta.slot_mapping, tail_rows) if has_slots else meta.slot_mapping,
        query_start_loc=t_qsl.to(torch.int32),
        seq_lens=t_sl.to(torch.int32),
        context_lens=t_ctx32,
        block_tables=meta.block_tables.index_select(0, t_b),
        state_slots=src_t,
        has_initial_state=t_ctx32 > 0,  # every tail continues its head
        query_start_loc_cpu=tail_qsl,
        seq_lens_cpu=tail_seq_lens,
        context_lens_cpu=tail_ctx,
        state_slots_cpu=src,
        num_decodes=0,
    )
    return CheckpointSplit(head, tail, head_rows, tail_rows, num_tokens, src_t, dst_t)
