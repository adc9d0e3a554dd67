"""In-step state snapshots through the GDN face (ops/gdn/checkpoints.py): a step whose prefill
rows carry checkpoints equals running the heads as one step, copying the checkpointed slots'
states to their snapshot rows, and running the tails as a second step; outputs at every token
row, every slot and every snapshot row. The second run is built here with `make_meta`, not
with the split under test.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import kernel_device, requires_triton
from meta_helpers import gdn_layer, make_meta, rel_err

from deltaserve.ops.gdn import GDNKernels
from deltaserve.ops.gdn.checkpoints import checkpoint_split
from deltaserve.ops.gdn.reference import TorchGDNDecode, TorchGDNPrefill, torch_gdn_kernels

HEADS = (2, 4, 8, 6)  # HK, HV (ratio 2), K, V
WIDTH = 4  # conv kernel: its state keeps 3 inputs
CONV_DIM = 2 * 2 * 8 + 4 * 6
NUM_ROWS = 16  # state rows: slots 1..7, snapshot rows 8..15
DEVICE_FIELDS = (
    "slot_mapping",
    "query_start_loc",
    "seq_lens",
    "context_lens",
    "block_tables",
    "state_slots",
    "has_initial_state",
)


def _layer_inputs(num_tokens: int, seed: int, heads=HEADS):
    hk, hv, dk, dv = heads
    conv_dim = 2 * hk * dk + hv * dv
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, conv_dim, generator=gen)
    a = torch.randn(num_tokens, hv, generator=gen)
    b = torch.randn(num_tokens, hv, generator=gen)
    weight = torch.randn(conv_dim, WIDTH, generator=gen) * 0.5
    A_log = torch.empty(hv).uniform_(0.5, 4, generator=gen).log()
    dt_bias = torch.randn(hv, generator=gen)
    conv = torch.randn(NUM_ROWS, conv_dim, WIDTH - 1, generator=gen)
    ssm = torch.randn(NUM_ROWS, hv, dv, dk, generator=gen) * 0.3
    conv[8:] = float("nan")  # snapshot rows start as garbage: each checkpoint overwrites its own
    ssm[8:] = float("nan")
    return x, a, b, weight, A_log, dt_bias, conv, ssm


def _two_steps(kernels, rows, num_decodes, inputs, heads=HEADS):
    """The reference: heads as one step, the copies, then the tails as a second step.
    rows: (context, new tokens, slot, checkpoint (head, destination row) or None) per row."""
    x, a, b, weight, A_log, dt_bias, conv, ssm = inputs
    head_lens = [n if ck is None else ck[0] for _, n, _, ck in rows]
    starts = [sum(n for _, n, _, _ in rows[:i]) for i in range(len(rows))]
    head_idx = [s + t for s, h in zip(starts, head_lens, strict=True) for t in range(h)]
    meta1 = make_meta(
        head_lens, [r[0] for r in rows], num_decodes, state_slots=[r[2] for r in rows]
    )
    out = torch.zeros(x.shape[0], heads[1], heads[3])
    pick = torch.tensor(head_idx)
    args = (weight, A_log, dt_bias, conv, ssm)
    out[pick] = gdn_layer(kernels, x[pick], a[pick], b[pick], *args, meta1, heads)
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
    out[pick] = gdn_layer(kernels, x[pick], a[pick], b[pick], *args, meta2, heads)
    return out


def _one_step(kernels, rows, num_decodes, inputs, device=None, heads=HEADS):
    x, a, b, weight, A_log, dt_bias, conv, ssm = inputs
    lens, ctx, slots = [r[1] for r in rows], [r[0] for r in rows], [r[2] for r in rows]
    meta = make_meta(lens, ctx, num_decodes, state_slots=slots)
    if device is not None:  # the metadata's device tensors on the kernel device
        for name in DEVICE_FIELDS:
            setattr(meta, name, getattr(meta, name).to(device))
    meta.checkpoints = [(i, ck[0], ck[1]) for i, (*_, ck) in enumerate(rows) if ck is not None]
    out = gdn_layer(kernels, x, a, b, weight, A_log, dt_bias, conv, ssm, meta, heads)
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
    part = meta.prefill_part()  # the checkpoints per prefill row (0: none)
    want_heads = [0 if ck is None else ck[0] for *_, ck in rows[num_decodes:]]
    assert part.checkpoint_heads_cpu == want_heads
    assert part.checkpoint_rows_cpu == [0 if ck is None else ck[1] for *_, ck in rows[num_decodes:]]
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


# (context, new tokens, slot, checkpoint) at chat-turn sizes: 3 decode rows, 4 prefill rows
GPU_ROWS = [
    (90, 1, 3, None),
    (41, 1, 5, None),
    (7, 1, 6, None),
    (48, 300, 1, (208, 8)),
    (0, 257, 2, None),
    (0, 130, 4, (2, 11)),
    (16, 70, 7, (64, 13)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [GPU_ROWS, GPU_ROWS[:4]], ids=["mixed", "last-only"])
def test_gpu_fast_backends_split_match_torch_steps(rows):
    """Triton conv + fla prefill + Triton decode behind the split (Qwen3.5 GDN heads, float32)
    vs the torch kernels run as two steps on the CPU."""
    from deltaserve.ops.gdn.fla_prefill import FlaGDNPrefill
    from deltaserve.ops.gdn.triton_conv1d import TritonConv1d
    from deltaserve.ops.gdn.triton_decode import TritonGDNDecode

    heads = (16, 32, 128, 128)
    num_decodes = 3
    inputs = _layer_inputs(sum(n for _, n, _, _ in rows), seed=11, heads=heads)
    ours = [t.clone().cuda() for t in inputs]
    want = _two_steps(torch_gdn_kernels(), rows, num_decodes, inputs, heads)
    fast = GDNKernels(TritonConv1d(), FlaGDNPrefill(), TritonGDNDecode())
    got, _ = _one_step(fast, rows, num_decodes, ours, torch.device("cuda"), heads)
    tol = 1.5e-2  # fla's chunked kernels (tf32 dots) against the fp32 reference
    assert rel_err(got.cpu(), want) < tol
    for g, w in ((ours[6].cpu(), inputs[6]), (ours[7].cpu(), inputs[7])):
        finite = torch.isfinite(w)
        assert torch.equal(finite, torch.isfinite(g))
        assert rel_err(g[finite], w[finite]) < tol


class _Spy:
    """Wraps a GDN backend and records the checkpoints of every prefill part it is handed."""

    def __init__(self, inner):
        self.inner = inner
        self.seen: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, *args):
        meta = args[-1]
        part = meta.prefill_part() if hasattr(meta, "prefill_part") else meta
        self.seen.append(list(part.checkpoint_heads_cpu) if part is not None else [])
        return self.inner.forward(*args)


@requires_triton
@pytest.mark.parametrize(("rows", "num_decodes"), [(MIXED, 2), (LAST_ONLY, 1), (MIXED[2:], 0)])
@pytest.mark.parametrize("prefill", ["triton", "split-short", "split-chunked", "chunked"])
def test_in_kernel_checkpoints_match_torch_steps(rows, num_decodes, prefill, monkeypatch):
    """The Triton conv and the token-by-token Triton prefill (alone, or as the short part of
    the row split) or the chunked one store the snapshots inside their kernels: the step runs
    whole (no HEAD / TAIL split is built, each backend is called once and sees the checkpoints)
    and equals the torch kernels run as two steps, outputs, slots and snapshot rows."""
    from deltaserve.ops.gdn import row_split
    from deltaserve.ops.gdn.row_split import ShortRowSplitPrefill
    from deltaserve.ops.gdn.triton_chunked import TritonChunkedGDNPrefill
    from deltaserve.ops.gdn.triton_conv1d import TritonConv1d
    from deltaserve.ops.gdn.triton_prefill import TritonGDNPrefill

    device = kernel_device()
    inputs = _layer_inputs(sum(n for _, n, _, _ in rows), seed=7 + len(rows))
    ours = [t.clone().to(device) for t in inputs]
    want = _two_steps(torch_gdn_kernels(chunk_size=4), rows, num_decodes, inputs)
    if prefill == "triton":
        inner = TritonGDNPrefill()
    elif prefill == "chunked":
        inner = TritonChunkedGDNPrefill()
    else:  # every row short: a Triton kernel; the long backend must not be called
        # split-chunked: rows of more than 8 new tokens make the short part take the chunked
        # kernel (split-short: the token-by-token one)
        least = 8 if prefill == "split-chunked" else 64
        long = _Spy(TorchGDNPrefill(chunk_size=4))
        inner = ShortRowSplitPrefill(long, max_short_tokens=64, chunked_min_tokens=least)
    chunked_calls = []
    real = row_split.gdn_chunked_rows
    monkeypatch.setattr(
        row_split, "gdn_chunked_rows", lambda *a: chunked_calls.append(1) or real(*a)
    )
    conv, pre = _Spy(TritonConv1d()), _Spy(inner)
    got, meta = _one_step(GDNKernels(conv, pre, TorchGDNDecode()), rows, num_decodes, ours, device)
    assert meta._checkpoint_split is None  # no HEAD / TAIL sub-batches
    heads = [0 if ck is None else ck[0] for *_, ck in rows[num_decodes:]]
    assert conv.seen == [heads] and pre.seen == [heads]
    if prefill.startswith("split"):
        assert inner.long_rows.seen == []
        assert len(chunked_calls) == (prefill == "split-chunked")
    tol = 1e-5  # float32 activations: the chunked kernel's products are exact ("ieee") too
    assert rel_err(got.cpu(), want) < tol
    for name, g, w in (("conv", ours[6].cpu(), inputs[6]), ("ssm", ours[7].cpu(), inputs[7])):
        finite = torch.isfinite(w)  # untouched snapshot rows stay NaN in both
        assert torch.equal(finite, torch.isfinite(g)), name
        assert rel_err(g[finite], w[finite]) < tol, name


@requires_triton
def test_row_split_with_a_long_row_splits_the_step():
    """A checkpointed step with a row too long for the Triton kernel: the row split cannot take
    the checkpoints, so the face runs the GDN op as HEAD and TAIL (the Triton conv still takes
    them in its kernel); the result equals the two-step reference."""
    from deltaserve.ops.gdn.row_split import ShortRowSplitPrefill
    from deltaserve.ops.gdn.triton_conv1d import TritonConv1d

    device = kernel_device()
    rows, num_decodes = MIXED, 2
    inputs = _layer_inputs(sum(n for _, n, _, _ in rows), seed=3)
    ours = [t.clone().to(device) for t in inputs]
    want = _two_steps(torch_gdn_kernels(chunk_size=4), rows, num_decodes, inputs)
    pre = ShortRowSplitPrefill(TorchGDNPrefill(chunk_size=4), max_short_tokens=10)  # 11 > 10
    conv = _Spy(TritonConv1d())
    got, meta = _one_step(GDNKernels(conv, pre, TorchGDNDecode()), rows, num_decodes, ours, device)
    assert meta._checkpoint_split is not None  # built for the GDN op
    assert len(conv.seen) == 1  # the conv ran the step whole
    assert rel_err(got.cpu(), want) < 1e-5
    for g, w in ((ours[6].cpu(), inputs[6]), (ours[7].cpu(), inputs[7])):
        finite = torch.isfinite(w)
        assert torch.equal(finite, torch.isfinite(g))
        assert rel_err(g[finite], w[finite]) < 1e-5


@requires_triton
def test_in_kernel_checkpoints_are_checked():
    """A backend that takes checkpoints in its kernel still gets bad ones refused by name."""
    from deltaserve.ops.gdn.triton_conv1d import TritonConv1d
    from deltaserve.ops.gdn.triton_prefill import TritonGDNPrefill

    kernels = GDNKernels(TritonConv1d(), TritonGDNPrefill(), TorchGDNDecode())
    inputs = _layer_inputs(8, seed=0)
    meta = make_meta([1, 7], [3, 0], 1, state_slots=[1, 2])
    meta.checkpoints = [(1, 7, 9)]
    with pytest.raises(ValueError, match="0 < head < its 7 new tokens"):
        gdn_layer(kernels, *inputs, meta, HEADS)
    meta = make_meta([1, 7], [3, 0], 1, state_slots=[1, 2])
    meta.checkpoints = [(0, 1, 9)]  # a decode row
    with pytest.raises(ValueError, match="must be a prefill row"):
        gdn_layer(kernels, *inputs, meta, HEADS)


def test_checkpoint_tensors_are_built_once_per_step():
    """The prefill part's checkpoints on the device: (heads, destination rows) per prefill row
    (0: none), the same tensors for every layer of the step; None without checkpoints."""
    rows, num_decodes = MIXED, 2
    meta = make_meta([r[1] for r in rows], [r[0] for r in rows], num_decodes)
    assert meta.prefill_part().checkpoint_tensors() is None
    meta = make_meta([r[1] for r in rows], [r[0] for r in rows], num_decodes)
    meta.checkpoints = [(i, ck[0], ck[1]) for i, (*_, ck) in enumerate(rows) if ck is not None]
    part = meta.prefill_part()
    heads, dst = part.checkpoint_tensors()
    assert heads.tolist() == [7, 0, 2, 1] and dst.tolist() == [12, 0, 9, 14]
    again = part.checkpoint_tensors()
    assert again[0] is heads and again[1] is dst
