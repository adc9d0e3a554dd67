"""Tensor parallelism: the process group and its collectives (no-ops at world size 1), the
checkpoint sharding rules, and the worker processes of ranks 1..N-1."""

from deltaserve.distributed.parallel_state import (
    all_gather,
    all_reduce,
    backend_for,
    broadcast_object,
    destroy_tp,
    disable_nvlink_multicast,
    init_tp,
    tp_rank,
    tp_size,
)

__all__ = [
    "all_gather",
    "all_reduce",
    "backend_for",
    "broadcast_object",
    "destroy_tp",
    "disable_nvlink_multicast",
    "init_tp",
    "tp_rank",
    "tp_size",
]
