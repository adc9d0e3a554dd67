"""Host block tables follow Sequence.block_ids through appends, frees and re-allocation."""

import torch

from deltaserve.engine.host_tables import batch_block_table, block_table_row
from deltaserve.engine.sequence import Sequence
from deltaserve.sampling_params import SamplingParams


def _seq(blocks: list[int]) -> Sequence:
    seq = Sequence("r", 0, [1, 2, 3], SamplingParams())
    seq.block_ids = list(blocks)
    return seq


def test_rows_follow_appends_growth_and_reallocation():
    seq = _seq([5, 9])
    assert block_table_row(seq).tolist() == [5, 9]
    for b in range(40):  # past the initial capacity: the row grows
        seq.block_ids.append(100 + b)
        assert block_table_row(seq).tolist() == seq.block_ids
    seq.block_ids = []  # freed (preempted): a new, empty list
    assert block_table_row(seq).tolist() == []
    seq.block_ids.extend([3, 4, 7])  # re-allocated from scratch
    assert block_table_row(seq).tolist() == [3, 4, 7]


def test_batch_table_pads_with_the_null_block():
    seqs = [_seq([1, 2, 3]), _seq([]), _seq([8])]
    table = batch_block_table(seqs)
    assert table.dtype == torch.int64
    assert table.tolist() == [[1, 2, 3], [0, 0, 0], [8, 0, 0]]
    seqs[1].block_ids.extend([6, 6, 6, 6])
    assert batch_block_table(seqs).tolist() == [[1, 2, 3, 0], [6, 6, 6, 6], [8, 0, 0, 0]]
    assert batch_block_table([_seq([])]).shape == (1, 0)
