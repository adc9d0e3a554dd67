"""Microbenchmark of one GDN layer's decode step (used by `deltaserve bench kernels`), one or
q tokens per sequence (q > 1: a speculative verification step).

The step is bound by the recurrent state, read and written once: its floor is
`bytes / copy bandwidth` with bytes = state read + written + q, k, v, a, b and out.

Each timed call reads a different set of pool slots (a pool of several batches), so the state
comes from DRAM as it does in a model step, not from an L2 that the last call warmed (the
state of a small batch fits in the H200's L2). With `graph=True` the calls over all sets are
captured in one CUDA graph and replayed, as the engine replays decode steps.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable

import torch

POOL_BYTES = 256 << 20  # enough distinct state to defeat the L2 between calls


def _decode_fn(
    impl: str, batch: int, device: torch.device, query_len: int = 1
) -> Callable[..., torch.Tensor]:
    """fn(q, k, v, a, b, A_log, dt_bias, state, slots) for `impl` over `query_len` tokens per
    sequence; state is our K-last pool [num_slots, HV, V, K], except for "fla", which gets a
    dense [B, HV, V, K] state of its own."""
    if impl == "triton":
        from deltaserve.ops.gdn.triton_decode import gdn_decode

        return functools.partial(gdn_decode, query_len=query_len)
    if impl == "torch":
        from deltaserve.ops.gdn.reference import TorchGDNDecode

        return functools.partial(TorchGDNDecode().forward, query_len=query_len)
    if impl == "flashinfer":
        from deltaserve.ops.gdn.flashinfer_decode import FlashInferGDNDecode

        return functools.partial(FlashInferGDNDecode().forward, query_len=query_len)
    if impl == "fla":
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        # varlen layout, q tokens per sequence; state_v_first: [N, HV, V, K] like ours, but fla
        # reads a dense initial state and writes a new final state (it takes no slot indices)
        cu_seqlens = torch.arange(batch + 1, device=device, dtype=torch.long) * query_len

        def fla_decode(q, k, v, a, b, A_log, dt_bias, state, slots):
            o, _ = fused_recurrent_gated_delta_rule(
                q[None],
                k[None],
                v[None],
                g=a[None],
                beta=b[None],
                initial_state=state,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True,
                A_log=A_log,
                dt_bias=dt_bias,
                use_beta_sigmoid_in_kernel=True,
                state_v_first=True,
                cu_seqlens=cu_seqlens,
            )
            return o[0]

        return fla_decode
    raise ValueError(f"unknown impl {impl!r} (triton, flashinfer, torch, fla)")


def bench_gdn_decode(
    batch: int,
    num_v_heads: int = 32,
    num_k_heads: int = 16,
    head_dim: int = 128,
    state_dtype: torch.dtype = torch.float32,
    impl: str = "triton",
    graph: bool = True,
    iters: int = 20,
    act_dtype: torch.dtype = torch.bfloat16,
    query_len: int = 1,
) -> dict[str, float]:
    """Time one layer's decode step of `batch` sequences on the current CUDA device.

    Args:
        batch: sequences (`query_len` tokens each). num_v_heads, num_k_heads, head_dim: HV, HK,
            K = V.
        state_dtype: the pool's dtype (fla always keeps a float32 state of its own).
        impl: "triton" (ours), "flashinfer" (its CuTe DSL kernels, deltaserve.ops.gdn.
            flashinfer_decode), "torch" (the reference) or "fla" (fla-core's fused_recurrent).
        graph: capture the calls in a CUDA graph and time its replays; else time eager calls.
        iters: timed replays (or eager rounds); the median is reported.

    Returns:
        dict(us=median microseconds per call, tb_s=bytes / time in TB/s, bytes=bytes per call,
        calls=calls per replay).
    """
    dev = torch.device("cuda")
    hk, hv, d = num_k_heads, num_v_heads, head_dim
    state_elt = 4 if impl == "fla" else torch.empty(0, dtype=state_dtype).element_size()
    set_bytes = batch * hv * d * d * state_elt
    num_sets = max(2, min(64, -(-POOL_BYTES // set_bytes)))
    act = torch.empty(0, dtype=act_dtype).element_size()
    rows = batch * query_len  # token rows
    nbytes = 2 * set_bytes + rows * act * (2 * hk * d + 2 * hv * d + 2 * hv)

    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(rows, hk, d, device=dev, generator=gen).to(act_dtype)
    k = torch.randn(rows, hk, d, device=dev, generator=gen).to(act_dtype)
    v = torch.randn(rows, hv, d, device=dev, generator=gen).to(act_dtype)
    a = torch.randn(rows, hv, device=dev, generator=gen).to(act_dtype)
    b = torch.randn(rows, hv, device=dev, generator=gen).to(act_dtype)
    A_log = torch.rand(hv, device=dev, generator=gen).add(0.01).log()
    dt_bias = torch.randn(hv, device=dev, generator=gen)
    fn = _decode_fn(impl, batch, dev, query_len)
    if impl == "fla":
        states = [
            0.1 * torch.randn(batch, hv, d, d, device=dev, generator=gen) for _ in range(num_sets)
        ]
        slot_sets = [None] * num_sets
    else:
        pool = torch.randn(num_sets * batch + 1, hv, d, d, device=dev, generator=gen)
        pool = pool.mul_(0.1).to(state_dtype)
        perm = torch.randperm(num_sets * batch, device=dev, generator=gen) + 1  # slot 0: null
        slot_sets = list(perm.view(num_sets, batch))
        states = [pool] * num_sets

    def run_all() -> None:
        for state, slots in zip(states, slot_sets):
            fn(q, k, v, a, b, A_log, dt_bias, state, slots)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_all()  # compile / warm up outside any capture
    torch.cuda.current_stream().wait_stream(stream)
    step = run_all
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            run_all()
        step = cuda_graph.replay
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / num_sets)  # us per call
    us = statistics.median(times)
    return dict(us=us, tb_s=nbytes / (us * 1e-6) / 1e12, bytes=float(nbytes), calls=num_sets)
