"""The one-launch Triton GDN prefill (ops/gdn/triton_prefill.py) and the short / long row split
(ops/gdn/row_split.py) against the torch reference.

On CPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1), where each
token step of each program costs milliseconds: sizes are small. The split inside the `fla`
backend cannot run here (no fla): `ShortRowSplitPrefill` with the torch reference standing in
for fla's long rows tests its splitting and scattering. `gpu` tests use the 9B shapes.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import kernel_device, requires_triton
from meta_helpers import make_meta, rel_err

from deltaserve.ops.gdn.reference import (
    TorchGDNPrefill,
    chunk_gated_delta_rule,
    gdn_gates,
    l2norm,
    recurrent_gated_delta_rule,
)

pytestmark = requires_triton

LENGTHS = [1, 2, 17, 64, 65, 130]


def _meta_to(meta, device):
    """The prefill part of `meta` with its device tensors on `device`."""
    part = meta.prefill_part()
    for name in ("query_start_loc", "seq_lens", "context_lens", "state_slots", "has_initial_state"):
        setattr(part, name, getattr(part, name).to(device))
    return part


def strided(rows: int, *shape: int, gen: torch.Generator, device, dtype) -> torch.Tensor:
    """Random [rows, *shape] as a view inside wider rows holding NaN (a kernel that ignores the
    row stride reads NaN)."""
    width = 1
    for s in shape:
        width *= s
    base = torch.full((rows, width + 7), float("nan"), device=device, dtype=dtype)
    view = base[:, 3 : 3 + width].unflatten(1, shape)
    view.copy_(torch.randn(rows, *shape, generator=gen).to(dtype))
    return view


class Case:
    """A varlen prefill step: rows of `lengths` tokens (after `num_decodes` decode rows, which
    the prefill part leaves out), `pad` trailing rows no sequence owns, shuffled slots in a pool
    twice the batch, NaN in the slots of sequences without an initial state."""

    def __init__(
        self,
        lengths,
        fresh,
        hk,
        ratio,
        dk,
        dv,
        *,
        act_dtype=torch.float32,
        state_dtype=torch.float32,
        pad=3,
        num_decodes=0,
        seed=0,
        device=None,
    ):
        device = device or kernel_device()
        gen = torch.Generator().manual_seed(seed)
        n = num_decodes + len(lengths)
        self.num_slots = 2 * n + 2
        slots = (torch.randperm(self.num_slots - 1, generator=gen)[:n] + 1).tolist()
        ctx = [4] * num_decodes + [0 if f else 9 for f in fresh]
        meta = make_meta([1] * num_decodes + list(lengths), ctx, num_decodes, state_slots=slots)
        self.meta = _meta_to(meta, device)
        self.fresh = fresh
        hv = hk * ratio
        T = sum(lengths) + pad
        self.args = (
            strided(T, hk, dk, gen=gen, device=device, dtype=act_dtype),  # q
            strided(T, hk, dk, gen=gen, device=device, dtype=act_dtype),  # k
            strided(T, hv, dv, gen=gen, device=device, dtype=act_dtype),  # v
            strided(T, hv, gen=gen, device=device, dtype=act_dtype),  # a
            strided(T, hv, gen=gen, device=device, dtype=act_dtype),  # b
            torch.empty(hv).uniform_(0.05, 1.0, generator=gen).log().to(device),  # A_log
            (0.5 * torch.randn(hv, generator=gen)).to(device),  # dt_bias
        )
        pool = 0.3 * torch.randn(self.num_slots, hv, dv, dk, generator=gen)
        for slot, f in zip(self.meta.state_slots_cpu, fresh, strict=True):
            if f:
                pool[slot] = float("nan")  # a fresh slot's garbage must never leak in
        self.pool = pool.to(device, state_dtype)

    def run(self, backend):
        """(out, pool after) of `backend` on a copy of the pool."""
        pool = self.pool.clone()
        with torch.inference_mode():
            out = backend.forward(*self.args, pool, self.meta)
        return out, pool

    def check(self, backend, tol_out, tol_state):
        """`backend` against TorchGDNPrefill: every sequence's rows and slot, padding rows zero,
        slots outside the batch bit-identical (NaN included)."""
        want, want_pool = self.run(TorchGDNPrefill())
        got, pool = self.run(backend)
        v = self.args[2]
        assert got.shape == v.shape and got.dtype == v.dtype
        qsl = self.meta.query_start_loc_cpu
        for i, slot in enumerate(self.meta.state_slots_cpu):
            s, e = qsl[i], qsl[i + 1]
            err_o = rel_err(got[s:e], want[s:e])
            err_s = rel_err(pool[slot], want_pool[slot])
            what = f"length {e - s} (fresh={self.fresh[i]})"
            assert err_o < tol_out, f"{what}: output rel err {err_o:.2e}"
            assert err_s < tol_state, f"{what}: state rel err {err_s:.2e}"
        assert torch.equal(got[qsl[-1] :], torch.zeros_like(got[qsl[-1] :])), "padding rows"
        untouched = [s for s in range(self.num_slots) if s not in self.meta.state_slots_cpu]
        assert torch.equal(pool[untouched].nan_to_num(7.0), self.pool[untouched].nan_to_num(7.0))


def _triton():
    from deltaserve.ops.gdn.triton_prefill import TritonGDNPrefill

    return TritonGDNPrefill()


def test_kernel_varlen_float32_k_ne_v():
    """Lengths 1..130 in one launch (chunk boundaries of the reference at 64 crossed), K=32,
    V=48, GVA 2, fresh NaN slots and initial states, padding rows, strided inputs."""
    fresh = [True, False, True, False, True, False]
    Case(LENGTHS, fresh, 1, 2, 32, 48, seed=1).check(_triton(), 2e-5, 2e-5)


@pytest.mark.parametrize(
    "ratio, dk, dv, state_dtype",
    [(1, 16, 16, torch.float32), (3, 16, 24, torch.bfloat16)],
    ids=["gva1", "gva3-bf16-state"],
)
def test_kernel_bf16_inputs(ratio, dk, dv, state_dtype):
    """bf16 q / k / v / gates (the model's dtype on GPU); outputs bf16."""
    lengths, fresh = [2, 17, 65], [False, True, False]
    case = Case(lengths, fresh, 1, ratio, dk, dv, act_dtype=torch.bfloat16, state_dtype=state_dtype)
    tol_state = 1e-5 if state_dtype == torch.float32 else 1e-2
    case.check(_triton(), 1e-2, tol_state)


TILINGS = {  # (BV, warps, chunk of K, q / k copied per row)
    "default": None,
    "bv8-w1-ck8-rows": (8, 1, 8, True),
    "bv16-w2-ck16": (16, 2, 16, False),
    "bv4-w4-ck4-rows": (4, 4, 4, True),
}


@pytest.mark.parametrize("tiling", list(TILINGS))
def test_kernel_matches_plain_recurrence(tiling):
    """One row against `recurrent_gated_delta_rule` on the normalised, head-expanded inputs (the
    token-by-token oracle itself, not the chunked backend), from an initial state; the tiling
    variants (K in chunks, q and k copied per row or not, several V tiles) give the same."""
    from deltaserve.ops.gdn.triton_prefill import PrefillTiling, gdn_prefill_rows

    tiling = TILINGS[tiling] and PrefillTiling(*TILINGS[tiling])

    case = Case([23], [False], 2, 2, 16, 32, pad=0, seed=5)
    q, k, v, a, b, A_log, dt_bias = case.args
    pool = case.pool.clone()
    slot = case.meta.state_slots_cpu[0]
    init = pool[slot].clone()
    out = torch.full_like(v, float("nan"))  # poisoned: every row must be written
    m = case.meta
    gdn_prefill_rows(
        q, k, v, a, b, A_log, dt_bias, pool,
        m.query_start_loc[:-1], m.query_start_loc[1:], m.state_slots, m.has_initial_state, out,
        tiling,
    )  # fmt: skip
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    qe, ke = (l2norm(x).repeat_interleave(2, dim=1) for x in (q, k))  # [T, HV, K]
    want, final = recurrent_gated_delta_rule(qe, ke, v, g, beta, init, 16**-0.5)
    assert rel_err(out, want) < 2e-5
    assert rel_err(pool[slot], final) < 2e-5
    _, chunk_final = chunk_gated_delta_rule(qe, ke, v, g, beta, init, 16**-0.5, chunk_size=8)
    assert rel_err(pool[slot], chunk_final) < 2e-5


def test_kernel_poisoned_out_and_empty_rows():
    """A row of zero tokens leaves its slot as it was; a NaN-poisoned out has every owned row
    written; unowned rows are not written by the kernel (the backend zeroes them)."""
    from deltaserve.ops.gdn.triton_prefill import gdn_prefill_rows

    case = Case([3, 0, 5], [False, True, False], 1, 2, 16, 16, pad=2, seed=7)
    q, k, v, a, b, A_log, dt_bias = case.args
    pool = case.pool.clone()
    out = torch.full_like(v, float("nan"))
    m = case.meta
    gdn_prefill_rows(
        q, k, v, a, b, A_log, dt_bias, pool,
        m.query_start_loc[:-1], m.query_start_loc[1:], m.state_slots, m.has_initial_state, out,
    )  # fmt: skip
    want, want_pool = case.run(TorchGDNPrefill())
    assert rel_err(out[:8], want[:8]) < 2e-5
    assert out[8:].isnan().all()
    empty = m.state_slots_cpu[1]
    assert pool[empty].isnan().all(), "an empty fresh row wrote its slot"
    for slot in m.state_slots_cpu[::2]:
        assert rel_err(pool[slot], want_pool[slot]) < 2e-5


def test_kernel_refuses_unsupported_shapes():
    from deltaserve.ops.gdn.triton_prefill import PrefillTiling, TritonGDNPrefill

    case = Case([2], [True], 1, 2, 16, 16, pad=0)
    q, k, v, a, b, A_log, dt_bias = case.args
    wide_k = torch.zeros(2, 1, 272)
    wide_pool = torch.zeros(3, 2, 16, 272)
    with pytest.raises(ValueError, match="K=272, V=16 unsupported"):
        TritonGDNPrefill().forward(wide_k, wide_k, v, a, b, A_log, dt_bias, wide_pool, case.meta)
    with pytest.raises(ValueError, match="HV=2 is not a multiple of HK=3"):
        q3 = torch.zeros(2, 3, 16)
        TritonGDNPrefill().forward(q3, q3, v, a, b, A_log, dt_bias, case.pool, case.meta)
    with pytest.raises(ValueError, match="ssm_state dtype torch.float16 unsupported"):
        half = case.pool.half()
        TritonGDNPrefill().forward(q, k, v, a, b, A_log, dt_bias, half, case.meta)
    with pytest.raises(ValueError, match=r"ssm_state \(.*\) is not \[num_slots, HV=2"):
        TritonGDNPrefill().forward(q, k, v, a, b, A_log, dt_bias, case.pool[:, :1], case.meta)
    with pytest.raises(ValueError, match="chunk_k=32 does not divide 16"):
        odd = TritonGDNPrefill(PrefillTiling(8, 1, 32, True))
        odd.forward(q, k, v, a, b, A_log, dt_bias, case.pool, case.meta)


# --- the split by row length (the `fla` backend's), torch standing in for fla ---------------


class RecordingTorch(TorchGDNPrefill):
    """The torch reference as the long-row backend, recording what it was given."""

    def __init__(self) -> None:
        super().__init__(chunk_size=16)
        self.calls: list[tuple[int, list[int]]] = []

    def forward(self, q, k, v, a, b, A_log, dt_bias, ssm_state, meta):
        self.calls.append((q.shape[0], list(meta.query_start_loc_cpu)))
        return super().forward(q, k, v, a, b, A_log, dt_bias, ssm_state, meta)


@pytest.mark.parametrize(
    "lengths, fresh, long_tokens",
    [
        ([17, 1, 40, 2, 33], [True, False, False, True, False], [40, 33]),  # scattered long rows
        ([3, 40, 33, 5], [False, True, False, True], [40, 33]),  # contiguous long rows
        ([1, 2, 17], [True, False, False], []),  # every row short: no long call
        ([40, 33], [False, True], [40, 33]),  # every row long: the long backend alone
    ],
    ids=["scattered", "contiguous", "all-short", "all-long"],
)
def test_split_mixed_step_equals_reference(lengths, fresh, long_tokens):
    """Rows of at most 32 tokens through the Triton kernel, longer ones through the stand-in;
    after 2 decode rows (the prefill part's offsets) with padding rows at the end."""
    from deltaserve.ops.gdn.row_split import ShortRowSplitPrefill

    long = RecordingTorch()
    split = ShortRowSplitPrefill(long, max_short_tokens=32)
    case = Case(lengths, fresh, 1, 2, 16, 24, num_decodes=2, seed=len(lengths))
    case.check(split, 2e-5, 2e-5)
    if not long_tokens:
        assert long.calls == []
    elif len(long_tokens) == len(lengths):  # handed the step as it is
        assert long.calls == [(case.args[0].shape[0], case.meta.query_start_loc_cpu)]
    else:  # only the long rows, as a varlen batch of their own
        cu = [0]
        for n in long_tokens:
            cu.append(cu[-1] + n)
        assert long.calls == [(sum(long_tokens), cu)]


def test_split_sends_a_step_with_many_short_tokens_to_the_chunked_backend():
    """Short rows holding more than `max_short_total` tokens together: the whole step goes to
    the chunked backend as it is (its host cost is then the smaller); at the cap they split."""
    from deltaserve.ops.gdn.row_split import ShortRowSplitPrefill

    lengths, fresh = [5, 7, 40], [False, True, False]
    over = RecordingTorch()
    case = Case(lengths, fresh, 1, 2, 16, 24, num_decodes=0, seed=5)
    case.check(ShortRowSplitPrefill(over, max_short_tokens=8, max_short_total=11), 2e-5, 2e-5)
    assert over.calls == [(case.args[0].shape[0], case.meta.query_start_loc_cpu)]
    at_cap = RecordingTorch()
    case = Case(lengths, fresh, 1, 2, 16, 24, num_decodes=0, seed=5)
    case.check(ShortRowSplitPrefill(at_cap, max_short_tokens=8, max_short_total=12), 2e-5, 2e-5)
    assert at_cap.calls == [(40, [0, 40])]


def test_split_reuses_its_plan_across_layers():
    """One split per metadata object: later layer calls with the same metadata reuse it, also
    when two sub-batches alternate in every layer (a step's HEAD and TAIL with in-step
    snapshots, ops/gdn/checkpoints.py); a third step's metadata gets its own."""
    from deltaserve.ops.gdn.row_split import ShortRowSplitPrefill

    split = ShortRowSplitPrefill(RecordingTorch(), max_short_tokens=4)
    case = Case([2, 9, 1], [False, True, True], 1, 1, 16, 16, pad=0, seed=3)
    other = Case([2, 9, 1], [False, True, True], 1, 1, 16, 16, pad=0, seed=3)
    case.run(split)
    plan = split._split_of(case.meta)
    assert plan.long_meta is not None and plan.long_meta.query_start_loc_cpu == [0, 9]
    other.run(split)
    other_plan = split._split_of(other.meta)
    assert other_plan is not plan
    for _ in range(2):  # alternating, as HEAD and TAIL do layer after layer
        case.run(split)
        other.run(split)
        assert split._split_of(case.meta) is plan
        assert split._split_of(other.meta) is other_plan
    third = Case([2, 9, 1], [False, True, True], 1, 1, 16, 16, pad=0, seed=3)
    third.run(split)
    assert split._split_of(case.meta) is not plan  # the oldest was let go
    with pytest.raises(ValueError, match="max_short_tokens must be >= 0"):
        ShortRowSplitPrefill(RecordingTorch(), max_short_tokens=-1)


# --- GPU: 9B shapes (HK=16, HV=32, K=V=128), bf16 activations, mixed row lengths ---------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_LENGTHS = [1, 2, 17, 64, 65, 130, 171, 256, 257, 600]


@gpu
@needs_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["triton", "fla-split", "fla-only"])
def test_gpu_9b_shapes_mixed_rows(backend, state_dtype):
    """The kernel alone, fla with the short-row split (rows <= 256 through the kernel, 257 and
    600 through fla) and fla alone, against the torch reference at 9B shapes."""
    if backend == "triton":
        impl = _triton()
    else:
        pytest.importorskip("fla")
        from deltaserve.ops.gdn.fla_prefill import FlaGDNPrefill

        impl = FlaGDNPrefill(max_short_tokens=256 if backend == "fla-split" else 0)
    fresh = [i % 3 == 0 for i in range(len(GPU_LENGTHS))]
    case = Case(
        GPU_LENGTHS, fresh, 16, 2, 128, 128,
        act_dtype=torch.bfloat16, state_dtype=state_dtype, num_decodes=3, seed=11,
    )  # fmt: skip
    # NOTE: fla's bound (measured on the H200: <= 7e-3, bf16 inputs) covers both paths
    case.check(impl, 1.5e-2, 1.5e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("impl", ["triton", "triton-bv8-w1-ck128", "fla-split"])
def test_gpu_prefill_bench_runs(impl):
    if impl.startswith("fla"):
        pytest.importorskip("fla")
    from deltaserve.ops.gdn.prefill_bench import bench_gdn_prefill

    res = bench_gdn_prefill(2, 33, impl, calls=4, iters=2)
    assert res["us"] > 0 and res["host_us"] > 0 and res["bytes"] > 0


def test_short_row_split_point_is_the_measured_default_unless_set(monkeypatch):
    """The `fla` backend's split point comes from DELTASERVE_GDN_SHORT_ROW_TOKENS when set (0:
    off), else row_split.SHORT_ROW_MAX_TOKENS; a negative value is refused by name."""
    from deltaserve import env

    monkeypatch.delenv("DELTASERVE_GDN_SHORT_ROW_TOKENS", raising=False)
    assert env.gdn_short_row_tokens() is None
    monkeypatch.setenv("DELTASERVE_GDN_SHORT_ROW_TOKENS", "0")
    assert env.gdn_short_row_tokens() == 0
    monkeypatch.setenv("DELTASERVE_GDN_SHORT_ROW_TOKENS", "256")
    assert env.gdn_short_row_tokens() == 256
    monkeypatch.setenv("DELTASERVE_GDN_SHORT_ROW_TOKENS", "-1")
    with pytest.raises(ValueError, match="DELTASERVE_GDN_SHORT_ROW_TOKENS"):
        env.gdn_short_row_tokens()


@pytest.mark.parametrize(
    ("lengths", "fresh", "chunked"),
    [
        ([1, 70, 5, 130], [True, False, True, False], True),  # a row past one 64-token chunk
        ([1, 17, 64], [False, True, False], False),  # every row within one chunk
    ],
    ids=["long-rows", "short-rows"],
)
def test_triton_backend_takes_the_chunked_kernel_past_one_chunk(
    lengths, fresh, chunked, monkeypatch
):
    """The registered `triton` backend (`TritonRowsGDNPrefill`) runs every row in place with
    one kernel: the chunked one when a row has more than 64 new tokens, else the token-by-token
    one; both against the reference."""
    from deltaserve.ops.gdn import row_split

    calls = []
    real = row_split.gdn_chunked_rows
    monkeypatch.setattr(row_split, "gdn_chunked_rows", lambda *a: calls.append(1) or real(*a))
    case = Case(lengths, fresh, 1, 2, 16, 24, num_decodes=1, seed=len(lengths))
    case.check(row_split.TritonRowsGDNPrefill(), 2e-5, 2e-5)
    assert len(calls) == chunked
