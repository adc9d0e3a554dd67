"""Step preparation on the CPU: scheduled rows -> host step -> device tensors and metadata, and
the padding of CUDA-graph static metadata (the buffers and host lists a graph replays with)."""

from __future__ import annotations

import torch

from deltaserve.engine.cuda_graph import DecodeGraphs
from deltaserve.engine.sequence import Sequence
from deltaserve.engine.step_prep import (
    PLACEHOLDER,
    BatchStager,
    build_step_input,
    leading_decodes,
)
from deltaserve.sampling_params import SamplingParams

BS = 4  # block size


def seq(tokens: list[int], computed: int, blocks: list[int], slot: int, drafts: int = 0):
    s = Sequence("r", 0, tokens, SamplingParams())
    s.num_computed_tokens = computed
    s.block_ids = list(blocks)
    s.state_slot = slot
    s.num_draft_tokens = drafts
    return s


class Row(tuple):
    """A scheduled row as the scheduler hands it: (seq, num_new) plus its drafts."""

    def __new__(cls, s: Sequence, n: int):
        row = super().__new__(cls, (s, n))
        # the drafts among the row's tokens (the last num_draft_tokens of the sequence)
        row.num_draft = max(0, s.num_computed_tokens + n - (s.num_tokens - s.num_draft_tokens))
        return row


def test_build_step_input_layout_and_slots():
    d1 = seq(list(range(10, 16)), 5, [7, 3], 2)  # decode: token 15 at position 5
    d2 = seq(list(range(20, 29)), 8, [1, 9, 4], 5)  # decode at position 8 (block 4, offset 0)
    p = seq(list(range(30, 37)), 2, [6, 8], 1)  # prefill chunk of 5: positions 2..6
    step = build_step_input([Row(d1, 1), Row(d2, 1), Row(p, 5)], BS, True)
    assert step.token_ids == [15, 28, 32, 33, 34, 35, 36]
    assert step.positions == [5, 8, 2, 3, 4, 5, 6]
    assert step.query_start_loc == [0, 1, 2, 7]
    assert step.seq_lens == [6, 9, 7] and step.context_lens == [5, 8, 2]
    assert step.state_slots == [2, 5, 1]
    assert (step.num_decodes, step.decode_query_len) == (2, 1)
    # slot = block_table[pos // BS] * BS + pos % BS
    want = [3 * BS + 1, 4 * BS + 0, 6 * BS + 2, 6 * BS + 3, 8 * BS + 0, 8 * BS + 1, 8 * BS + 2]
    assert step.slot_mapping.tolist() == want
    assert step.block_tables.tolist() == [[7, 3, 0], [1, 9, 4], [6, 8, 0]]


def test_rows_of_q_tokens_and_the_decode_part():
    a = seq(list(range(10, 20)), 6, [1, 2, 3], 1, drafts=3)  # q = 4: 1 + 3 drafts
    b = seq(list(range(20, 30)), 6, [4, 5, 6], 2, drafts=3)
    c = seq(list(range(30, 38)), 7, [7, 8], 3)  # a plain decode: q = 1, after the q = 4 rows
    rows = [Row(a, 4), Row(b, 4), Row(c, 1)]
    assert leading_decodes(rows) == (2, 4)
    step = build_step_input(rows, BS, True)
    assert step.token_ids == [16, 17, 18, 19, 26, 27, 28, 29, 37]
    assert (step.num_decodes, step.decode_query_len) == (2, 4)
    _, _, meta = BatchStager(torch.device("cpu")).tensors(step)
    assert meta.num_decode_tokens == 8
    part = meta.prefill_part()
    assert part.token_offset == 8 and part.query_start_loc.tolist() == [0, 1]
    # a row whose drafts were not all scheduled is no decode row
    assert leading_decodes([Row(seq(list(range(9)), 4, [1, 2, 3], 1, drafts=3), 2)]) == (0, 1)


def test_stager_tensors_match_the_host_step_and_fill_pending_tokens():
    a = seq([1, 2, 3, 4], 4, [5, 6], 1)
    a.num_pending_tokens = 1  # its newest token is still on the device
    b = seq([7, 8, 9], 2, [2], 3)  # its token 9 is known
    step = build_step_input([Row(a, 1), Row(b, 1)], BS, True)
    assert step.token_ids == [PLACEHOLDER, 9]
    step.prev_rows = [1, -1]  # a's token is row 1 of the previous step's sampled ids
    stager = BatchStager(torch.device("cpu"))
    prev_ids = torch.tensor([50, 51, 52])
    ids, pos, meta = stager.tensors(step, prev_ids)
    assert ids.tolist() == [51, 9] and pos.tolist() == [4, 2]
    assert meta.slot_mapping.tolist() == step.slot_mapping.tolist()
    assert meta.query_start_loc.dtype == torch.int32 and meta.query_start_loc.tolist() == [0, 1, 2]
    assert meta.seq_lens.tolist() == [5, 3] and meta.context_lens.tolist() == [4, 2]
    assert meta.block_tables.tolist() == [[5, 6], [2, 0]]
    assert meta.state_slots.tolist() == [1, 3]
    assert meta.has_initial_state.tolist() == [True, True]
    assert meta.num_decodes == 2 and meta.max_query_len == 1 and meta.max_seq_len == 5
    # the staging buffer is reused: a smaller second step reads only its own values
    ids2, _, meta2 = stager.tensors(build_step_input([Row(b, 1)], BS, True))
    assert ids2.tolist() == [9] and meta2.block_tables.tolist() == [[2]]


def test_graph_static_metadata_pads_rows_to_the_null_block_and_slot():
    graphs = DecodeGraphs(None, None, 8, 3, torch.device("cpu"), query_lens=(1, 3))
    assert graphs.buckets == [1, 2, 4, 8]
    assert graphs.bucket(3, 3) == 4 and graphs.bucket(3, 2) is None and graphs.bucket(9) is None
    # poison the buffers, as a previous larger step would leave them
    for t in (graphs.slot_mapping, graphs.context_lens, graphs.block_tables, graphs.state_slots):
        t.fill_(77)
    a = seq(list(range(10, 20)), 7, [1, 2, 3], 4, drafts=2)
    b = seq(list(range(20, 30)), 7, [5, 6, 7], 6, drafts=2)
    c = seq(list(range(30, 40)), 7, [8, 9, 2], 1, drafts=2)
    step = build_step_input([Row(a, 3), Row(b, 3), Row(c, 3)], BS, True)
    ids, pos, meta = BatchStager(torch.device("cpu")).tensors(step)
    bs = graphs.stage(ids, pos, meta)
    assert bs == 4
    assert graphs.input_ids[:9].tolist() == step.token_ids
    assert graphs.slot_mapping[:9].tolist() == step.slot_mapping.tolist()
    assert graphs.slot_mapping[9:12].tolist() == [0, 0, 0]  # padding writes the null block
    assert graphs.seq_lens[:4].tolist() == [10, 10, 10, 3]  # padding reads q keys
    assert graphs.context_lens[:4].tolist() == [7, 7, 7, 0]
    assert graphs.block_tables[3, 0].item() == 0 and graphs.state_slots[:4].tolist() == [4, 6, 1, 0]
    assert graphs.query_start_loc[:5].tolist() == [0, 3, 6, 9, 12]
    static = graphs.static_meta(bs, 3, meta)
    assert static.seq_lens_cpu == [10, 10, 10, 3]
    assert static.context_lens_cpu == [7, 7, 7, 0] and static.state_slots_cpu == [4, 6, 1, 0]
    assert static.query_start_loc_cpu == [0, 3, 6, 9, 12]
    assert (static.num_decodes, static.decode_query_len, static.max_query_len) == (4, 3, 3)
    assert static.slot_mapping.shape[0] == 12 and static.num_decode_tokens == 12


def test_step_input_pickles_its_host_tensors_as_bytes() -> None:
    """What rank 0 sends the other TP ranks each step: a round trip keeps every field, the host
    tensors with their dtype and shape (an empty one too), and carries them as raw bytes."""
    import pickle

    from deltaserve.bench.tp_comm import decode_step_message
    from deltaserve.cache.ops import CopySlot

    step = decode_step_message(batch=3, context=40, block_size=16)
    step.cache_ops = [CopySlot(1, 2)]
    step.prev_rows = [0, -1, 2]
    step.graph_bucket = 4
    back = pickle.loads(pickle.dumps(step))
    for name, value in vars(step).items():
        got = getattr(back, name)
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value)
        else:
            assert got == value, name
    assert back.block_tables.shape == (3, 3)
    back.slot_mapping[0] = 99  # a tensor of its own, writable
    assert step.slot_mapping[0] != 99
    step.slot_mapping = torch.empty(0, dtype=torch.int64)  # a step without attention tokens
    assert pickle.loads(pickle.dumps(step)).slot_mapping.shape == (0,)
    assert b"torch._utils" not in pickle.dumps(step)  # no torch tensor pickling on the wire
