"""Triton GDN decode and causal conv1d kernels against the torch references.

`requires_triton` tests run anywhere: on CPU they use Triton's interpreter (conftest sets
TRITON_INTERPRET=1), so their sizes are small. `gpu` tests use the real Qwen3.5 shapes and a
CUDA graph (run on the GPU machine with `pytest -m gpu`).
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import kernel_device, requires_triton
from meta_helpers import gdn_layer, make_meta, rel_err

from deltaserve.ops.gdn import GDNKernels
from deltaserve.ops.gdn.reference import (
    TorchConv1d,
    TorchGDNDecode,
    TorchGDNPrefill,
    torch_gdn_kernels,
)

pytestmark = requires_triton


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def strided(rows: int, *shape: int, gen: torch.Generator, pad: int = 3) -> torch.Tensor:
    """A random [rows, *shape] float32 view whose rows sit inside wider rows (as in a split
    projection output): non-contiguous, last dim unit stride."""
    width = 1
    for s in shape:
        width *= s
    base = torch.randn(rows, width + 2 * pad, generator=gen)
    return base[:, pad : pad + width].unflatten(1, shape)


def decode_inputs(n, num_k_heads, num_v_heads, dk, dv, seed=0):
    """Raw decode inputs as strided views, on CPU in float32 (callers move / cast)."""
    gen = _gen(seed)
    q = strided(n, num_k_heads, dk, gen=gen)
    k = strided(n, num_k_heads, dk, gen=gen)
    v = strided(n, num_v_heads, dv, gen=gen)
    a = strided(n, num_v_heads, gen=gen)
    b = strided(n, num_v_heads, gen=gen)
    A_log = torch.empty(num_v_heads).uniform_(0.01, 16, generator=gen).log()
    dt_bias = torch.randn(num_v_heads, generator=gen)
    return q, k, v, a, b, A_log, dt_bias


def to(tensors, device, dtype=None):
    """Each tensor on `device` (in `dtype`); a [rows, ...] one keeps a padded row stride, with
    NaN in the gaps, so a kernel that ignores strides reads NaN."""
    moved = []
    for t in tensors:
        dtype_t = dtype or t.dtype
        if t.dim() < 2:
            moved.append(t.to(device, dtype_t))
            continue
        base = torch.full(
            (t.shape[0], t[0].numel() + 5), float("nan"), device=device, dtype=dtype_t
        )
        view = base[:, 2 : 2 + t[0].numel()].unflatten(1, t.shape[1:])
        view.copy_(t)
        moved.append(view)
    return moved


def check_decode(n, num_k_heads, ratio, dk, dv, state_dtype, act_dtype, device, tol, seed=0):
    """Triton decode vs TorchGDNDecode on shuffled slots with two padding rows on slot 0: the
    real rows' outputs and slots match; every slot but theirs (and the null slot) is unchanged."""
    num_v_heads = num_k_heads * ratio
    num_slots = 2 * n + 3
    inputs = decode_inputs(n, num_k_heads, num_v_heads, dk, dv, seed)
    q, k, v, a, b = to(inputs[:5], device, act_dtype)
    A_log, dt_bias = to(inputs[5:], device)
    gen = _gen(seed + 1)
    slots = (torch.randperm(num_slots - 1, generator=gen)[: n - 2] + 1).tolist() + [0, 0]
    state_slots = torch.tensor(slots, dtype=torch.int64, device=device)
    pool = (0.5 * torch.randn(num_slots, num_v_heads, dv, dk, generator=gen)).to(
        device, state_dtype
    )
    want_pool = pool.clone()
    original = pool.clone()

    from deltaserve.ops.gdn.triton_decode import TritonGDNDecode

    out = TritonGDNDecode().forward(q, k, v, a, b, A_log, dt_bias, pool, state_slots)
    want = TorchGDNDecode().forward(q, k, v, a, b, A_log, dt_bias, want_pool, state_slots)
    assert out.shape == (n, num_v_heads, dv) and out.dtype == v.dtype
    real = slice(0, n - 2)
    out_tol = tol if act_dtype == torch.float32 else max(tol, 4e-3)  # bf16 output rounding
    assert rel_err(out[real], want[real]) < out_tol
    assert rel_err(pool[slots[:-2]], want_pool[slots[:-2]]) < tol
    untouched = [s for s in range(1, num_slots) if s not in slots]
    assert torch.equal(pool[untouched], original[untouched])


@pytest.mark.parametrize(
    "num_k_heads, ratio, dk, dv, state_dtype",
    [
        (2, 1, 16, 32, torch.float32),
        (1, 2, 32, 16, torch.bfloat16),
        (2, 3, 16, 16, torch.float32),
    ],
)
def test_decode_matches_reference(num_k_heads, ratio, dk, dv, state_dtype):
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    check_decode(7, num_k_heads, ratio, dk, dv, state_dtype, torch.float32, kernel_device(), tol)


def conv_case(q_lens, context_lens, conv_dim, width, seed, pool_dtype=torch.float32):
    """Strided x over the batch plus a trailing padding row, a conv pool with NaN in the fresh
    sequences' slots, shuffled slots. Returns (x, weight, pool, meta) on CPU."""
    gen = _gen(seed)
    num_slots = len(q_lens) + 4
    slots = (torch.randperm(num_slots - 1, generator=gen)[: len(q_lens)] + 1).tolist()
    x = strided(sum(q_lens) + 1, conv_dim, gen=gen)
    weight = torch.randn(conv_dim, width, generator=gen)
    pool = torch.randn(num_slots, conv_dim, width - 1, generator=gen).to(pool_dtype)
    for slot, c in zip(slots, context_lens, strict=True):
        if c == 0:
            pool[slot] = float("nan")
    num_decodes = sum(1 for q, c in zip(q_lens, context_lens) if q == 1 and c > 0)
    meta = make_meta(q_lens, context_lens, num_decodes, state_slots=slots)
    return x, weight, pool, meta


def check_conv(x, weight, pool, meta, tol):
    """TritonConv1d vs TorchConv1d: outputs (padding rows zero), written slots bit-exact in
    float32, all other slots unchanged."""
    from deltaserve.ops.gdn.triton_conv1d import TritonConv1d

    want_pool = pool.clone()
    original = pool.clone()
    out = TritonConv1d().forward(x, weight, pool, meta)
    want = TorchConv1d().forward(x, weight, want_pool, meta)
    assert out.shape == x.shape and out.dtype == x.dtype and torch.isfinite(out).all()
    assert rel_err(out, want) < tol
    slots = meta.state_slots_cpu
    assert torch.equal(pool[slots], want_pool[slots])
    untouched = [s for s in range(pool.shape[0]) if s not in slots]
    assert torch.equal(pool[untouched].nan_to_num(7.0), original[untouched].nan_to_num(7.0))


@pytest.mark.parametrize("width", [2, 4, 5])
def test_conv_mixed_batch(width):
    """3 decodes (one on a context shorter than the window) and varlen prefills of 1, 3, 17 and
    70 tokens, fresh (NaN slots) and continued, through decode + prefill kernels at once."""
    q_lens, context_lens = [1, 1, 1, 1, 3, 17, 70], [4, 1, 9, 0, 2, 0, 5]
    x, weight, pool, meta = conv_case(q_lens, context_lens, 200, width, seed=width)
    assert meta.num_decodes == 3
    dev = kernel_device()
    check_conv(to([x], dev)[0], weight.to(dev), pool.to(dev), _meta_to(meta), 1e-5)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_conv_all_decodes(pool_dtype):
    """The CUDA-graph path: all decodes, a padding row past the batch; x in the pool's dtype
    (the interpreter rounds float32 -> bfloat16 differently from torch)."""
    x, weight, pool, meta = conv_case(
        [1] * 5, [3, 1, 8, 2, 6], 96, 4, seed=3, pool_dtype=pool_dtype
    )
    x = x.to(pool_dtype)
    tol = 1e-5 if pool_dtype == torch.float32 else 1e-2
    dev = kernel_device()
    check_conv(to([x], dev)[0], weight.to(dev), pool.to(dev), _meta_to(meta), tol)


def test_conv_prefill_tiles_and_poisoned_out():
    """Width 8; several token and channel blocks per sequence; every row of a NaN-poisoned out
    is written; a sequence shorter than the window keeps part of its old window."""
    from deltaserve.ops.gdn.triton_conv1d import conv1d_prefill

    dev = kernel_device()
    q_lens, context_lens = [2, 17, 40], [3, 0, 1]
    x, weight, pool, meta = conv_case(q_lens, context_lens, 72, 8, seed=11)
    x, weight, pool = to([x[:-1]], dev)[0], weight.to(dev), pool.to(dev)  # no padding row
    want_pool = pool.clone()
    want = TorchConv1d().forward(x, weight, want_pool, meta)
    out = torch.full_like(x, float("nan"))
    m = _meta_to(meta)
    conv1d_prefill(
        x, weight, pool, m.query_start_loc, m.state_slots, m.has_initial_state, 40, out, 8, 32
    )
    assert rel_err(out, want) < 1e-5
    assert torch.equal(pool[meta.state_slots_cpu], want_pool[meta.state_slots_cpu])


def _meta_to(meta):
    """The metadata's device tensors on the kernel device."""
    dev = kernel_device()
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "context_lens", "block_tables"):
        setattr(meta, name, getattr(meta, name).to(dev))
    meta.state_slots = meta.state_slots.to(dev)
    meta.has_initial_state = meta.has_initial_state.to(dev)
    return meta


def check_gdn_layer(q_lens, context_lens, num_k_heads, ratio, dk, dv, width, device, act_dtype):
    """Conv + delta rule through GDNKernels(TritonConv1d, TorchGDNPrefill, TritonGDNDecode) vs
    torch_gdn_kernels() on a mixed batch: outputs and both pools."""
    from deltaserve.ops.gdn.triton_conv1d import TritonConv1d
    from deltaserve.ops.gdn.triton_decode import TritonGDNDecode

    num_v_heads = num_k_heads * ratio
    key_dim, value_dim = num_k_heads * dk, num_v_heads * dv
    conv_dim = 2 * key_dim + value_dim
    x, weight, conv_pool, meta = conv_case(q_lens, context_lens, conv_dim, width, seed=ratio)
    gen = _gen(ratio + 10)
    T = x.shape[0] - 1
    x = x[:T]
    a = strided(T, num_v_heads, gen=gen)
    b = strided(T, num_v_heads, gen=gen)
    A_log = torch.empty(num_v_heads).uniform_(0.01, 16, generator=gen).log()
    dt_bias = torch.randn(num_v_heads, generator=gen)
    ssm_pool = 0.5 * torch.randn(conv_pool.shape[0], num_v_heads, dv, dk, generator=gen)
    for slot, c in zip(meta.state_slots_cpu, context_lens, strict=True):
        if c == 0:
            ssm_pool[slot] = float("nan")
    x, a, b = to((x, a, b), device, act_dtype)
    weight, A_log, dt_bias, conv_pool, ssm_pool = (
        t.to(device) for t in (weight, A_log, dt_bias, conv_pool, ssm_pool)
    )
    meta = _meta_to(meta)

    def layer(kernels, conv_pool, ssm_pool):
        heads = (num_k_heads, num_v_heads, dk, dv)
        return gdn_layer(kernels, x, a, b, weight, A_log, dt_bias, conv_pool, ssm_pool, meta, heads)

    pools = (conv_pool.clone(), ssm_pool.clone())
    want = layer(torch_gdn_kernels(chunk_size=16), conv_pool, ssm_pool)
    fast = GDNKernels(TritonConv1d(), TorchGDNPrefill(chunk_size=16), TritonGDNDecode())
    out = layer(fast, *pools)
    tol = 1e-5 if act_dtype == torch.float32 else 2e-2
    assert torch.isfinite(out).all()
    assert rel_err(out, want) < tol
    slots = meta.state_slots_cpu
    assert rel_err(pools[0][slots], conv_pool[slots]) < tol
    assert rel_err(pools[1][slots], ssm_pool[slots]) < tol


@pytest.mark.parametrize("ratio", [1, 3])
def test_gdn_layer_mixed_batch(ratio):
    check_gdn_layer(
        [1, 1, 3, 17], [5, 2, 0, 4], 2, ratio, 16, 32, 4, kernel_device(), torch.float32
    )


# --- GPU: real sizes (HV=32, HK=16, K=V=128, conv_dim=8192), bf16 activations, CUDA graphs ---

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@gpu
@needs_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [3, 33, 128, 512])
def test_gpu_decode_real_sizes(batch, state_dtype):
    tol = 1e-4 if state_dtype == torch.float32 else 1e-2
    check_decode(batch, 16, 2, 128, 128, state_dtype, torch.bfloat16, torch.device("cuda"), tol)


@gpu
@needs_cuda
def test_gpu_decode_large_pool_int64_offsets():
    """Slot * slot-stride past 2**31 elements: pool offsets must be computed in int64."""
    from deltaserve.ops.gdn.triton_decode import TritonGDNDecode

    dev = torch.device("cuda")
    num_v_heads, dk, dv = 32, 128, 128
    num_slots = 2**31 // (num_v_heads * dv * dk) + 8  # 4104 slots, 8.6 GB
    pool = torch.zeros(num_slots, num_v_heads, dv, dk, device=dev)
    slots = torch.tensor([num_slots - 1, 5, num_slots - 3], device=dev)
    pool[slots] = torch.randn(3, num_v_heads, dv, dk, device=dev)
    q, k, v, a, b, A_log, dt_bias = to(decode_inputs(3, 16, num_v_heads, dk, dv), dev)
    want_states = pool[slots].clone()
    out = TritonGDNDecode().forward(q, k, v, a, b, A_log, dt_bias, pool, slots)
    small = want_states.clone()
    want = TorchGDNDecode().forward(
        q, k, v, a, b, A_log, dt_bias, small, torch.arange(3, device=dev)
    )
    assert rel_err(out, want) < 1e-5
    assert rel_err(pool[slots], small) < 1e-5
    del pool
    torch.cuda.empty_cache()


@gpu
@needs_cuda
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_gpu_conv_real_sizes(pool_dtype):
    q_lens = [1] * 300 + [1, 3, 17, 70, 1000, 4099]
    context_lens = [7] * 300 + [0, 2, 0, 9, 3, 0]
    x, weight, pool, meta = conv_case(q_lens, context_lens, 8192, 4, 5, pool_dtype)
    dev = torch.device("cuda")
    x = to([x], dev, torch.bfloat16)[0]
    check_conv(x, weight.to(dev, torch.bfloat16), pool.to(dev), _meta_to(meta), 1e-2)


@gpu
@needs_cuda
def test_gpu_gdn_layer_mixed_batch():
    q_lens = [1] * 37 + [1, 3, 17, 70, 300]
    context_lens = [11] * 37 + [0, 2, 0, 9, 3]
    check_gdn_layer(q_lens, context_lens, 16, 2, 128, 128, 4, torch.device("cuda"), torch.bfloat16)


@gpu
@needs_cuda
def test_gpu_cuda_graph_decode():
    """Capture conv decode + delta-rule decode (all decodes); rewrite inputs, slots and pool
    contents in place; replay; compare to the same calls run eagerly on copies."""
    from deltaserve.ops.gdn.triton_conv1d import TritonConv1d
    from deltaserve.ops.gdn.triton_decode import TritonGDNDecode

    dev = torch.device("cuda")
    batch, num_k_heads, num_v_heads, dk, dv, width = 64, 16, 32, 128, 128, 4
    key_dim, value_dim = num_k_heads * dk, num_v_heads * dv
    conv_dim = 2 * key_dim + value_dim
    num_slots = 2 * batch + 1
    kernels = GDNKernels(TritonConv1d(), TorchGDNPrefill(), TritonGDNDecode())
    assert kernels.supports_cuda_graph
    meta = _meta_to(make_meta([1] * batch, [5] * batch, batch))
    meta.state_slots = meta.state_slots.to(dev)
    proj = torch.randn(batch, conv_dim + 2 * num_v_heads + 16, device=dev, dtype=torch.bfloat16)
    weight = torch.randn(conv_dim, width, device=dev, dtype=torch.bfloat16)
    A_log = torch.rand(num_v_heads, device=dev).add(0.01).log()
    dt_bias = torch.randn(num_v_heads, device=dev)
    conv_pool = torch.randn(num_slots, conv_dim, width - 1, device=dev, dtype=torch.bfloat16)
    ssm_pool = torch.randn(num_slots, num_v_heads, dv, dk, device=dev)

    def step():
        x = proj[:, :conv_dim]
        a = proj[:, conv_dim : conv_dim + num_v_heads]
        b = proj[:, conv_dim + num_v_heads : conv_dim + 2 * num_v_heads]
        heads = (num_k_heads, num_v_heads, dk, dv)
        return gdn_layer(kernels, x, a, b, weight, A_log, dt_bias, conv_pool, ssm_pool, meta, heads)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up (compiles the kernels) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()

    for seed in range(2):
        gen = torch.Generator(device=dev).manual_seed(seed)
        proj.copy_(torch.randn(proj.shape, generator=gen, device=dev))
        perm = torch.randperm(num_slots - 1, generator=gen, device=dev)[:batch] + 1
        meta.state_slots.copy_(perm)
        conv_pool.copy_(torch.randn(conv_pool.shape, generator=gen, device=dev))
        ssm_pool.copy_(torch.randn(ssm_pool.shape, generator=gen, device=dev))
        saved = conv_pool.clone(), ssm_pool.clone()
        graph.replay()
        got = graph_out.clone(), conv_pool.clone(), ssm_pool.clone()
        conv_pool.copy_(saved[0])
        ssm_pool.copy_(saved[1])
        want = step()
        torch.cuda.synchronize()
        assert rel_err(got[0], want) < 1e-3
        assert torch.equal(got[1], conv_pool)
        assert rel_err(got[2], ssm_pool) < 1e-6


@gpu
@needs_cuda
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_gpu_bench_runs(impl):
    from deltaserve.ops.gdn.triton_bench import bench_gdn_decode

    result = bench_gdn_decode(4, impl=impl, iters=5)
    assert result["us"] > 0 and result["tb_s"] > 0
