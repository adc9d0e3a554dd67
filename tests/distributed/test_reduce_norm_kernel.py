"""The fused all-reduce + residual add + RMSNorm kernel (distributed/triton_reduce_norm.py)
against all-reduce then the reference norm, with the ranks simulated in one process: each
rank's "symmetric buffer" is a plain tensor of this device, and the ranks' kernels run one
after another. A rank waits for the flags of every peer, so before rank 0 runs, each later
rank's row data and its flags are put in place as that rank's kernel would put them (the
earlier ranks' kernels then signal the later ones themselves). On the GPU the real exchange
over NVLink runs in tests/distributed/test_tensor_parallel_gpu.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from kernel_helpers import kernel_device, requires_triton

from deltaserve.distributed.triton_reduce_norm import reduce_rms_norm
from deltaserve.ops.fused.reference import rms_norm

MAX_ROWS = 4


class Ranks:
    """`world` simulated ranks: per rank a byte buffer laid out as SymmAllReduce's fused part
    (two halves of rows, then int64 flags [MAX_ROWS, world]) and its row counters."""

    def __init__(self, world: int, hidden: int, dtype: torch.dtype) -> None:
        dev = kernel_device()
        self.world, self.hidden, self.dtype = world, hidden, dtype
        self.half = MAX_ROWS * hidden * dtype.itemsize
        self.data_offset, self.flag_offset = 64, 64 + 2 * self.half
        size = self.flag_offset + MAX_ROWS * world * 8
        self.bufs = [torch.zeros(size, dtype=torch.uint8, device=dev) for _ in range(world)]
        self.bases = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64, device=dev)
        self.epochs = [torch.zeros(MAX_ROWS, dtype=torch.int64, device=dev) for _ in range(world)]
        span = slice(self.data_offset, self.data_offset + 2 * self.half)
        self.regions = [b[span].view(dtype) for b in self.bufs]  # each rank's, in rank order

    def rows(self, rank: int, half: int) -> torch.Tensor:
        """Rank `rank`'s half `half` as [MAX_ROWS, hidden]."""
        at = self.data_offset + half * self.half
        return self.bufs[rank][at : at + self.half].view(self.dtype).view(MAX_ROWS, self.hidden)

    def flags(self, rank: int) -> torch.Tensor:
        """The flags on rank `rank`: [MAX_ROWS, world] int64."""
        return self.bufs[rank][self.flag_offset :].view(torch.int64).view(MAX_ROWS, self.world)

    def call(self, xs: list[torch.Tensor], residual: torch.Tensor, weight, zero_centered=False):
        """Every rank's reduce_rms_norm of its own xs[r] and a copy of `residual`: [(y, r)]."""
        for t in range(xs[0].shape[0]):  # what the later ranks' kernels will have done
            epoch = int(self.epochs[0][t]) + 1  # row t's count
            for p in range(1, self.world):
                self.rows(p, epoch % 2)[t] = xs[p][t]
                for q in range(p):
                    self.flags(q)[t, p] = epoch
        out = []
        for r in range(self.world):
            res = residual.clone()
            out.append(
                reduce_rms_norm(
                    xs[r],
                    res,
                    weight,
                    1e-6,
                    zero_centered,
                    self.regions,
                    self.bases,
                    self.epochs[r],
                    r,
                    self.flag_offset,
                )  # fmt: skip
            )
        return out


def _want(xs, residual, weight, zero_centered=False):
    total = torch.stack([x.float() for x in xs]).sum(0).to(xs[0].dtype)  # in rank order
    return rms_norm(total, weight, 1e-6, zero_centered, residual=residual.clone())


@requires_triton
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_every_rank_gets_the_reduced_norm_float32(world: int, zero_centered: bool) -> None:
    gen = torch.Generator().manual_seed(world)
    dev, hidden = kernel_device(), 40  # not a power of two: masked columns
    ranks = Ranks(world, hidden, torch.float32)
    weight = torch.randn(hidden, generator=gen).to(dev)
    for rows in (3, 1, 3):  # successive calls alternate halves; row 0 advances every call
        xs = [torch.randn(rows, hidden, generator=gen).to(dev) for _ in range(world)]
        residual = torch.randn(rows, hidden, generator=gen).to(dev)
        y_want, r_want = _want(xs, residual, weight, zero_centered)
        for y, r in ranks.call(xs, residual, weight, zero_centered):
            assert torch.equal(r, r_want)  # the sum and the residual add round alike
            torch.testing.assert_close(y, y_want, rtol=1e-5, atol=1e-5)
    # row 0 ran three calls, rows 1-2 two, row 3 none: every rank counted alike
    for r in range(world):
        assert ranks.epochs[r].tolist() == [3, 2, 2, 0]
        flags = ranks.flags(r)
        for p in range(world):
            if p != r:  # the peers' last announcements to rank r
                assert flags[:, p].tolist() == [3, 2, 2, 0]


@requires_triton
def test_bfloat16_rows() -> None:
    gen = torch.Generator().manual_seed(7)
    dev, hidden = kernel_device(), 64
    ranks = Ranks(2, hidden, torch.bfloat16)
    weight = torch.randn(hidden, generator=gen).to(dev, torch.bfloat16)
    xs = [torch.randn(2, hidden, generator=gen).to(dev, torch.bfloat16) for _ in range(2)]
    residual = torch.randn(2, hidden, generator=gen).to(dev, torch.bfloat16)
    y_want, r_want = _want(xs, residual, weight)
    # NOTE: the interpreter truncates float32 -> bf16 where the GPU rounds: two ulps of slack
    for y, r in ranks.call(xs, residual, weight):
        torch.testing.assert_close(r, r_want, rtol=2**-6, atol=2**-6)
        torch.testing.assert_close(y, y_want, rtol=2**-6, atol=2**-5)


def test_rows_move_in_16_byte_vectors_on_sm90() -> None:
    """Compiled for sm_90 (on CPU: Triton's NVIDIA backend, tests/ops/sm90_compile.py) at the
    27B's hidden size in bf16: the rows are stored and the peers' rows loaded in 16-byte
    vectors (.cg for the peers'), the flags raised with release and read with acquire
    semantics at system scope. Scalar 2-byte loads over NVLink made a first version 2.3x
    slower than PyTorch's one-shot all-reduce."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))
    from sm90_compile import compile_many, ptxas_path

    if ptxas_path() is None:
        pytest.skip("this Triton has no NVIDIA backend / ptxas")
    pointers = ["x_ptr", "res_ptr", "w_ptr", "out_ptr", "mine_ptr", *(f"d{i}" for i in range(8))]
    signature = {
        **dict.fromkeys(pointers, "*bf16"),
        **dict.fromkeys(("bases_ptr", "epoch_ptr"), "*i64"),
        **dict.fromkeys(("rank", "stride_x", "stride_r", "stride_o"), "i32"),
        "eps": "fp32",
    }
    consts = dict(HALF=1 << 19, FLAG_OFFSET=3 << 20, WORLD=2, H=5120, ZERO_CENTERED=False)
    consts["BLOCK"] = 8192
    signature.update(dict.fromkeys(consts, "constexpr"))
    job = dict(
        kernel="deltaserve.distributed.triton_reduce_norm:_reduce_norm_kernel",
        signature=signature,
        constexprs=consts,
        div16=[*pointers, "bases_ptr", "epoch_ptr", "stride_x", "stride_r", "stride_o"],
        num_warps=8,
        num_stages=1,
    )
    (c,) = compile_many([job])
    assert "error" not in c, c.get("error")
    ops = c["memory_ops"]
    assert ops.get("ld.global.cg.v4.b32", 0) > 0, ops  # the peers' rows
    assert ops.get("st.global.v4.b32", 0) > 0, ops
    assert not [op for op in ops if op.endswith((".b16", ".u16"))], ops  # no 2-byte accesses
    assert ops.get("atom.global.sys.release.exch.b64", 0) > 0, ops
    assert ops.get("ld.global.sys.acquire.b64", 0) > 0, ops
    assert c["spill_bytes"] == 0
