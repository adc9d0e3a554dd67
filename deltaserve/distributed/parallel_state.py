"""The tensor-parallel process group: set-up, rank and size, and the collectives the layers use.

One process per device; rank 0 also runs the engine (scheduler, sampler, detokenizer). Every
helper here is a no-op at world size 1, so the single-process path pays nothing.

Groups under TP: the default group for the tensors of the forward (NCCL on CUDA, gloo on CPU),
a gloo group for host values at start-up (the default group itself on CPU), and a gloo *control*
group for the step descriptions rank 0 broadcasts. The control group has no practical timeout:
the other ranks wait in it for as long as the engine is idle (a server without requests).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# NOTE: NVLink multicast (NVLS / symmetric-memory multicast) can put GPUs that other jobs share
# out of service on our hosts: always off, set before any process group or NCCL communicator.
MULTICAST_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

_EMPTY: dict[str, Any] = {
    "rank": 0,
    "size": 1,
    "cpu_group": None,
    "device_group": None,
    "control_group": None,
    "backend": None,
    "symm": None,  # SymmAllReduce: the small all-reduces (setup_symm_all_reduce)
    "all_reduce_path": None,
}
_STATE: dict[str, Any] = dict(_EMPTY)
logger = logging.getLogger(__name__)
_IDLE_TIMEOUT = timedelta(days=365)  # the control group: workers wait there while idle
# all_reduce calls made by this process's Python (eager forwards and graph captures; a replay
# makes none): the bench counts those of one forward
ALL_REDUCE_CALLS = [0]
NORM_REDUCE_CALLS = [0]  # those of them made at a norm (all_reduce_rms_norm)
# CUDA graphs captured while this process is in an NCCL group: destroy_tp resets them first
_GRAPHS: weakref.WeakSet = weakref.WeakSet()
_SYMM_SETUPS = [0]  # symmetric-memory rendezvous tried in this process


def disable_nvlink_multicast() -> None:
    """Set the three environment variables that keep NVLink multicast off (inherited by workers
    spawned afterwards)."""
    os.environ.update(MULTICAST_OFF_ENV)


def backend_for(device: torch.device) -> str:
    """The collective backend for tensors on `device`: nccl on CUDA, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_tp(
    rank: int,
    world: int,
    backend: str,
    init_method: str,
    timeout_s: float = 1800.0,
) -> None:
    """Join the tensor-parallel group as `rank` of `world` (all ranks call this).

    `init_method` is a rendezvous URL (e.g. tcp://127.0.0.1:PORT). With nccl the rank's device
    is `cuda:rank` and NVLink multicast is switched off first.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"bad tensor-parallel rank {rank} of {world}")
    if world == 1:
        _STATE.update(_EMPTY)
        return
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process")
    if backend == "nccl":
        disable_nvlink_multicast()
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    control_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    _STATE.update(
        rank=rank,
        size=world,
        cpu_group=cpu_group,
        device_group=dist.group.WORLD,
        control_group=control_group,
        backend=backend,
    )


def new_cuda_graph() -> torch.cuda.CUDAGraph:
    """A CUDA graph to capture into. Every capture site makes its graphs here: under NCCL
    tensor parallelism the graph is remembered, so leaving the group can release it first.

    NOTE: NCCL counts each live graph that captured one of a communicator's collectives and
    ncclCommAbort (commDestroySync) waits for that count to reach zero, i.e. for the graphs to
    be destroyed; with the decode graphs still held, shutdown hung in the abort on both ranks
    (two H200s, 20 s bound reached)."""
    graph = torch.cuda.CUDAGraph()
    if _STATE["size"] > 1 and _STATE["backend"] == "nccl":
        _GRAPHS.add(graph)
    return graph


def release_cuda_graphs() -> int:
    """Reset every graph made by new_cuda_graph while in the NCCL group (their replays are
    invalid from here on); returns how many."""
    graphs = list(_GRAPHS)
    for graph in graphs:
        graph.reset()
    _GRAPHS.clear()
    return len(graphs)


# how long leaving an NCCL group may take before shutdown gives up waiting for it
NCCL_ABORT_TIMEOUT_S = 20.0


def _abort_nccl(abort: bool) -> None:
    if not abort:
        torch.cuda.synchronize()  # nothing of ours pending in the communicator
    release_cuda_graphs()  # else the abort waits for them (see new_cuda_graph)
    dist.distributed_c10d._abort_process_group()


def _bounded(fn: Callable[[], None], timeout_s: float) -> bool:
    """Run `fn` in a daemon thread and wait at most `timeout_s` for it: True when it returned
    (its exception, if any, re-raised here), False when it is still running."""
    error: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # re-raised in the caller
            error.append(e)

    thread = threading.Thread(target=target, name="tp-teardown", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return False
    if error:
        raise error[0]
    return True


def destroy_tp(abort: bool = False, timeout_s: float | None = None) -> None:
    """Leave the group (idempotent); afterwards tp_size() is 1 again.

    NOTE: NCCL communicators are always aborted, never destroyed: `destroy_process_group` waits
    in ncclCommDestroy for the other ranks and hung rank 0's shutdown on two H100s (every rank
    had left its step loop; the wait never ended). Aborting waits for nobody and clears the
    same process-group state, so a later engine in the same process can form a new group. It
    is safe at shutdown because every rank stops at the same point (the STOP message) with no
    collective in flight; `abort=True` (a dead peer, no STOP) skips the device synchronise.
    ncclCommAbort itself can block (it did once on two H100s at shutdown, in
    `_abort_process_group`), so it runs in a daemon thread and shutdown waits for it at most
    `timeout_s` (default NCCL_ABORT_TIMEOUT_S), then logs what is left behind and goes on: the
    process can exit; forming another NCCL group in this same process may then fail.
    Gloo groups (CPU) are destroyed as usual.
    """
    try:
        if _STATE["size"] > 1 and dist.is_initialized():
            if _STATE["backend"] == "nccl":
                limit = NCCL_ABORT_TIMEOUT_S if timeout_s is None else timeout_s
                if not _bounded(lambda: _abort_nccl(abort), limit):
                    logger.warning(
                        "rank %d: aborting the NCCL communicators did not return in %.0f s; "
                        "leaving them to the process exit (a new tensor-parallel group in "
                        "this process may fail to form)",
                        _STATE["rank"],
                        limit,
                    )
            else:
                dist.destroy_process_group()
    finally:
        _STATE.update(_EMPTY)


def tp_rank() -> int:
    """This process's rank in the tensor-parallel group (0 without TP)."""
    return _STATE["rank"]


def tp_backend() -> str | None:
    """The collective backend of the forward's tensors ("nccl" or "gloo"; None without TP)."""
    return _STATE["backend"]


def tp_size() -> int:
    """The tensor-parallel world size (1 without TP)."""
    return _STATE["size"]


def all_reduce(x: torch.Tensor, small_kernel: bool = True) -> torch.Tensor:
    """Sum `x` over the ranks, in place; returns `x` (untouched at world size 1). Small
    messages take the one-shot kernel when setup_symm_all_reduce installed it (unless
    `small_kernel` is False), others the device group's backend (NCCL, gloo)."""
    if _STATE["size"] > 1:
        ALL_REDUCE_CALLS[0] += 1
        symm = _STATE["symm"]
        if small_kernel and symm is not None and symm.accepts(x):
            return symm(x)
        dist.all_reduce(x, group=_STATE["device_group"])
    return x


def small_all_reduce_installed() -> bool:
    """Whether small all-reduces take the one-shot kernel (setup_symm_all_reduce)."""
    return _STATE["symm"] is not None


def all_reduce_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum over ranks of x + residual), residual updated in place): the end of a
    row-parallel block whose sum was left to the norm. One kernel where setup_symm_all_reduce
    installed the fused path and x fits it; else `all_reduce(x)` then `rms_norm` (a FusedOps
    rms_norm: the same math)."""
    NORM_REDUCE_CALLS[0] += 1
    symm = _STATE["symm"]
    if _STATE["size"] > 1 and symm is not None and symm.fuses(x, residual):
        ALL_REDUCE_CALLS[0] += 1
        return symm.reduce_rms_norm(x, residual, weight, eps, zero_centered)
    x = all_reduce(x)
    return rms_norm(x, weight, eps, zero_centered, residual=residual)


def fused_norm_installed() -> bool:
    """Whether all_reduce_rms_norm runs the fused kernel for the messages it fits."""
    return _STATE["symm"] is not None and _STATE["symm"].fused


def setup_symm_all_reduce(dtype: torch.dtype, device: torch.device, mode: str = "auto") -> str:
    """Install the kernels over symmetric memory for small messages of `dtype`
    (deltaserve/distributed/symm_all_reduce.py) on every rank, or on none; every rank calls
    this at the same point. `mode` (DELTASERVE_TP_ALL_REDUCE): `auto` the one-shot all-reduce
    and the all-reduce fused with the next RMSNorm, `oneshot` the first alone, `nccl` neither.
    Once per process of rank 0 (SymmAllReduce says why). Both kernels are checked against NCCL
    once before use; a failure on any rank leaves every rank on NCCL. Returns what the
    all-reduces run, with the reason when not (also kept: all_reduce_path())."""
    from deltaserve.distributed.symm_all_reduce import SymmAllReduce, unavailable_reason

    if _STATE["size"] == 1:
        return "no all-reduce (one rank)"
    reason = None if mode != "nccl" else "DELTASERVE_TP_ALL_REDUCE=nccl"
    if reason is None:
        reason = unavailable_reason(device, _STATE["backend"], _STATE["size"])
    earlier = broadcast_object(_SYMM_SETUPS[0])  # rank 0's count decides for every rank
    if reason is None and earlier:
        reason = (
            "an earlier tensor-parallel engine in this process set up symmetric memory, whose "
            "rendezvous state outlives its group (a second set-up hung)"
        )
    if all_reduce_min_host([int(reason is None)])[0]:
        _SYMM_SETUPS[0] += 1
        try:
            symm = SymmAllReduce(_STATE["device_group"], dtype, device, fused=mode == "auto")
            reason = _self_check(symm, device)
        except Exception as e:  # told to the other ranks below
            reason = f"symmetric memory set-up failed: {e}"
        if all_reduce_min_host([int(reason is None)])[0]:
            _STATE["symm"] = symm
        else:
            reason = reason or "another rank's symmetric memory set-up or check failed"
    else:
        reason = reason or "another rank cannot use it"
    symm = _STATE["symm"]
    if symm is not None:
        kib = symm.max_bytes // 1024
        how = f"one-shot over symmetric memory (NVLink peer-to-peer) up to {kib} KiB, NCCL above"
        if symm.fused:
            how += (
                f"; at the end of row-parallel blocks, up to {kib} KiB fused with the residual "
                "add and RMSNorm in one kernel"
            )
    else:
        how = f"{_STATE['backend']} (symmetric-memory kernels passed over: {reason})"
    _STATE["all_reduce_path"] = how
    return how


def _self_check(symm, device: torch.device) -> str | None:
    """Run both kernels of `symm` once on every rank against NCCL's sum (each rank's own
    values); None, or what differed."""
    from deltaserve.ops.fused.reference import rms_norm

    gen = torch.Generator(device="cpu").manual_seed(4321 + _STATE["rank"])
    rows, hidden = 3, 256
    x = torch.randn(rows, hidden, generator=gen).to(device, symm.dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(device, symm.dtype)
    weight = torch.randn(hidden, generator=gen).to(device, symm.dtype)
    want = x.clone()
    dist.all_reduce(want, group=_STATE["device_group"])

    def off(a: torch.Tensor, b: torch.Tensor) -> bool:  # beyond two ulps of the largest value
        # NOTE: not bitwise: NCCL may sum more than two ranks in another order
        return bool((a.float() - b.float()).abs().max() > 2**-6 * b.float().abs().max())

    got = symm(x.clone())
    if off(got, want):
        return f"the one-shot kernel's sum differs from NCCL's by {(got - want).abs().max()}"
    if symm.fused:
        y, r = symm.reduce_rms_norm(x.clone(), residual.clone(), weight, 1e-6, False)
        y_want, r_want = rms_norm(want, weight, 1e-6, False, residual=residual.clone())
        if off(r, r_want) or off(y, y_want):
            return "the fused all-reduce + RMSNorm kernel differs from NCCL + the reference"
    torch.cuda.synchronize(device)
    return None


def all_reduce_path() -> str | None:
    """What the all-reduces of the current group run (setup_symm_all_reduce's words), or None
    before the set-up or without TP."""
    return _STATE["all_reduce_path"]


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` (same shape on all ranks) along `dim`, in rank order."""
    size = _STATE["size"]
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=_STATE["device_group"])
    return torch.cat(parts, dim=dim)


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0 sends `obj` (picklable) to every rank over the control group; every rank returns
    it (the others block until rank 0 sends)."""
    if _STATE["size"] == 1:
        return obj
    box = [obj if _STATE["rank"] == 0 else None]
    dist.broadcast_object_list(box, src=0, group=_STATE["control_group"])
    return box[0]


def broadcast_tensor(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` into every rank's `x` (same shape and dtype everywhere), in place on the
    device group: stream-ordered on CUDA, no host sync (no-op at world size 1)."""
    if _STATE["size"] > 1:
        dist.broadcast(x, src=0, group=_STATE["device_group"])
    return x


def all_reduce_min_host(values: list[int]) -> list[int]:
    """Element-wise minimum of integer lists over the ranks (host values, gloo group)."""
    if _STATE["size"] == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_STATE["cpu_group"])
    return [int(v) for v in t.tolist()]
