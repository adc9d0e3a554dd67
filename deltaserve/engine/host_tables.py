"""Host copies of per-sequence block tables, kept in step with `Sequence.block_ids`.

Rebuilding a [B, max_blocks] table from Python lists every step costs O(B x blocks) Python work
(256 sequences at 8k tokens: 131k list items, milliseconds per step). A sequence's block list
only grows by appends until it is freed and replaced by a new list, so each sequence keeps an
int64 tensor that is extended with the new entries only, and the batch table is one
`pad_sequence` over those tensors.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from deltaserve.engine.sequence import Sequence


class _HostRow:
    __slots__ = ("source", "data", "length")

    def __init__(self, source: list[int]) -> None:
        self.source = source  # the Sequence.block_ids list this row mirrors (by identity)
        self.data = torch.empty(max(16, 2 * len(source)), dtype=torch.int64)
        self.length = 0


def block_table_row(seq: Sequence) -> torch.Tensor:
    """seq.block_ids as an int64 host tensor (a view; valid until the next call for seq)."""
    ids = seq.block_ids
    row: _HostRow | None = seq.host_block_table
    if row is None or row.source is not ids or row.length > len(ids):
        row = seq.host_block_table = _HostRow(ids)
    if row.length < len(ids):
        if len(ids) > row.data.numel():
            grown = torch.empty(2 * len(ids), dtype=torch.int64)
            grown[: row.length] = row.data[: row.length]
            row.data = grown
        row.data[row.length : len(ids)] = torch.tensor(ids[row.length :], dtype=torch.int64)
        row.length = len(ids)
    return row.data[: row.length]


def batch_block_table(seqs: list[Sequence]) -> torch.Tensor:
    """[B, max blocks] int64 host tensor, rows padded with block 0 (the null block)."""
    rows = [block_table_row(s) for s in seqs]
    if not rows or max(r.numel() for r in rows) == 0:
        return torch.zeros(len(rows), 0, dtype=torch.int64)
    return pad_sequence(rows, batch_first=True, padding_value=0)
