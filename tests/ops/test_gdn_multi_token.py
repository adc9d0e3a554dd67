"""GDN decode rows of q tokens (speculative verification): the recurrent decode and the conv1d
give exactly what feeding the q tokens one at a time gives (outputs, SSM state, conv state),
for the torch reference and the Triton kernels (Triton's interpreter on CPU; `gpu` tests at
real sizes and in a CUDA graph).
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import kernel_device, requires_triton
from meta_helpers import gdn_layer, make_meta, rel_err
from test_triton_gdn import _meta_to, decode_inputs, strided, to

from deltaserve.ops.gdn import GDNKernels
from deltaserve.ops.gdn.reference import (
    TorchConv1d,
    TorchGDNDecode,
    TorchGDNPrefill,
    torch_gdn_kernels,
)

QUERY_LENS = [1, 2, 3, 5, 16]
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def decode_case(n, q, num_k_heads, ratio, dk, dv, device, act_dtype, state_dtype, seed=0):
    """Raw inputs of n decode rows of q tokens (strided, NaN in the row gaps), shuffled slots
    (the last row is padding on the null slot 0) and a random state pool."""
    num_v_heads = num_k_heads * ratio
    inputs = decode_inputs(n * q, num_k_heads, num_v_heads, dk, dv, seed)
    gen = _gen(seed + 1)
    num_slots = n + 4
    slots = (torch.randperm(num_slots - 1, generator=gen)[: n - 1] + 1).tolist() + [0]
    pool = 0.5 * torch.randn(num_slots, num_v_heads, dv, dk, generator=gen)
    tensors = to(inputs[:5], device, act_dtype) + to(inputs[5:], device)
    slots_t = torch.tensor(slots, dtype=torch.int64, device=device)
    return tensors, slots, slots_t, pool.to(device, state_dtype)


def one_token_at_a_time(backend, tensors, pool, slots_t, q):
    """Feed token t of every row (rows n * q + t) as a one-token decode, t = 0 .. q - 1."""
    qq, k, v, a, b, A_log, dt_bias = tensors
    outs = []
    for t in range(q):
        rows = slice(t, None, q)
        outs.append(
            backend.forward(
                qq[rows], k[rows], v[rows], a[rows], b[rows], A_log, dt_bias, pool, slots_t
            )  # fmt: skip
        )
    return torch.stack(outs, dim=1).flatten(0, 1)  # [N, q, HV, V] -> [N * q, HV, V]


@pytest.mark.parametrize("q", QUERY_LENS)
def test_reference_decode_q_tokens_equals_one_at_a_time(q):
    tensors, slots, slots_t, pool = decode_case(4, q, 2, 2, 16, 8, "cpu", torch.float32,
                                                torch.float32, seed=q)  # fmt: skip
    want_pool = pool.clone()
    out = TorchGDNDecode().forward(*tensors, pool, slots_t, query_len=q)
    want = one_token_at_a_time(TorchGDNDecode(), tensors, want_pool, slots_t, q)
    assert out.shape == (4 * q, 4, 8)
    assert rel_err(out, want) < 1e-6
    assert rel_err(pool, want_pool) < 1e-6


@requires_triton
@pytest.mark.parametrize("q", QUERY_LENS)
@pytest.mark.parametrize(
    "num_k_heads, ratio, dk, dv, state_dtype",
    [(2, 1, 16, 32, torch.float32), (1, 3, 32, 16, torch.float32), (2, 2, 16, 16, torch.bfloat16)],
)
def test_triton_decode_q_tokens(q, num_k_heads, ratio, dk, dv, state_dtype):
    """Triton q-token decode vs the reference fed one token at a time (float32 state: exact up
    to rounding) or vs the reference's q-token decode (bf16 state, rounded once at the end);
    slots outside the batch (and the null slot's neighbours) are untouched."""
    from deltaserve.ops.gdn.triton_decode import TritonGDNDecode

    dev = kernel_device()
    tensors, slots, slots_t, pool = decode_case(3, q, num_k_heads, ratio, dk, dv, dev,
                                                torch.float32, state_dtype, seed=q)  # fmt: skip
    original = pool.clone()
    want_pool = pool.clone()
    out = TritonGDNDecode().forward(*tensors, pool, slots_t, query_len=q)
    if state_dtype == torch.float32:
        want = one_token_at_a_time(TorchGDNDecode(), tensors, want_pool, slots_t, q)
        tol = 1e-5
    else:
        want = TorchGDNDecode().forward(*tensors, want_pool, slots_t, query_len=q)
        tol = 1e-2
    real_rows = slice(0, 2 * q)  # the last row is padding on slot 0
    assert out.shape == want.shape and torch.isfinite(out[real_rows]).all()
    assert rel_err(out[real_rows], want[real_rows]) < tol
    assert rel_err(pool[slots[:-1]], want_pool[slots[:-1]]) < tol
    untouched = [s for s in range(1, pool.shape[0]) if s not in slots]
    assert torch.equal(pool[untouched], original[untouched])


def conv_decode_case(n, q, context_lens, conv_dim, width, seed, pool_dtype=torch.float32):
    """n decode rows of q tokens (strided x plus a padding row), shuffled slots, random pool."""
    gen = _gen(seed)
    num_slots = n + 3
    slots = (torch.randperm(num_slots - 1, generator=gen)[:n] + 1).tolist()
    x = strided(n * q + 1, conv_dim, gen=gen)
    weight = torch.randn(conv_dim, width, generator=gen)
    pool = torch.randn(num_slots, conv_dim, width - 1, generator=gen).to(pool_dtype)
    meta = make_meta([q] * n, context_lens, n, state_slots=slots, decode_query_len=q)
    return x, weight, pool, meta


def conv_one_at_a_time(backend, x, weight, pool, meta, q):
    """Each decode row's tokens fed as one-token decodes, t = 0 .. q - 1."""
    n = meta.num_decodes
    outs = []
    for t in range(q):
        step = make_meta(
            [1] * n, [c + t for c in meta.context_lens_cpu], n, state_slots=meta.state_slots_cpu
        )
        outs.append(backend.forward(x[t : n * q : q], weight, pool, _meta_to(step)))
    return torch.stack(outs, dim=1).flatten(0, 1)  # [n, q, C] -> [n * q, C]


@pytest.mark.parametrize("width", [2, 4, 5])
@pytest.mark.parametrize("q", QUERY_LENS)
def test_reference_conv_q_tokens_equals_one_at_a_time(q, width):
    x, weight, pool, meta = conv_decode_case(3, q, [1, 6, 2], 24, width, seed=q + width)
    want_pool = pool.clone()
    out = TorchConv1d().forward(x, weight, pool, meta)
    want = conv_one_at_a_time(TorchConv1d(), x, weight, want_pool, meta, q)
    assert rel_err(out[: 3 * q], want) < 1e-6
    assert torch.count_nonzero(out[3 * q :]) == 0  # the padding row
    assert torch.equal(pool, want_pool)


@requires_triton
@pytest.mark.parametrize("width", [2, 4, 5])
@pytest.mark.parametrize("q", QUERY_LENS)
def test_triton_conv_q_tokens(q, width):
    """TritonConv1d on decode rows of q tokens (q < W - 1, = W - 1 and > W - 1) vs the torch
    reference fed one token at a time: outputs, the padding row zero, the rows' slots
    bit-exact in float32, other slots unchanged."""
    from deltaserve.ops.gdn.triton_conv1d import TritonConv1d

    dev = kernel_device()
    x, weight, pool, meta = conv_decode_case(3, q, [1, 6, 2], 40, width, seed=q + width)
    x, weight, pool = to([x], dev)[0], weight.to(dev), pool.to(dev)
    meta = _meta_to(meta)
    want_pool, original = pool.clone(), pool.clone()
    out = TritonConv1d().forward(x, weight, pool, meta)
    want = conv_one_at_a_time(TorchConv1d(), x, weight, want_pool, meta, q)
    assert rel_err(out[: 3 * q], want) < 1e-5
    assert torch.count_nonzero(out[3 * q :]) == 0
    slots = meta.state_slots_cpu
    assert torch.equal(pool[slots], want_pool[slots])
    untouched = [s for s in range(pool.shape[0]) if s not in slots]
    assert torch.equal(pool[untouched], original[untouched])


@requires_triton
def test_triton_conv_decode_poisoned_out():
    """conv1d_decode with q = 3 writes every row of a NaN-poisoned `out`; bf16 pool."""
    from deltaserve.ops.gdn.triton_conv1d import conv1d_decode

    dev = kernel_device()
    x, weight, pool, meta = conv_decode_case(2, 3, [4, 1], 72, 4, 7, pool_dtype=torch.bfloat16)
    x = to([x[:-1].to(torch.bfloat16)], dev)[0]
    weight, pool = weight.to(dev), pool.to(dev)
    want_pool = pool.clone()
    want = TorchConv1d().forward(x, weight, want_pool, meta)
    out = torch.full_like(x, float("nan"))
    conv1d_decode(x, weight, pool, meta.state_slots.to(dev), out=out, block_c=32, query_len=3)
    assert rel_err(out, want) < 1e-2
    assert torch.equal(pool[meta.state_slots_cpu], want_pool[meta.state_slots_cpu])


def gdn_layer_case(q_lens, context_lens, num_decodes, q, num_k_heads, ratio, dk, dv, width,
                   device, act_dtype, seed=0):  # fmt: skip
    """Inputs of one GDN layer over a batch of `num_decodes` decode rows of q tokens followed
    by prefill rows; fresh sequences' slots hold NaN. Returns (run, meta, pools) where
    `run(kernels, meta, conv_pool, ssm_pool)` runs conv + delta rule."""
    num_v_heads = num_k_heads * ratio
    key_dim, value_dim = num_k_heads * dk, num_v_heads * dv
    conv_dim = 2 * key_dim + value_dim
    gen = _gen(seed)
    T = sum(q_lens)
    num_slots = len(q_lens) + 3
    slots = (torch.randperm(num_slots - 1, generator=gen)[: len(q_lens)] + 1).tolist()
    x = strided(T, conv_dim, gen=gen)
    a = strided(T, num_v_heads, gen=gen)
    b = strided(T, num_v_heads, gen=gen)
    weight = torch.randn(conv_dim, width, generator=gen)
    A_log = torch.empty(num_v_heads).uniform_(0.01, 16, generator=gen).log()
    dt_bias = torch.randn(num_v_heads, generator=gen)
    conv_pool = torch.randn(num_slots, conv_dim, width - 1, generator=gen)
    ssm_pool = 0.5 * torch.randn(num_slots, num_v_heads, dv, dk, generator=gen)
    for slot, c in zip(slots, context_lens, strict=True):
        if c == 0:
            conv_pool[slot] = float("nan")
            ssm_pool[slot] = float("nan")
    x, a, b = to((x, a, b), device, act_dtype)
    weight, A_log, dt_bias = (t.to(device) for t in (weight, A_log, dt_bias))
    meta = _meta_to(make_meta(q_lens, context_lens, num_decodes, state_slots=slots,
                              decode_query_len=q))  # fmt: skip

    def run(kernels, meta, conv_pool, ssm_pool):
        heads = (num_k_heads, num_v_heads, dk, dv)
        return gdn_layer(kernels, x, a, b, weight, A_log, dt_bias, conv_pool, ssm_pool, meta, heads)

    return run, meta, (conv_pool.to(device), ssm_pool.to(device))


def check_layer_decode_as_prefill(kernels, q, num_decodes, prefills, device, act_dtype, tol,
                                  dims=(2, 2, 16, 32, 4)):  # fmt: skip
    """A mixed batch (decode rows of q tokens, then prefills) through `kernels` equals the torch
    reference that takes the same decode tokens as prefill chunks on the same contexts
    (chunked delta rule, conv from the state): outputs and both pools."""
    q_lens = [q] * num_decodes + [n for n, _ in prefills]
    context_lens = [3 + 2 * i for i in range(num_decodes)] + [c for _, c in prefills]
    run, meta, pools = gdn_layer_case(q_lens, context_lens, num_decodes, q, *dims, device,
                                      act_dtype, seed=q)  # fmt: skip
    as_prefill = make_meta(q_lens, context_lens, 0, state_slots=meta.state_slots_cpu)
    want_pools = tuple(p.clone() for p in pools)
    want = run(torch_gdn_kernels(chunk_size=16), _meta_to(as_prefill), *want_pools)
    out = run(kernels, meta, *pools)
    assert torch.isfinite(out).all()
    assert rel_err(out, want) < tol
    slots = meta.state_slots_cpu
    assert rel_err(pools[0][slots], want_pools[0][slots]) < tol
    assert rel_err(pools[1][slots], want_pools[1][slots]) < tol


@pytest.mark.parametrize("q", QUERY_LENS)
@pytest.mark.parametrize("prefills", [[], [(7, 0), (1, 4), (20, 9)]], ids=["decodes", "mixed"])
def test_reference_layer_decode_rows_equal_prefill(q, prefills):
    check_layer_decode_as_prefill(torch_gdn_kernels(chunk_size=16), q, 3, prefills, "cpu",
                                  torch.float32, 1e-5)  # fmt: skip


@requires_triton
@pytest.mark.parametrize("q", [1, 2, 5, 16])
@pytest.mark.parametrize("prefills", [[], [(7, 0), (1, 4), (20, 9)]], ids=["decodes", "mixed"])
def test_triton_layer_decode_rows_equal_prefill(q, prefills):
    from deltaserve.ops.gdn.triton_conv1d import TritonConv1d
    from deltaserve.ops.gdn.triton_decode import TritonGDNDecode

    fast = GDNKernels(TritonConv1d(), TorchGDNPrefill(chunk_size=16), TritonGDNDecode())
    check_layer_decode_as_prefill(fast, q, 3, prefills, kernel_device(), torch.float32, 1e-5)


# --- GPU: real sizes (HV=32, HK=16, K=V=128, conv_dim=8192), bf16, CUDA graphs --------------


@gpu
@needs_cuda
@pytest.mark.parametrize("q", [2, 4, 8, 16])
@pytest.mark.parametrize("batch", [1, 33, 128])
def test_gpu_decode_q_tokens_real_sizes(batch, q):
    from deltaserve.ops.gdn.triton_decode import TritonGDNDecode

    dev = torch.device("cuda")
    tensors, slots, slots_t, pool = decode_case(batch + 1, q, 16, 2, 128, 128, dev,
                                                torch.bfloat16, torch.float32, seed=q)  # fmt: skip
    want_pool = pool.clone()
    out = TritonGDNDecode().forward(*tensors, pool, slots_t, query_len=q)
    want = one_token_at_a_time(TorchGDNDecode(), tensors, want_pool, slots_t, q)
    real = slice(0, batch * q)
    assert rel_err(out[real], want[real]) < 4e-3  # bf16 output rounding
    assert rel_err(pool[slots[:-1]], want_pool[slots[:-1]]) < 1e-4


@gpu
@needs_cuda
@pytest.mark.parametrize("q", [1, 3, 16])
def test_gpu_layer_mixed_q_rows(q):
    from deltaserve.ops.gdn.triton_conv1d import TritonConv1d
    from deltaserve.ops.gdn.triton_decode import TritonGDNDecode

    fast = GDNKernels(TritonConv1d(), TorchGDNPrefill(), TritonGDNDecode())
    prefills = [(70, 0), (1, 9), (300, 3)]
    check_layer_decode_as_prefill(fast, q, 37, prefills, torch.device("cuda"), torch.bfloat16,
                                  2e-2, dims=(16, 2, 128, 128, 4))  # fmt: skip


@gpu
@needs_cuda
@pytest.mark.parametrize("q", [2, 4])
def test_gpu_cuda_graph_q_tokens(q):
    """Capture conv + delta-rule decode of 16 rows of q tokens; new inputs, slots and pools in
    place; replay equals the same calls run eagerly."""
    from deltaserve.ops.gdn.triton_conv1d import TritonConv1d
    from deltaserve.ops.gdn.triton_decode import TritonGDNDecode

    dev = torch.device("cuda")
    batch = 16
    run, meta, pools = gdn_layer_case([q] * batch, [5] * batch, batch, q, 16, 2, 128, 128, 4,
                                      dev, torch.bfloat16)  # fmt: skip
    conv_pool, ssm_pool = (p.nan_to_num(0.0) for p in pools)
    kernels = GDNKernels(TritonConv1d(), TorchGDNPrefill(), TritonGDNDecode())

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(kernels, meta, conv_pool, ssm_pool)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = run(kernels, meta, conv_pool, ssm_pool)
    for seed in range(2):
        gen = torch.Generator(device=dev).manual_seed(seed)
        perm = torch.randperm(conv_pool.shape[0] - 1, generator=gen, device=dev)[:batch] + 1
        meta.state_slots.copy_(perm)
        conv_pool.copy_(torch.randn(conv_pool.shape, generator=gen, device=dev))
        ssm_pool.copy_(torch.randn(ssm_pool.shape, generator=gen, device=dev))
        saved = conv_pool.clone(), ssm_pool.clone()
        graph.replay()
        got = graph_out.clone(), conv_pool.clone(), ssm_pool.clone()
        conv_pool.copy_(saved[0])
        ssm_pool.copy_(saved[1])
        want = run(kernels, meta, conv_pool, ssm_pool)
        torch.cuda.synchronize()
        assert rel_err(got[0], want) < 1e-3
        assert torch.equal(got[1], conv_pool)
        assert rel_err(got[2], ssm_pool) < 1e-6


@gpu
@needs_cuda
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_gpu_bench_q_tokens_runs(impl):
    from deltaserve.ops.gdn.triton_bench import bench_gdn_decode

    result = bench_gdn_decode(4, impl=impl, iters=5, query_len=4)
    assert result["us"] > 0 and result["tb_s"] > 0
