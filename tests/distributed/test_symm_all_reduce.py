"""The choice between the one-shot all-reduce over symmetric memory and the group's backend, on
CPU (the kernel itself runs in tests/distributed/test_tensor_parallel_gpu.py, where its sums
are compared with NCCL's and TP output with TP=1)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deltaserve import env
from deltaserve.distributed import parallel_state as ps
from deltaserve.distributed.symm_all_reduce import SymmAllReduce, unavailable_reason


def _symm(max_numel: int, dtype: torch.dtype = torch.bfloat16) -> SymmAllReduce:
    symm = SymmAllReduce.__new__(SymmAllReduce)  # no group: the choice only
    symm.dtype, symm.max_numel = dtype, max_numel
    return symm


def test_accepts_small_aligned_messages_of_its_dtype() -> None:
    symm = _symm(1024)
    assert symm.accepts(torch.zeros(2, 512, dtype=torch.bfloat16))
    assert not symm.accepts(torch.zeros(3, 512, dtype=torch.bfloat16))  # over max_numel
    assert not symm.accepts(torch.zeros(2, 512, dtype=torch.float32))  # another dtype
    assert not symm.accepts(torch.zeros(1, 7, dtype=torch.bfloat16))  # 14 bytes: not 16-aligned
    x = torch.zeros(2, 520, dtype=torch.bfloat16)
    assert not symm.accepts(x[:, :512])  # not contiguous
    assert not symm.accepts(x.view(-1)[4:516])  # starts 8 bytes in


def test_all_reduce_sends_accepted_messages_to_the_kernel(monkeypatch) -> None:
    calls: list[str] = []

    class Fake:
        def accepts(self, x: torch.Tensor) -> bool:
            return x.numel() <= 8

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(f"kernel {x.numel()}")
            return x

    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None: calls.append(f"nccl {x.numel()}"))
    monkeypatch.setitem(ps._STATE, "size", 2)
    monkeypatch.setitem(ps._STATE, "symm", Fake())
    assert ps.small_all_reduce_installed()
    ps.all_reduce(torch.zeros(8))
    ps.all_reduce(torch.zeros(9))
    ps.all_reduce(torch.zeros(8), small_kernel=False)
    assert calls == ["kernel 8", "nccl 9", "nccl 8"]


def test_unavailable_reasons() -> None:
    cpu = torch.device("cpu")
    assert unavailable_reason(cpu, "gloo", 2) == "not an NCCL group on CUDA"
    assert "world size 3" in unavailable_reason(torch.device("cuda", 0), "nccl", 3)


def test_setup_without_tp_and_on_gloo() -> None:
    assert (
        ps.setup_symm_all_reduce(torch.bfloat16, torch.device("cpu")) == "no all-reduce (one rank)"
    )


def test_tp_all_reduce_env(monkeypatch) -> None:
    monkeypatch.delenv("DELTASERVE_TP_ALL_REDUCE", raising=False)
    assert env.tp_all_reduce() == "auto"
    monkeypatch.setenv("DELTASERVE_TP_ALL_REDUCE", "NCCL")
    assert env.tp_all_reduce() == "nccl"
    monkeypatch.setenv("DELTASERVE_TP_ALL_REDUCE", "oneshot")
    assert env.tp_all_reduce() == "oneshot"
    monkeypatch.setenv("DELTASERVE_TP_ALL_REDUCE", "custom")
    with pytest.raises(ValueError, match="must be auto, oneshot or nccl, got 'custom'"):
        env.tp_all_reduce()


def test_setup_once_per_process_and_failures_fall_back(monkeypatch) -> None:
    """The first TP engine of a process installs the kernel; a later one (new workers) runs
    the group's backend and says why, as does a failed set-up."""
    from deltaserve.distributed import symm_all_reduce

    made: list[str] = []

    class Fake:
        max_bytes = 1 << 20

        def __init__(self, group, dtype, device, fused) -> None:
            if made and made[-1] == "fail next":
                raise RuntimeError("no peer memory")
            self.fused = fused
            made.append("made")

    checks: list[str | None] = []
    monkeypatch.setattr(symm_all_reduce, "SymmAllReduce", Fake)
    monkeypatch.setattr(ps, "_self_check", lambda symm, device: checks.pop() if checks else None)
    monkeypatch.setattr(symm_all_reduce, "unavailable_reason", lambda *a: None)
    monkeypatch.setattr(ps, "broadcast_object", lambda obj=None: obj)
    monkeypatch.setattr(ps, "all_reduce_min_host", lambda values: list(values))
    monkeypatch.setattr(ps, "_SYMM_SETUPS", [0])
    for key, value in (("size", 2), ("backend", "nccl"), ("symm", None), ("all_reduce_path", None)):
        monkeypatch.setitem(ps._STATE, key, value)
    cuda = torch.device("cuda", 0)
    how = ps.setup_symm_all_reduce(torch.bfloat16, cuda)
    assert how.startswith("one-shot over symmetric memory") and "1024 KiB" in how
    assert "fused with the residual add and RMSNorm in one kernel" in how
    assert ps.small_all_reduce_installed() and ps.fused_norm_installed()
    assert made == ["made"]
    assert ps.all_reduce_path() == how

    ps._STATE["symm"] = None  # the next engine in this process
    how = ps.setup_symm_all_reduce(torch.bfloat16, cuda)
    assert how.startswith("nccl (symmetric-memory kernels passed over: an earlier")
    assert not ps.small_all_reduce_installed() and made == ["made"]

    ps._SYMM_SETUPS[0] = 0
    made.append("fail next")
    how = ps.setup_symm_all_reduce(torch.bfloat16, cuda)
    assert "symmetric memory set-up failed: no peer memory" in how
    assert not ps.small_all_reduce_installed()
    assert "DELTASERVE_TP_ALL_REDUCE=nccl" in ps.setup_symm_all_reduce(
        torch.bfloat16, cuda, mode="nccl"
    )

    made.clear()
    ps._SYMM_SETUPS[0] = 0  # oneshot: the one-shot kernel alone
    how = ps.setup_symm_all_reduce(torch.bfloat16, cuda, mode="oneshot")
    assert "fused" not in how
    assert ps.small_all_reduce_installed() and not ps.fused_norm_installed()

    ps._STATE["symm"] = None  # a kernel that disagrees with NCCL at set-up is not installed
    ps._SYMM_SETUPS[0] = 0
    checks.append("the one-shot kernel's sum differs from NCCL's by 1.0")
    how = ps.setup_symm_all_reduce(torch.bfloat16, cuda)
    assert how.startswith("nccl (symmetric-memory kernels passed over: the one-shot kernel's")
    assert not ps.small_all_reduce_installed()
