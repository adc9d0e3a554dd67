"""In-step state snapshots through the GDN face (ops/gdn/checkpoints.py): a step whose prefill
rows carry checkpoints equals running the heads as one step, copying the checkpointed slots'
states to their snapshot rows, and running the tails as a second step; outputs at every token
row, every slot and every snapshot row. The second run is built here with `make_meta`, not
with the split under test.
"""

from __future__ import annotations

import pytest
import torch
from conftest import kernel_device, requires_triton
from meta_helpers import gdn_layer, make_meta, rel_err

from deltaserve.ops.gdn import GDNKernels
from deltaserve.ops.gdn.checkpoints import checkpoint_split
from deltaserve.ops.gdn.reference import TorchGDNDecode, TorchGDNPrefill, torch_gdn_kernels

HEADS = (2, 4, 8, 6)  # HK, HV (ratio 2), K, V
WIDTH = 4  # conv kernel: its state keeps 3 inputs
CONV_DIM = 2 * 2 * 8 + 4 * 6
NUM_ROWS = 16  # state rows: slots 1..7, snapshot rows 8..15


def _layer_inputs(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, CONV_DIM, generator=gen)
    a = torch.randn(num_tokens, HEADS[1], generator=gen)
    b = torch.randn(num_tokens, HEADS[1], generator=gen)
    weight = torch.randn(CONV_DIM, WIDTH, generator=gen) * 0.5
    A_log = torch.empty(HEADS[1]).uniform_(0.5, 4, generator=gen).log()
    dt_bias = torch.randn(HEADS[1], generator=gen)
    conv = torch.randn(NUM_ROWS, CONV_DIM, WIDTH - 1, generator=gen)
    ssm = torch.randn(NUM_ROWS, HEADS[1], HEADS[3], HEADS[2], generator=gen) * 0.3
    conv[8:] = float("nan")  # snapshot rows start as garbage: each checkpoint overwrites its own
    ssm[8:] = float("nan")
    return x, a, b, weight, A_log, dt_bias, conv, ssm


def _two_steps(kernels, rows, num_decodes, inputs):
    """The reference: heads as one step, the copies, then the tails as a second step.
    rows: (context, new tokens, slot, checkpoint (head, destination row) or None) per row."""
    x, a, b, weight, A_log, dt_bias, conv, ssm = inputs
    heads = [n if ck is None else ck[0] for _, n, _, ck in rows]
    starts = [sum(n for _, n, _, _ in rows[:i]) for i in range(len(rows))]
    head_idx = [s + t for s, h in zip(starts, heads, strict=True) for t in range(h)]
    meta1 = make_meta(heads, [c for c, *_ in rows], num_decodes, state_slots=[r[2] for r in rows])
    out = torch.zeros(x.shape[0], HEADS[1], HEADS[3])
    pick = torch.tensor(head_idx)
    out[pick] = gdn_layer(kernels, x[pick], a[pick], b[pick], weight, A_log, dt_bias, conv, ssm,
                          meta1, HEADS)  # fmt: skip
    ck_rows = [(i, r) for i, r in enumerate(rows) if r[3] is not None]
    for _, (_, _, slot, (_, dst)) in ck_rows:
        conv[dst], ssm[dst] = conv[slot], ssm[slot]
    tail_idx = [starts[i] + t for i, (_, n, _, (h, _)) in ck_rows for t in range(h, n)]
    meta2 = make_meta(
        [n - ck[0] for _, (_, n, _, ck) in ck_rows],
        [c + ck[0] for _, (c, _, _, ck) in ck_rows],
        state_slots=[slot for _, (_, _, slot, _) in ck_rows],
    )
    pick = torch.tensor(tail_idx)
    out[pick] = gdn_layer(kernels, x[pick], a[pick], b[pick], weight, A_log, dt_bias, conv, ssm,
                          meta2, HEADS)  # fmt: skip
    return out


def _one_step(kernels, rows, num_decodes, inputs, device=None):
    x, a, b, weight, A_log, dt_bias, conv, ssm = inputs
    meta = make_meta(
        [n for _, n, _, _ in rows], [c for c, *_ in rows], num_decodes, state_slots=[r[2] for r in rows]
    )  # fmt: skip
    if device is not None:  # the metadata's device tensors on the kernel device
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "context_lens",
                     "block_tables", "state_slots", "has_initial_state"):  # fmt: skip
            setattr(meta, name, getattr(meta, name).to(device))
    meta.checkpoints = [(i, ck[0], ck[1]) for i, (*_, ck) in enumerate(rows) if ck is not None]
    out = gdn_layer(kernels, x, a, b, weight, A_log, dt_bias, conv, ssm, meta, HEADS)
    return out, meta


# (context, new tokens, slot, checkpoint): two decode rows, then prefill rows
MIXED = [
    (9, 1, 3, None),
    (4, 1, 6, None),
    (5, 11, 1, (7, 12)),  # a continued row
    (0, 9, 2, None),  # a row without a checkpoint between checkpointed ones
    (0, 6, 4, (2, 9)),  # head 2 < WIDTH - 1: the conv state mixes zeros and new inputs
    (3, 5, 7, (1, 14)),  # head 1 on top of an old conv state
]
LAST_ONLY = [(6, 1, 2, None), (0, 13, 5, None), (2, 21, 3, (14, 8))]  # the contiguous case


@pytest.mark.parametrize(("rows", "num_decodes"), [(MIXED, 2), (LAST_ONLY, 1), (MIXED[2:], 0)])
def test_split_equals_head_then_tail_steps(rows, num_decodes):
    kernels = torch_gdn_kernels(chunk_size=4)
    inputs = _layer_inputs(sum(n for _, n, _, _ in rows), seed=len(rows))
    ours = [t.clone() for t in inputs]
    want = _two_steps(kernels, rows, num_decodes, inputs)
    got, meta = _one_step(kernels, rows, num_decodes, ours)
    split = checkpoint_split(meta)
    assert isinstance(split.head_rows, slice) == (rows is LAST_ONLY)
    assert checkpoint_split(meta) is split  # built once per step, reused by every layer
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for name, g, w in (("conv", ours[6], inputs[6]), ("ssm", ours[7], inputs[7])):
        # every slot and snapshot row (untouched snapshot rows stay NaN in both)
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True, msg=name)
    dst = [ck[1] for *_, ck in rows if ck is not None]
    assert torch.isfinite(ours[7][dst]).all() and torch.isfinite(ours[6][dst]).all()


def test_bad_checkpoints_are_named():
    kernels = torch_gdn_kernels()
    inputs = _layer_inputs(8, seed=0)
    meta = make_meta([1, 7], [3, 0], 1, state_slots=[1, 2])
    meta.checkpoints = [(1, 7, 9)]  # head must be < the row's 7 new tokens
    with pytest.raises(ValueError, match="0 < head < its 7 new tokens"):
        gdn_layer(kernels, *inputs[:1], *inputs[1:3], *inputs[3:], meta, HEADS)
    meta = make_meta([1, 7], [3, 0], 1, state_slots=[1, 2])
    meta.checkpoints = [(0, 1, 9)]  # a decode row
    with pytest.raises(ValueError, match="must be a prefill row"):
        gdn_layer(kernels, *inputs[:1], *inputs[1:3], *inputs[3:], meta, HEADS)


@requires_triton
def test_triton_conv_split_matches_torch_steps():
    """The Triton conv backend (the interpreter on CPU) behind the split vs the torch kernels
    run as two steps."""
    from deltaserve.ops.gdn.triton_conv1d import TritonConv1d

    device = kernel_device()
    rows, num_decodes = MIXED, 2
    inputs = _layer_inputs(sum(n for _, n, _, _ in rows), seed=5)
    ours = [t.clone().to(device) for t in inputs]
    want = _two_steps(torch_gdn_kernels(chunk_size=4), rows, num_decodes, inputs)  # in place
    fast = GDNKernels(TritonConv1d(), TorchGDNPrefill(chunk_size=4), TorchGDNDecode())
    got, _ = _one_step(fast, rows, num_decodes, ours, device)
    assert rel_err(got.cpu(), want) < 1e-5
    for g, w in ((ours[6].cpu(), inputs[6]), (ours[7].cpu(), inputs[7])):
        finite = torch.isfinite(w)
        assert torch.equal(finite, torch.isfinite(g))
        assert rel_err(g[finite], w[finite]) < 1e-5
