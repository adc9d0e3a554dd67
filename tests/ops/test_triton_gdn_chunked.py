"""The chunked (tensor-core) Triton GDN prefill (ops/gdn/triton_chunked.py) against the torch
reference: ragged rows around the chunk size, fresh (NaN) and initial states, empty rows,
rows given as a subset of the token rows, in-kernel checkpoints, bf16, V tiles, bad shapes,
and its compile for sm_90 at 9B shapes.

On CPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1): sizes are
small, and the float32 products run at "ieee" precision where a test compares at 1e-4 (the
interpreter's "ieee" is numpy's float32; the default "bf16x3" rounds its operand halves as
the GPU does, checked on its own at its own tolerance).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_helpers import kernel_device, requires_triton
from meta_helpers import make_meta, rel_err

from deltaserve.ops.gdn.reference import (
    TorchGDNPrefill,
    gdn_gates,
    l2norm,
    recurrent_gated_delta_rule,
)

pytestmark = requires_triton

BT = 32  # the chunk the CPU tests run at (two 16-row blocks: the block merge is exercised)
LENGTHS = [1, 5, BT - 1, BT, BT + 1, 2 * BT + 3]


def _tiling(chunk=BT, block_v=None, precision="ieee", head_v=32):
    from deltaserve.ops.gdn.triton_chunked import ChunkedTiling

    block_v = block_v or max(16, 1 << (head_v - 1).bit_length())
    return ChunkedTiling(chunk, block_v, 4, 1, precision, precision)


class Rows:
    """Random inputs for sequences at token rows `spans` [(start, end)] of T rows (rows of no
    sequence between and after them), a pool of 2N + 2 slots with NaN in the slots of the
    sequences without an initial state (`fresh`), q / k / v as views inside wider rows."""

    def __init__(self, spans, fresh, hk, hv, dk, dv, *, T=None, act=torch.float32,
                 state=torch.float32, seed=0):  # fmt: skip
        dev = kernel_device()
        gen = torch.Generator().manual_seed(seed)
        n = len(spans)
        T = T or max([e for _, e in spans] + [0]) + 2
        self.spans, self.fresh, self.hv, self.hk, self.dk = spans, fresh, hv, hk, dk

        def rows(*shape):  # a view with a row stride wider than its row
            width = 1
            for s in shape:
                width *= s
            base = torch.full((T, width + 5), float("nan"))
            base[:, 2 : 2 + width] = torch.randn(T, width, generator=gen)
            return base[:, 2 : 2 + width].unflatten(1, shape).to(dev, act)

        self.q, self.k, self.v = rows(hk, dk), rows(hk, dk), rows(hv, dv)
        self.a, self.b = rows(hv), rows(hv)
        self.A_log = torch.empty(hv).uniform_(0.05, 1.0, generator=gen).log().to(dev)
        self.dt_bias = (0.5 * torch.randn(hv, generator=gen)).to(dev)
        self.slots = (torch.randperm(2 * n + 1, generator=gen)[:n] + 1).tolist()
        pool = 0.3 * torch.randn(2 * n + 2, hv, dv, dk, generator=gen)
        for slot, f in zip(self.slots, fresh, strict=True):
            if f:
                pool[slot] = float("nan")  # a fresh slot's garbage must never leak in
        self.pool = pool.to(dev, state)

    def tensors(self):
        dev = self.q.device
        starts = torch.tensor([s for s, _ in self.spans], dtype=torch.int32, device=dev)
        ends = torch.tensor([e for _, e in self.spans], dtype=torch.int32, device=dev)
        slots = torch.tensor(self.slots, dtype=torch.int64, device=dev)
        init = torch.tensor([not f for f in self.fresh], dtype=torch.bool, device=dev)
        return starts, ends, slots, init

    def run(self, ckpt=None, **kw):
        """(out poisoned with NaN where not written, pool after) of the kernel."""
        from deltaserve.ops.gdn.triton_chunked import gdn_chunked_rows

        pool = self.pool.clone()
        out = torch.full_like(self.v, float("nan"))
        ckpt_lens, ckpt_rows = (None, None) if ckpt is None else ckpt
        gdn_chunked_rows(
            self.q, self.k, self.v, self.a, self.b, self.A_log, self.dt_bias, pool,
            *self.tensors(), out, ckpt_lens, ckpt_rows, **kw,
        )  # fmt: skip
        return out, pool

    def reference(self, i, length=None):
        """Token-by-token float32 reference of sequence i (its first `length` tokens):
        (out [L, HV, V], final state [HV, V, K])."""
        s, e = self.spans[i]
        e = e if length is None else s + length
        g, beta = gdn_gates(self.a[s:e], self.b[s:e], self.A_log, self.dt_bias)
        ratio = self.hv // self.hk
        q, k = (l2norm(x[s:e]).repeat_interleave(ratio, dim=1) for x in (self.q, self.k))
        init = None if self.fresh[i] else self.pool[self.slots[i]].float()
        return recurrent_gated_delta_rule(q, k, self.v[s:e], g, beta, init, self.dk**-0.5)


def _close(got, want, atol, what):
    torch.testing.assert_close(
        got.float().cpu(), want.float().cpu(), atol=atol, rtol=atol, msg=lambda m: f"{what}: {m}"
    )


def _check(rows, out, pool, atol, skip_slots=()):
    """Every sequence's rows and slot against the reference; rows of no sequence still NaN;
    slots of no sequence (and `skip_slots`) bit-identical."""
    owned = torch.zeros(out.shape[0], dtype=torch.bool)
    for i, (s, e) in enumerate(rows.spans):
        owned[s:e] = True
        what = f"sequence {i} ({e - s} tokens, fresh={rows.fresh[i]})"
        if e == s:
            before, after = rows.pool[rows.slots[i]], pool[rows.slots[i]]
            assert torch.equal(before.nan_to_num(7.0), after.nan_to_num(7.0)), what
            continue
        want_o, want_s = rows.reference(i)
        _close(out[s:e], want_o, atol, f"{what}: output")
        _close(pool[rows.slots[i]], want_s, atol, f"{what}: state")
    assert out[~owned.to(out.device)].isnan().all(), "a row of no sequence was written"
    others = [s for s in range(pool.shape[0]) if s not in rows.slots and s not in skip_slots]
    assert torch.equal(pool[others].nan_to_num(7.0), rows.pool[others].nan_to_num(7.0))


def _packed(lengths, gap=0):
    spans, row = [], 0
    for n in lengths:
        spans.append((row, row + n))
        row += n + gap
    return spans


def test_ragged_rows_fresh_and_initial_states_gva2():
    """Lengths 1 .. 2 BT + 3 around the chunk size in one launch, HK=2 / HV=4, K=16 != V=32;
    fresh slots full of NaN, initial states, NaN-poisoned out."""
    fresh = [True, False, True, False, True, False]
    rows = Rows(_packed(LENGTHS), fresh, 2, 4, 16, 32, seed=1)
    out, pool = rows.run(tiling=_tiling())
    _check(rows, out, pool, 1e-4)


def test_chunk_64_and_a_group_of_three():
    """BT = 64 (four 16-row blocks merged: three Horner steps), HK=1 / HV=3, K=32 > V=16."""
    lengths = [63, 64, 65, 131]
    rows = Rows(_packed(lengths), [False, True, False, True], 1, 3, 32, 16, seed=2)
    out, pool = rows.run(tiling=_tiling(64, head_v=16))
    _check(rows, out, pool, 1e-4)


def test_subset_of_rows_with_an_empty_sequence():
    """Sequences at scattered token rows (gaps and rows after them belong to none, and stay
    NaN), one of them empty: its slot, fresh (NaN) or not, is left as it was."""
    spans = [(3, 8), (8, 8), (11, 11 + BT + 2), (50, 51), (60, 60)]
    fresh = [False, True, True, False, False]
    rows = Rows(spans, fresh, 2, 4, 16, 16, T=70, seed=3)
    out, pool = rows.run(tiling=_tiling(head_v=16))
    _check(rows, out, pool, 1e-4)


def test_value_tiles_and_head_dims_off_the_power_of_two():
    """K = 24 and V = 40 (masked tails) with 16-row value tiles: three programs per head."""
    rows = Rows(_packed([7, BT + 5]), [True, False], 1, 2, 24, 40, seed=4)
    out, pool = rows.run(tiling=_tiling(block_v=16))
    _check(rows, out, pool, 1e-4)


@pytest.mark.parametrize("chunk", [BT, 64])
def test_checkpoints_at_chunk_edges_and_inside(chunk):
    """Snapshots after h = 1, h = BT (a chunk's end), h inside a chunk and none, each to its
    own pool row: exactly the state after h tokens; the rest of the row goes on from it."""
    lengths = [BT + 9, 2 * BT + 3, BT + 1, 40, 6]
    heads = [1, BT, 20, 0, 5]
    rows = Rows(_packed(lengths), [True, False, False, True, False], 2, 4, 16, 16, seed=5)
    n = len(lengths)
    free = [s for s in range(rows.pool.shape[0]) if s not in rows.slots][:n]
    dev = rows.q.device
    ckpt_lens = torch.tensor(heads, dtype=torch.int32, device=dev)
    ckpt_rows = torch.tensor(free, dtype=torch.int64, device=dev)
    out, pool = rows.run((ckpt_lens, ckpt_rows), tiling=_tiling(chunk, head_v=16))
    _check(rows, out, pool, 1e-4, skip_slots=[r for r, h in zip(free, heads) if h])
    for i, (h, row) in enumerate(zip(heads, free, strict=True)):
        if h == 0:
            assert torch.equal(pool[row].nan_to_num(7.0), rows.pool[row].nan_to_num(7.0))
            continue
        _, want = rows.reference(i, length=h)
        _close(pool[row], want, 1e-4, f"checkpoint of sequence {i} after {h} tokens")


def test_default_precision_by_activation_dtype():
    """Float32 activations (reference-precision runs) take "ieee" products by default: the
    default equals the ieee tiling bit for bit. "bf16x3" (16-bit activations' default) on the
    same float32 inputs: the split operands' rounding stays within 5e-4 of the reference and
    differs from the exact products."""
    from deltaserve.ops.gdn.triton_chunked import chunked_tiling

    assert chunked_tiling(32, 16, None, torch.bfloat16).precision == "bf16x3"
    assert chunked_tiling(32, 16, None, torch.float32).precision == "ieee"
    rows = Rows(_packed([BT + 3, 70]), [True, False], 2, 4, 16, 32, seed=6)
    _, default = rows.run()
    _, exact = rows.run(tiling=_tiling(64))
    slots = rows.slots
    assert torch.equal(default[slots], exact[slots]), "float32 default is not ieee"
    out, pool = rows.run(tiling=_tiling(64, precision="bf16x3"))
    _check(rows, out, pool, 5e-4)
    assert not torch.equal(pool[slots], exact[slots]), "bf16x3 ran as exact float32"


@pytest.mark.parametrize("state", [torch.float32, torch.bfloat16], ids=["f32-state", "bf16-state"])
def test_bf16_activations(state):
    """bf16 q / k / v / gates (the model's dtype), K=32 != V=16, HK=1 / HV=3, default
    precision; the bf16 pool is rounded at chunk boundaries (looser)."""
    lengths, fresh = [2, BT + 1, 2 * BT + 3], [False, True, False]
    rows = Rows(_packed(lengths), fresh, 1, 3, 32, 16, act=torch.bfloat16, state=state, seed=7)
    out, pool = rows.run(chunk=BT)
    assert out.dtype == torch.bfloat16 and pool.dtype == state
    for i, (s, e) in enumerate(rows.spans):
        want_o, want_s = rows.reference(i)
        assert rel_err(out[s:e].cpu(), want_o.cpu()) < 1e-2, f"sequence {i}: output"
        tol = 5e-5 if state == torch.float32 else 1e-2
        assert rel_err(pool[rows.slots[i]].cpu(), want_s.cpu()) < tol, f"sequence {i}: state"


def test_backend_matches_torch_backend_with_checkpoints():
    """`TritonChunkedGDNPrefill` on a step's prefill part (after two decode rows, padding
    rows at the end, zero) against `TorchGDNPrefill`; with the part's checkpoints it also
    stores the snapshot rows (takes_checkpoints)."""
    from deltaserve.ops.gdn.triton_chunked import TritonChunkedGDNPrefill

    dev = kernel_device()
    lengths = [5, BT + 7, 1]
    meta = make_meta([1, 1, *lengths], [4, 4, 0, 9, 3], 2, state_slots=[1, 2, 5, 3, 7])
    part = meta.prefill_part()
    for name in ("query_start_loc", "seq_lens", "context_lens", "state_slots", "has_initial_state"):
        setattr(part, name, getattr(part, name).to(dev))
    part.checkpoint_heads_cpu, part.checkpoint_rows_cpu = [0, 16, 0], [0, 9, 0]
    rows = Rows(_packed(lengths), [True, False, False], 1, 2, 16, 16, T=sum(lengths) + 3, seed=8)
    rows.pool = (0.3 * torch.randn(10, 2, 16, 16, generator=torch.Generator().manual_seed(8))).to(
        dev
    )
    args = (rows.q, rows.k, rows.v, rows.a, rows.b, rows.A_log, rows.dt_bias)
    backend = TritonChunkedGDNPrefill(_tiling(head_v=16))
    assert backend.name == "triton_chunked" and backend.takes_checkpoints(part)
    got_pool, want_pool = rows.pool.clone(), rows.pool.clone()
    got = backend.forward(*args, got_pool, part)
    want = TorchGDNPrefill().forward(*args, want_pool, part)
    assert got.shape == rows.v.shape and got.dtype == rows.v.dtype
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for slot in (5, 3, 7):
        torch.testing.assert_close(got_pool[slot], want_pool[slot], atol=1e-4, rtol=1e-4)
    head_pool = rows.pool.clone()  # the snapshot: row 1 (slot 3) after its first 16 tokens
    part_head = make_meta([16], [9], 0, state_slots=[3]).prefill_part()
    part_head.query_start_loc = part_head.query_start_loc.to(dev)
    part_head.has_initial_state = part_head.has_initial_state.to(dev)
    part_head.state_slots = part_head.state_slots.to(dev)
    s = lengths[0]
    TorchGDNPrefill().forward(*(x[s : s + 16] for x in args[:5]), *args[5:], head_pool, part_head)
    torch.testing.assert_close(got_pool[9], head_pool[3], atol=1e-4, rtol=1e-4)


def test_refuses_bad_arguments():
    from deltaserve.ops.gdn.triton_chunked import ChunkedTiling, gdn_chunked_rows

    rows = Rows(_packed([3]), [False], 1, 2, 16, 16, seed=9)
    starts, ends, slots, init = rows.tensors()
    out = torch.empty_like(rows.v)
    args = (rows.q, rows.k, rows.v, rows.a, rows.b, rows.A_log, rows.dt_bias, rows.pool)

    def call(*a, **kw):
        gdn_chunked_rows(*a, starts, ends, slots, init, out, **kw)

    with pytest.raises(ValueError, match="want q, k"):
        call(rows.q, rows.k[:, :, :8], *args[2:])
    with pytest.raises(ValueError, match="HV=2 is not a multiple of HK=3"):
        q3 = torch.zeros(rows.q.shape[0], 3, 16, device=rows.q.device)
        call(q3, q3, *args[2:])
    with pytest.raises(ValueError, match=r"ssm_state \(.*\) is not \[num_slots, HV=2"):
        call(*args[:7], rows.pool[:, :1])
    with pytest.raises(ValueError, match="a .*, b .*: want"):
        call(*args[:3], rows.a[:, :1], *args[4:])
    with pytest.raises(ValueError, match="ckpt_lens, ckpt_rows"):
        call(*args, ckpt_lens=torch.zeros(1, dtype=torch.int32, device=rows.q.device))
    for chunk in (24, 48):  # powers of two >= 16 only
        with pytest.raises(ValueError, match=f"chunk={chunk}"):
            call(*args, chunk=chunk)
    with pytest.raises(ValueError, match="precisions"):
        call(*args, tiling=ChunkedTiling(32, 16, 4, 1, "fp16", "ieee"))
    with pytest.raises(ValueError, match=r"starts \(1,\), ends \(2,\)"):
        gdn_chunked_rows(*args, starts, torch.cat([ends, ends]), slots, init, out)


# --- sm_90 compile at 9B shapes (HK=16, HV=32, K=V=128; bf16 activations, fp32 state) -------

SIG = {
    **{p: "*bf16" for p in ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr")},
    "A_log_ptr": "*fp32",
    "dt_bias_ptr": "*fp32",
    "state_ptr": "*fp32",
    "starts_ptr": "*i32",
    "ends_ptr": "*i32",
    "slots_ptr": "*i64",
    "init_ptr": "*i1",
    "ckpt_ptr": "*i64",
    "ckpt_rows_ptr": "*i64",
    "out_ptr": "*bf16",
    **{f"stride_{s}": "i32" for s in ("qn", "qh", "kn", "kh", "vn", "vh", "an")},
    "stride_ah": "constexpr",  # 1: the JIT specialises it
    "stride_bn": "i32",
    "stride_bh": "constexpr",
    **{f"stride_{s}": "i32" for s in ("sn", "sh", "sv", "on", "oh")},
    "scale": "fp32",
    **{c: "constexpr" for c in ("HV", "GROUP", "K", "V", "BK", "BV", "BT", "PRECISION")},
    **{c: "constexpr" for c in ("INV_PRECISION", "CKPT", "INTERPRET")},
}
DIV16 = [p for p, t in SIG.items() if t.startswith("*") and p != "init_ptr"]
DIV16 += [s for s, t in SIG.items() if s.startswith("stride_") and t == "i32"]

# the compile in a subprocess without the interpreter (as sm90_compile.compile_many), with
# ptxas -v's report of EVERY function: the chunk step is a function of its own (noinline)
_COMPILE = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sm90_compile import ptxas_path
from deltaserve.ops.gdn.triton_chunked import _gdn_chunked_kernel as fn
out = []
for job in json.loads(sys.stdin.read()):
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in job["div16"]}
    src = ASTSource(fn=fn, signature=job["signature"], constexprs=job["constexprs"],
                    attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=job["num_warps"], num_stages=1))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(c.asm["ptx"])
    log = subprocess.run([ptxas_path(), "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    os.unlink(f.name)
    spills = {m.group(1)[:40]: int(m.group(2)) for m in re.finditer(
        r"Function properties for (\S+)\s+\d+ bytes stack frame, (\d+) bytes spill stores", log)}
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    out.append(dict(registers=regs, spills=spills, log=log))
print(json.dumps(out))
"""


def _compile_sm90(jobs):
    here = Path(__file__).resolve().parent
    root = here.parent.parent
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(here), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _COMPILE], input=json.dumps(jobs),
                         capture_output=True, text=True, env=env, check=True)  # fmt: skip
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_compiles_for_sm90_at_9b_shapes():
    """The default tiling at 9B shapes (BT 64, BV 64, 4 warps, bf16x3), with and without
    checkpoints, for sm_90: no spills inside the chunk step beyond the measured few (ptxas
    spills a handful of index values: 40 bytes), and in the kernel only the chunk loop's
    scalars saved across the call (20 bytes); registers within the 255 a thread has.
    sm90_compile.compile_sm90 reads only the first function's line of ptxas' report, so the
    compile is run here with every function's."""
    from sm90_compile import ptxas_path

    if ptxas_path() is None:
        pytest.skip("this Triton has no NVIDIA backend / ptxas")
    from deltaserve.ops.gdn import triton_chunked

    tiling = triton_chunked.ChunkedTiling(64, 64, 4)
    assert tiling == triton_chunked.ChunkedTiling(64, 64, 4, 1, "bf16x3", "bf16x3")
    jobs = []
    for ckpt in (False, True):
        consts = dict(
            stride_ah=1, stride_bh=1, HV=32, GROUP=2, K=128, V=128, BK=128, BV=tiling.block_v,
            BT=tiling.chunk, PRECISION=tiling.precision, INV_PRECISION=tiling.inv_precision,
            CKPT=ckpt, INTERPRET=False,
        )  # fmt: skip
        jobs.append(dict(signature=SIG, constexprs=consts, div16=DIV16, num_warps=4))
    for ckpt, res in zip((False, True), _compile_sm90(jobs), strict=True):
        spills = res["spills"]
        assert len(spills) == 2, res["log"]  # the kernel and its chunk step
        kernel = spills.pop(next(k for k in spills if k.startswith("_gdn_chunked_kernel")))
        (step,) = spills.values()
        assert res["registers"] <= 255
        assert kernel <= 20, f"ckpt={ckpt}: the kernel spills {kernel} bytes\n{res['log']}"
        assert step <= 48, f"ckpt={ckpt}: the chunk step spills {step} bytes\n{res['log']}"


# --- GPU: 9B shapes, against the torch reference ----------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@gpu
@needs_cuda
@pytest.mark.parametrize("state", [torch.float32, torch.bfloat16], ids=["f32-state", "bf16-state"])
def test_gpu_9b_shapes(state):
    """Mixed rows at HK=16 / HV=32 / K=V=128, bf16 in, the default tiling, with checkpoints:
    outputs as close as the token-by-token kernel's (bf16 rounding), states close."""
    lengths = [1, 17, 64, 65, 136, 257, 600]
    fresh = [i % 3 == 0 for i in range(len(lengths))]
    rows = Rows(_packed(lengths), fresh, 16, 32, 128, 128, act=torch.bfloat16, state=state,
                seed=11)  # fmt: skip
    heads = [0, 5, 32, 0, 100, 128, 333]  # 0 < h < the row's tokens, or 0: none
    free = [s for s in range(rows.pool.shape[0]) if s not in rows.slots][: len(lengths)]
    ckpt = (torch.tensor(heads, dtype=torch.int32, device="cuda"),
            torch.tensor(free, dtype=torch.int64, device="cuda"))  # fmt: skip
    out, pool = rows.run(ckpt)
    tol_s = 1e-4 if state == torch.float32 else 1.5e-2
    for i, (s, e) in enumerate(rows.spans):
        want_o, want_s = rows.reference(i)
        assert rel_err(out[s:e], want_o) < 1e-2, f"sequence {i}: output"
        assert rel_err(pool[rows.slots[i]], want_s) < tol_s, f"sequence {i}: state"
        if heads[i]:
            _, want_h = rows.reference(i, length=heads[i])
            assert rel_err(pool[free[i]], want_h) < tol_s, f"sequence {i}: checkpoint"


@gpu
@needs_cuda
def test_gpu_prefill_bench_row_runs():
    from deltaserve.ops.gdn.prefill_bench import bench_gdn_prefill

    res = bench_gdn_prefill(2, 33, "triton-chunked", calls=4, iters=2)
    assert res["us"] > 0 and res["host_us"] > 0 and res["bytes"] > 0
