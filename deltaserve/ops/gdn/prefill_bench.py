"""Microbenchmark of one GDN layer's prefill call (used by `deltaserve bench kernels --only
gdn_prefill`): device time AND host time per call, for fla's chunked kernels alone, the `fla`
backend with its short-row split, and the one-launch Triton kernel (with its tiling variants);
on request (`triton-chunked`), the one-launch chunked kernel (ops/gdn/triton_chunked.py).

A chat turn with prefix caching prefills a few hundred new tokens per sequence, and such steps
are bound by the host's launch cost, not the device: both are reported, so the split point
(deltaserve.ops.gdn.row_split.SHORT_ROW_MAX_TOKENS) can be chosen from one run.

Method: one step's `calls` layer calls on the same metadata (as the engine's GDN layers share
one), every sequence continuing from an initial state. The device first runs a long sleep
kernel; the host enqueues the calls meanwhile (host time = wall time of the enqueueing / calls,
no synchronisation inside, the device never waiting on the host), and events around the calls
time the device alone (device time / calls). If the sleep ended before the host was done, it is
doubled and the round repeated, so host gaps never count as device time. Median of `iters`
rounds, after warm-up (compilation, fla's autotuning).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from deltaserve.forward_context import PrefillMetadata
from deltaserve.ops.gdn import GDNPrefillBackend
from deltaserve.ops.gdn.row_split import SHORT_ROW_MAX_TOKENS
from deltaserve.ops.gdn.triton_prefill import PrefillTiling

# tilings of the Triton kernel timed beside its default one (bv8-w1-ck32-rows at K = V = 128)
TRITON_TILINGS = [
    PrefillTiling(8, 1, 128, False),  # all lanes along K, one q / k copy: fewer registers
    PrefillTiling(4, 1, 32, True),
    PrefillTiling(16, 1, 32, True),
    PrefillTiling(16, 2, 32, True),
    PrefillTiling(32, 4, 32, True),
]


def prefill_impls(has_fla: bool) -> list[str]:
    """Implementations timed: fla alone and the fla backend with its split (when fla is
    installed), the token-by-token kernel at its default tiling, the chunked kernel
    (`triton-chunked`, ops/gdn/triton_chunked.py), and the token-by-token kernel at each of
    TRITON_TILINGS."""
    impls = ["fla", "fla-split"] if has_fla else []
    return impls + ["triton", "triton-chunked"] + [f"triton-{t.name}" for t in TRITON_TILINGS]


def make_backend(impl: str) -> GDNPrefillBackend:
    """The backend object of `impl` (names of `prefill_impls`)."""
    if impl in ("fla", "fla-split"):
        from deltaserve.ops.gdn.fla_prefill import FlaGDNPrefill

        split = SHORT_ROW_MAX_TOKENS if impl == "fla-split" else 0
        return FlaGDNPrefill(max_short_tokens=split)
    if impl == "triton-chunked":
        from deltaserve.ops.gdn.triton_chunked import TritonChunkedGDNPrefill

        return TritonChunkedGDNPrefill()
    from deltaserve.ops.gdn.triton_prefill import TritonGDNPrefill

    if impl == "triton":
        return TritonGDNPrefill()
    tilings = {f"triton-{t.name}": t for t in TRITON_TILINGS}
    if impl in tilings:
        return TritonGDNPrefill(tilings[impl])
    raise ValueError(f"unknown GDN prefill impl {impl!r}")


def make_meta(seqs: int, tokens: int, device: torch.device) -> PrefillMetadata:
    """`seqs` sequences of `tokens` new tokens each on 1000 cached ones, slots 1..seqs."""
    starts = [i * tokens for i in range(seqs + 1)]
    return PrefillMetadata(
        token_offset=0,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.full((seqs,), 1000 + tokens, dtype=torch.int32, device=device),
        context_lens=torch.full((seqs,), 1000, dtype=torch.int32, device=device),
        state_slots=torch.arange(1, seqs + 1, dtype=torch.int64, device=device),
        has_initial_state=torch.ones(seqs, dtype=torch.bool, device=device),
        query_start_loc_cpu=starts,
        context_lens_cpu=[1000] * seqs,
        state_slots_cpu=list(range(1, seqs + 1)),
        max_query_len=tokens,
    )


def _time_round(fn: Callable[[], None], calls: int, sleep_cycles: int) -> tuple[float, float]:
    """(host s, device s) per call of one round behind a `sleep_cycles` sleep, or (nan, nan)
    when the sleep ended before the host had enqueued every call."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(sleep_cycles)
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    covered = not start.query()  # the device was still asleep when the host was done
    end.record()
    end.synchronize()
    if not covered:
        return float("nan"), float("nan")
    return host, start.elapsed_time(end) * 1e-3 / calls


def bench_gdn_prefill(
    seqs: int,
    tokens: int,
    impl: str,
    num_v_heads: int = 32,
    num_k_heads: int = 16,
    head_dim: int = 128,
    state_dtype: torch.dtype = torch.float32,
    calls: int = 24,
    iters: int = 5,
) -> dict[str, float]:
    """Time one GDN prefill layer call of `seqs` x `tokens` new tokens (bf16 activations, as
    strided views of one projection output) on the current CUDA device.

    Returns:
        dict(us=device microseconds per call, host_us=host microseconds per call, bytes=state
        read + written + activations per call).
    """
    dev = torch.device("cuda")
    hk, hv, d = num_k_heads, num_v_heads, head_dim
    total = seqs * tokens
    gen = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    qkv = torch.randn(total, 2 * hk * d + hv * d, device=dev, generator=gen).to(bf)
    q = qkv[:, : hk * d].view(total, hk, d)  # [T, HK, K]
    k = qkv[:, hk * d : 2 * hk * d].view(total, hk, d)
    v = qkv[:, 2 * hk * d :].view(total, hv, d)  # [T, HV, V]
    ab = torch.randn(total, 2 * hv, device=dev, generator=gen).to(bf)
    a, b = ab[:, :hv], ab[:, hv:]
    A_log = torch.rand(hv, device=dev, generator=gen).add(0.01).log()
    dt_bias = torch.randn(hv, device=dev, generator=gen)
    pool = (0.1 * torch.randn(seqs + 1, hv, d, d, device=dev, generator=gen)).to(state_dtype)
    meta = make_meta(seqs, tokens, dev)
    backend = make_backend(impl)
    state_elt = pool.element_size()
    nbytes = 2 * seqs * hv * d * d * state_elt + total * 2 * (2 * hk * d + 2 * hv * d + 2 * hv)

    def call() -> None:
        backend.forward(q, k, v, a, b, A_log, dt_bias, pool, meta)

    for _ in range(3):  # compile, autotune
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / calls  # bounds both host and device per call
    sleep_cycles = int(4 * calls * wall * 2e9) + 1_000_000  # ~4x the round at <= 2 GHz
    hosts, devices = [], []
    while len(hosts) < iters:
        host, device = _time_round(call, calls, sleep_cycles)
        if host != host:  # nan: the sleep did not cover the enqueueing
            sleep_cycles *= 2
            if sleep_cycles > 1 << 40:
                raise RuntimeError("the device never stayed asleep while the host enqueued")
            continue
        hosts.append(host)
        devices.append(device)
    us = statistics.median(devices) * 1e6
    return dict(us=us, host_us=statistics.median(hosts) * 1e6, bytes=float(nbytes))
