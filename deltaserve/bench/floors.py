"""The floors every throughput figure is stated against, and the ceilings they divide by.

- decode step: (weights streamed + paged cache read + slot state read and written) / copy
  bandwidth, where the weights streamed are every parameter except the embedding table (a
  gather of a few rows), unless it is tied to the lm_head; the paged cache read is, for every
  spec with pool "paged" (attention K / V, an MLA latent), its bytes per token for the whole
  context of every sequence; the slot state is, for every spec with pool "slots" (GDN SSM and
  conv state), its bytes per sequence, read and written once.
  A MoE model's routed experts are streamed only where the step selects them: the weights
  streamed are the dense ones (attention / GDN, router, shared expert, norms, lm_head) plus, for
  each MoE layer, the number of DISTINCT experts the step's tokens selected there times one
  expert's bytes (w13 + w2). That number comes from the step's real routing
  (deltaserve.bench.routing); `decode_step_bytes` refuses a MoE model without it.
- prefill: (2 x active params x tokens + causal attention FLOPs) / matmul rate, where the
  active params count every parameter once (as peers' figures do), a MoE layer's routed
  experts top-k of E (each token multiplies by k experts), and the attention FLOPs are QK^T and
  PV over the causal triangle: 2 x 2 x Hq x D x P (P + 1) / 2 per layer whose spec has query
  heads.

The ceilings are measured on the GPU the figures come from (`measure_ceilings`): a
device-to-device copy (bytes read + written per second) and a bf16 8192^3 matmul. On CPU the
bench measures the host instead (`measure_cpu_ceilings`: a 64 MiB copy and a 1024^3 matmul in the
model dtype), so that CPU rows are not stated against a GPU's ceilings. The defaults below are
those measured on an H200 in November 2026: 4.27 TB/s copy, 773 TFLOP/s bf16 matmul.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only when costs are computed (`deltaserve --help` is fast)
    import torch
    from torch import nn

    from deltaserve.cache.spec import CacheSpec

H200_COPY_BYTES_PER_S = 4.27e12
H200_MATMUL_FLOP_PER_S = 773e12


@dataclass(frozen=True)
class Ceilings:
    """What a device can do at best: copy bandwidth (bytes read + written per second) and bf16
    matmul rate. `source` says where the figures come from ("measured", "given", ...)."""

    copy_bytes_per_s: float
    matmul_flop_per_s: float
    device_name: str
    source: str = "measured"
    matmul_dtype: str = "bf16"

    def describe(self) -> str:
        """One line: the device, the two rates and where they come from (rates below a GPU's
        also in GB/s and GFLOP/s, so that a CPU's do not read as zero or as two digits: a
        CPU's cached copy can pass 100 GB/s)."""
        copy = f"copy {self.copy_bytes_per_s / 1e12:.2f} TB/s"
        if self.copy_bytes_per_s < 1e12:
            copy += f" = {self.copy_bytes_per_s / 1e9:.1f} GB/s"
        matmul = f"{self.matmul_dtype} matmul {self.matmul_flop_per_s / 1e12:.0f} TFLOP/s"
        if self.matmul_flop_per_s < 1e13:
            matmul += f" = {self.matmul_flop_per_s / 1e9:.1f} GFLOP/s"
        return f"{self.device_name}: {copy}, {matmul} ({self.source})"

    def as_dict(self) -> dict[str, float | str]:
        return {
            "copy_bytes_per_s": self.copy_bytes_per_s,
            "matmul_flop_per_s": self.matmul_flop_per_s,
            "device_name": self.device_name,
            "source": self.source,
        }


H200_CEILINGS = Ceilings(
    H200_COPY_BYTES_PER_S, H200_MATMUL_FLOP_PER_S, "NVIDIA H200", "H200 reference (not measured)"
)


def _best_ms(fn, warmup: int, iters: int, warmup_s: float = 0.2) -> float:
    """The fastest of `iters` CUDA-event timings of `fn` (milliseconds), after at least `warmup`
    calls and `warmup_s` seconds of them (a benchmark's first call may find the GPU idling). A
    ceiling is the best the device does, and no timing of a copy far past L2 can beat the
    hardware, so the minimum is the estimate. The median of 10 timings after 3 calls, used
    before, read 4.02-4.18 TB/s in this project's H200 runs, where the vLLM peer harness read
    4.227 on the same kind of card (docs/benchmarks.md): the lower the ceiling, the more
    flattering every "% of floor"."""
    import torch

    start = time.perf_counter()
    calls = 0
    while calls < warmup or time.perf_counter() - start < warmup_s:
        fn()
        calls += 1
        if calls % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)


def _copy_bytes_per_s(device: torch.device, nbytes: int, iters: int) -> float:
    """Device-to-device copy of `nbytes` (far past L2): 2 x nbytes (read + write) per copy."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _best_ms(lambda: dst.copy_(src), warmup=3, iters=iters)
    return 2 * nbytes / (ms * 1e-3)


def _matmul_flop_per_s(device: torch.device, n: int, iters: int) -> float:
    """bf16 [n, n] @ [n, n]: 2 n^3 FLOPs per product."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    ms = _best_ms(lambda: torch.mm(a, b, out=out), warmup=3, iters=iters)
    return 2.0 * n**3 / (ms * 1e-3)


def measure_ceilings(
    device: torch.device | str,
    copy_bytes: int = 1 << 30,
    matmul_size: int = 8192,
    iters: int = 10,
) -> Ceilings:
    """Measure the copy and matmul ceilings of the CUDA `device` (a few seconds).

    Copy: `dst.copy_(src)` of a `copy_bytes` buffer, counted as 2 x copy_bytes moved (read +
    write), the way the decode floor counts bytes. Matmul: bf16 [n, n] @ [n, n] with
    n = `matmul_size`, 2 n^3 FLOPs. Each is the fastest of `iters` CUDA-event timings after a
    warm-up of at least 0.2 s (`_best_ms`). The buffers are freed and the allocator's cache
    emptied before returning, so a cache planner that runs afterwards sees all the memory."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"measure_ceilings needs a CUDA device, got {device}")
    with torch.cuda.device(device):
        copy = _copy_bytes_per_s(device, copy_bytes, iters)
        matmul = _matmul_flop_per_s(device, matmul_size, iters)
        torch.cuda.empty_cache()
        return Ceilings(copy, matmul, torch.cuda.get_device_name(device))


def _cpu_seconds(fn, warmup: int, iters: int) -> float:
    """Median wall-clock seconds of `iters` calls of `fn`, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_cpu_ceilings(
    dtype: torch.dtype | None = None,
    copy_bytes: int = 1 << 26,
    matmul_size: int = 1024,
    iters: int = 3,
) -> Ceilings:
    """Measure this host's copy and matmul rates (well under a second on 2 cores).

    Copy: `dst.copy_(src)` of a `copy_bytes` buffer (past most CPUs' last-level cache), counted
    as 2 x copy_bytes moved, as the decode floor counts bytes. Matmul: [n, n] @ [n, n] in `dtype`
    (default float32, the CPU's default model dtype), 2 n^3 FLOPs. Medians of `iters` runs."""
    import torch

    dtype = dtype or torch.float32
    src = torch.ones(copy_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy = 2 * copy_bytes / _cpu_seconds(lambda: dst.copy_(src), warmup=1, iters=iters)
    gen = torch.Generator().manual_seed(0)
    n = matmul_size
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    matmul = 2.0 * n**3 / _cpu_seconds(lambda: torch.mm(a, b, out=out), warmup=1, iters=iters)
    dtype_name = str(dtype).removeprefix("torch.")
    source = f"measured on this CPU: {copy_bytes >> 20} MiB copy, {dtype_name} {n}^3 matmul"
    return Ceilings(copy, matmul, "cpu", source, matmul_dtype=dtype_name)


def resolve_ceilings(
    cuda: bool,
    copy_bw: float | None = None,
    matmul_flops: float | None = None,
    cpu_dtype: torch.dtype | None = None,
) -> Ceilings:
    """The ceilings a bench divides by: those given (`copy_bw`, `matmul_flops`), the others
    measured on the current CUDA device when `cuda`, else measured on this CPU with a matmul in
    `cpu_dtype` when one is passed, else the H200's reference figures (tests, where a floor is
    only arithmetic)."""
    import torch

    if copy_bw is not None and matmul_flops is not None:
        name = torch.cuda.get_device_name() if cuda else "cpu"
        return Ceilings(copy_bw, matmul_flops, name, "given")
    if cuda:
        base = measure_ceilings(torch.device("cuda"))
        source = "measured"
    elif cpu_dtype is not None:
        base = measure_cpu_ceilings(cpu_dtype)
        source = base.source
    else:
        base = H200_CEILINGS
        source = "H200 reference figures, not measured: no CUDA device"
    if copy_bw is not None or matmul_flops is not None:
        source += "; partly given"
    return Ceilings(
        copy_bw if copy_bw is not None else base.copy_bytes_per_s,
        matmul_flops if matmul_flops is not None else base.matmul_flop_per_s,
        base.device_name if cuda else "cpu",
        source,
        base.matmul_dtype,
    )


@dataclass(frozen=True)
class ModelCosts:
    """What one token / one sequence costs a model in bytes and FLOPs."""

    num_params: int  # every parameter once (a tied lm_head is the embedding)
    embedding_params: int
    tied: bool
    weight_bytes: int  # every parameter, in the model dtype
    streamed_weight_bytes: int  # per decode step: all but the embedding table unless tied
    kv_bytes_per_token: int  # every "paged" spec's bytes per cached token (K + V, latents)
    ssm_state_bytes_per_seq: int  # slot tensors named "ssm_state" (in the state dtype)
    conv_state_bytes_per_seq: int  # slot tensors named "conv_state" (in the model dtype)
    attention_qd: tuple[int, ...]  # Hq x head_dim of each layer with query heads (for FLOPs)
    slot_bytes_per_seq: int  # every "slots" spec's bytes per sequence, all its tensors
    # MoE: one routed expert's bytes (w13 + w2, this rank's shard) per MoE layer, in layer
    # order; its number of experts and top-k; the parameters a token multiplies by
    expert_bytes: tuple[int, ...] = ()
    num_experts: tuple[int, ...] = ()
    top_k: tuple[int, ...] = ()
    active_params: int = 0

    @property
    def state_bytes_per_seq(self) -> int:
        """Bytes of one sequence's slot state (each decode step reads and writes them)."""
        return self.slot_bytes_per_seq

    @property
    def is_moe(self) -> bool:
        return bool(self.expert_bytes)

    @property
    def dense_streamed_weight_bytes(self) -> int:
        """Weights a decode step streams whatever the routing: all but the routed experts."""
        routed = sum(b * e for b, e in zip(self.expert_bytes, self.num_experts))
        return self.streamed_weight_bytes - routed


def model_costs(
    model: nn.Module,
    specs: list[CacheSpec],
    dtype: torch.dtype,
    state_dtype: torch.dtype,
) -> ModelCosts:
    """Costs of `model` (any device, meta included) run in `dtype` with `state_dtype` state.

    Generic over cache specs by their `pool`: a "paged" spec costs its bytes per cached token, a
    "slots" spec its bytes per sequence; a spec with `num_heads` and `head_dim` adds causal
    attention FLOPs to a prefill."""
    num_params = sum(p.numel() for p in model.parameters())  # shared tensors counted once
    embed = model.model.embed_tokens.weight.numel()
    tied = getattr(model, "lm_head", None) is None
    item = _itemsize(dtype)
    paged = slots = 0
    by_name: dict[str, int] = {}
    attention_qd = []
    for s in specs:
        if s.pool == "paged":
            # NOTE: a paged spec's tensors are linear in the block size, so one block of one
            # token holds exactly one token's bytes.
            paged += s.unit_bytes(1, dtype, state_dtype)
        elif s.pool == "slots":
            for name, (shape, dt) in s.tensors(1, 1, dtype, state_dtype).items():
                nbytes = _tensor_bytes(shape, dt)
                slots += nbytes
                by_name[name] = by_name.get(name, 0) + nbytes
        else:
            raise ValueError(f"{type(s).__name__}: unknown cache pool {s.pool!r}")
        heads, head_dim = getattr(s, "num_heads", None), getattr(s, "head_dim", None)
        if heads is not None and head_dim is not None:
            attention_qd.append(heads * head_dim)
    streamed = num_params if tied else num_params - embed
    experts = moe_blocks(model)
    expert_params = [sum(p.numel() for p in b.experts.parameters()) for b in experts]
    num_experts = tuple(b.op_spec.num_experts for b in experts)
    top_k = tuple(b.op_spec.top_k for b in experts)
    inactive = sum(n * (e - k) // e for n, e, k in zip(expert_params, num_experts, top_k))
    return ModelCosts(
        num_params=num_params,
        embedding_params=embed,
        tied=tied,
        weight_bytes=num_params * item,
        streamed_weight_bytes=streamed * item,
        kv_bytes_per_token=paged,
        ssm_state_bytes_per_seq=by_name.get("ssm_state", 0),
        conv_state_bytes_per_seq=by_name.get("conv_state", 0),
        attention_qd=tuple(attention_qd),
        slot_bytes_per_seq=slots,
        expert_bytes=tuple(n // e * item for n, e in zip(expert_params, num_experts)),
        num_experts=num_experts,
        top_k=top_k,
        active_params=num_params - inactive,
    )


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The MoE blocks of `model` in layer order: modules declaring a `MoESpec` (`op_spec`)
    with their routed experts under `experts`."""
    from deltaserve.ops.moe import MoESpec

    return [m for m in model.modules() if isinstance(getattr(m, "op_spec", None), MoESpec)]


def _itemsize(dtype: torch.dtype) -> int:
    """Bytes of one element of `dtype`."""
    from deltaserve.cache.spec import dtype_bytes

    return dtype_bytes(dtype)


def _tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * _itemsize(dtype)


def weight_bytes_streamed(
    costs: ModelCosts, distinct_experts: Sequence[float] | None = None
) -> float:
    """Weight bytes one decode step streams: every streamed weight of a dense model; for a MoE
    model the dense weights plus `distinct_experts[l]` experts of MoE layer l (the distinct
    experts the step's tokens selected there; means over steps allowed)."""
    if not costs.is_moe:
        return float(costs.streamed_weight_bytes)
    if distinct_experts is None:
        raise ValueError(
            "a MoE model's decode floor needs the distinct experts each MoE layer selected in "
            "the step (deltaserve.bench.routing records them)"
        )
    if len(distinct_experts) != len(costs.expert_bytes):
        raise ValueError(
            f"distinct experts given for {len(distinct_experts)} MoE layers, the model has "
            f"{len(costs.expert_bytes)}"
        )
    for n, e in zip(distinct_experts, costs.num_experts):
        if not 0 <= n <= e:
            raise ValueError(f"{n} distinct experts selected in a layer of {e} experts")
    routed = sum(n * b for n, b in zip(distinct_experts, costs.expert_bytes))
    return costs.dense_streamed_weight_bytes + routed


def decode_step_bytes(
    costs: ModelCosts,
    batch: int,
    context: float,
    distinct_experts: Sequence[float] | None = None,
) -> float:
    """Bytes one decode step of `batch` sequences at `context` cached tokens must move
    (`distinct_experts`: per MoE layer, required for a MoE model, see `weight_bytes_streamed`)."""
    kv = batch * context * costs.kv_bytes_per_token
    state = batch * 2 * costs.state_bytes_per_seq  # read and written
    return weight_bytes_streamed(costs, distinct_experts) + kv + state


def decode_floor_tok_s(
    costs: ModelCosts,
    batch: int,
    context: float,
    copy_bw: float = H200_COPY_BYTES_PER_S,
    distinct_experts: Sequence[float] | None = None,
) -> float:
    """Tokens per second no decode of `batch` sequences at `context` can beat, at `copy_bw`
    bytes per second (the measured copy ceiling; the H200's by default)."""
    return batch / (decode_step_bytes(costs, batch, context, distinct_experts) / copy_bw)


def prefill_flops(costs: ModelCosts, tokens: int) -> tuple[float, float]:
    """(2 x active params x tokens, causal attention FLOPs) of one prompt of `tokens` tokens
    (active params: all of a dense model's; a MoE layer's routed experts counted top-k of E)."""
    dense = 2.0 * (costs.active_params or costs.num_params) * tokens
    attention = sum(2.0 * qd * tokens * (tokens + 1) for qd in costs.attention_qd)
    return dense, attention


def prefill_floor_tok_s(
    costs: ModelCosts, tokens: int, matmul_rate: float = H200_MATMUL_FLOP_PER_S
) -> float:
    """Tokens per second no prefill of one `tokens`-token prompt can beat, at `matmul_rate`
    FLOP/s (the measured matmul ceiling; the H200's by default)."""
    return tokens / (sum(prefill_flops(costs, tokens)) / matmul_rate)
