"""Fused elementwise ops: the torch references against the plain formulas written in the tests
(tests/ops/plain_math.py, bit-equal), and the
Triton kernels against the references (relative error) on strided views and odd sizes.

`requires_triton` tests run anywhere: on CPU in Triton's interpreter (small sizes). Its float32
-> bfloat16 casts truncate instead of rounding to nearest even, so bf16 tolerances are looser
there than on the GPU. `gpu` tests use real model sizes and a CUDA graph (`pytest -m gpu`).
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import kernel_device, requires_triton
from meta_helpers import rel_err
from plain_math import gated_rms_norm as plain_gated_rms_norm
from plain_math import rms_norm as plain_rms_norm
from plain_math import rope as plain_rope
from plain_math import silu_and_mul as layer_silu_and_mul

from deltaserve.layers.rotary import RotaryEmbedding
from deltaserve.ops.fused import (
    FusedOps,
    TorchFusedOps,
    load_fused_ops,
    reference,
    triton_unavailable_reason,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-6
ON_GPU = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


def tol(dtype: torch.dtype) -> float:
    if dtype == torch.float32:
        return 1e-5
    if dtype == torch.float16:
        return 2e-3
    return 5e-3 if ON_GPU else 2.5e-2  # the interpreter truncates float32 -> bf16


def exact(dtype: torch.dtype) -> bool:
    """Whether a single rounded add is bit-exact here (not for bf16 in the interpreter)."""
    return ON_GPU or dtype != torch.bfloat16


def rand(*shape: int, gen: torch.Generator, dtype: torch.dtype, scale: float = 1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(kernel_device())


def view_in(base: torch.Tensor, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """A [T, ..., N] view of the last `prod(shape[1:])` columns of base [T, W] from `offset`."""
    width = 1
    for s in shape[1:]:
        width *= s
    return base[:, offset : offset + width].unflatten(1, shape[1:])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def triton_ops() -> FusedOps:
    pytest.importorskip("triton")
    return load_fused_ops("triton")


# ---------------------------------------------------------------- references == plain formulas


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_reference_rms_norm_equals_layer(dtype, zero_centered):
    g = gen(0)
    w = torch.randn(200, generator=g).to(dtype)
    norm = lambda t: plain_rms_norm(t, w, EPS, zero_centered)  # noqa: E731
    x, h = torch.randn(2, 5, 200, generator=g).to(dtype)
    with torch.no_grad():
        assert torch.equal(reference.rms_norm(x, w, EPS, zero_centered), norm(x))
        # the decoder layer's `x = x + mixer(...)` then the next norm, fused
        residual = x.clone()
        out, res = reference.rms_norm(h, w, EPS, zero_centered, residual=residual)
        assert res is residual and torch.equal(res, x + h)
        assert torch.equal(out, norm(x + h))
        heads = torch.randn(3, 4, 200, generator=g).to(dtype)[:, 1:3]  # strided [T, H, D]
        assert torch.equal(reference.rms_norm(heads, w, EPS, zero_centered), norm(heads))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_gated_norm_and_activations_equal_layers(dtype):
    g = gen(1)
    w = torch.randn(48, generator=g).to(dtype)
    norm = lambda a, b: plain_gated_rms_norm(a, b, w, EPS)  # noqa: E731
    x = torch.randn(5, 3, 48, generator=g).to(dtype)
    z = torch.randn(5, 3 * 48 + 7, generator=g).to(dtype)[:, 7:].unflatten(1, (3, 48))
    with torch.no_grad():
        assert torch.equal(reference.gated_rms_norm(x, z, w, EPS), norm(x, z))
    y = torch.randn(5, 2 * 300, generator=g).to(dtype) * 4
    assert torch.equal(reference.silu_and_mul(y), layer_silu_and_mul(y))
    o, gate = torch.randn(2, 5, 3, 48, generator=g).to(dtype)
    # the model: o.reshape(T, q_size) * torch.sigmoid(gate.reshape(T, q_size))
    want = o.reshape(5, -1) * torch.sigmoid(gate.reshape(5, -1))
    assert torch.equal(reference.sigmoid_gate_mul(o, gate).reshape(5, -1), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered,rotary_dim", [(True, 16), (False, 64), (True, 32)])
def test_reference_qk_norm_rope_equals_layers(dtype, zero_centered, rotary_dim):
    g = gen(2)
    D, Hq, Hk, T = 64, 5, 2, 6
    rope = RotaryEmbedding(D, rotary_dim, 10000.0)
    qw, kw = torch.randn(2, D, generator=g).to(dtype)
    q_norm = lambda t: plain_rms_norm(t, qw, EPS, zero_centered)  # noqa: E731
    k_norm = lambda t: plain_rms_norm(t, kw, EPS, zero_centered)  # noqa: E731
    q_gate = torch.randn(T, Hq, 2 * D, generator=g).to(dtype)
    q, k = q_gate[..., :D], torch.randn(T, Hk, D, generator=g).to(dtype)
    cos, sin = rope.cos_sin(torch.tensor([0, 1, 2, 17, 300, 4097]))
    with torch.no_grad():
        want_q = plain_rope(q_norm(q), cos, sin, rotary_dim)
        want_k = plain_rope(k_norm(k), cos, sin, rotary_dim)
    got_q, got_k = reference.qk_norm_rope(q, k, qw, kw, cos, sin, EPS, zero_centered)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_registry():
    assert isinstance(load_fused_ops("torch"), TorchFusedOps)
    assert load_fused_ops("torch").name == "torch"
    with pytest.raises(ValueError, match="unknown fused ops"):
        load_fused_ops("cuda")
    assert triton_unavailable_reason("meta") is not None


# ---------------------------------------------------------------- Triton vs reference (any)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,hidden", [(1, 96), (3, 200), (17, 96), (2, 4096)])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(triton_ops, dtype, T, hidden, zero_centered, with_residual):
    g = gen(hidden + T)
    base = rand(T, hidden + 9, gen=g, dtype=dtype, scale=3.0)
    x = base[:, 5 : 5 + hidden]  # a column slice: row stride hidden + 9
    w = rand(hidden, gen=g, dtype=dtype)
    residual = rand(T, hidden, gen=g, dtype=dtype) if with_residual else None
    want = reference.rms_norm(
        x, w, EPS, zero_centered, None if residual is None else residual.clone()
    )
    out_base = torch.full((T, hidden + 4), 7.0, dtype=dtype, device=x.device)
    out = out_base[:, 2 : 2 + hidden]
    out[:] = float("nan")  # poison
    got = triton_ops.rms_norm(x, w, EPS, zero_centered, residual=residual, out=out)
    if residual is None:
        assert got is out
        assert rel_err(got, want) < tol(dtype)
    else:
        (got_out, got_res), (want_out, want_res) = got, want
        assert got_out is out and got_res is residual  # updated in place
        if exact(dtype):
            assert torch.equal(got_res, want_res)
        assert rel_err(got_res, want_res) < tol(dtype)
        assert rel_err(got_out, want_out) < tol(dtype)
    assert (out_base[:, :2] == 7).all() and (out_base[:, 2 + hidden :] == 7).all()
    # default output: a new contiguous tensor
    plain = triton_ops.rms_norm(x, w, EPS, zero_centered)
    assert plain.is_contiguous() and plain.shape == x.shape
    assert rel_err(plain, reference.rms_norm(x, w, EPS, zero_centered)) < tol(dtype)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,D", [(1, 3, 64), (5, 4, 80), (3, 16, 32)])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_per_head_strided(triton_ops, dtype, T, H, D, zero_centered):
    g = gen(T * H + D)
    q_gate = rand(T, H, 2 * D, gen=g, dtype=dtype, scale=2.0)
    q = q_gate[..., :D]  # Qwen3.5's per-head [query | gate]: head stride 2 * D
    w = rand(D, gen=g, dtype=dtype)
    want = reference.rms_norm(q, w, EPS, zero_centered)
    got = triton_ops.rms_norm(q, w, EPS, zero_centered)
    assert got.shape == (T, H, D) and rel_err(got, want) < tol(dtype)
    gate = q_gate[..., D:].clone()
    assert triton_ops.rms_norm(q, w, EPS, zero_centered, out=q) is q  # in place
    assert rel_err(q, want) < tol(dtype)
    assert torch.equal(q_gate[..., D:], gate)  # the gate half is untouched


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,HV,V", [(1, 3, 32), (3, 2, 48), (17, 4, 128)])
def test_gated_rms_norm(triton_ops, dtype, T, HV, V):
    g = gen(T + HV + V)
    x = rand(T, HV, V, gen=g, dtype=dtype, scale=2.0)
    # z: columns of a wider projection output ([qkv | z | b | a]), reshaped per head
    z = view_in(rand(T, HV * V + 11, gen=g, dtype=dtype, scale=3.0), (T, HV, V), 6)
    w = rand(V, gen=g, dtype=dtype)
    want = reference.gated_rms_norm(x, z, w, EPS)
    out = torch.full_like(x, float("nan"))
    assert triton_ops.gated_rms_norm(x, z, w, EPS, out=out) is out
    assert rel_err(out, want) < tol(dtype)
    strided = triton_ops.gated_rms_norm(x[:, 1:], z[:, 1:], w, EPS)  # strided x too
    assert rel_err(strided, want[:, 1:]) < tol(dtype)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,d", [(1, 96), (3, 200), (17, 40), (2, 1500)])
def test_silu_and_mul(triton_ops, dtype, T, d):
    g = gen(T + d)
    x = rand(T, 2 * d + 3, gen=g, dtype=dtype, scale=4.0)[:, 3:]  # row stride 2d + 3
    want = reference.silu_and_mul(x)
    out = torch.full((T, d), float("nan"), dtype=dtype, device=x.device)
    assert triton_ops.silu_and_mul(x, out=out) is out
    assert rel_err(out, want) < tol(dtype)
    got = triton_ops.silu_and_mul(x)
    assert got.shape == (T, d) and rel_err(got, want) < tol(dtype)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,D", [(1, 3, 64), (5, 2, 48), (2, 1, 1500)])
def test_sigmoid_gate_mul(triton_ops, dtype, T, H, D):
    g = gen(T + H + D)
    o = rand(T, H, D, gen=g, dtype=dtype)
    gate = rand(T, H, 2 * D, gen=g, dtype=dtype, scale=3.0)[..., D:]  # the gate half
    want = reference.sigmoid_gate_mul(o, gate)
    got = triton_ops.sigmoid_gate_mul(o, gate)
    assert got.shape == o.shape and rel_err(got, want) < tol(dtype)
    flat = triton_ops.sigmoid_gate_mul(o.reshape(T, H * D), gate.reshape(T, H * D))
    assert rel_err(flat, want.reshape(T, H * D)) < tol(dtype)
    assert triton_ops.sigmoid_gate_mul(o, gate, out=o) is o  # in place
    assert rel_err(o, want) < tol(dtype)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "D,rotary_dim,zero_centered",
    [(64, 16, True), (32, 32, False), (48, 16, False), (256, 64, True)],
)
@pytest.mark.parametrize("T", [1, 3])
def test_qk_norm_rope(triton_ops, dtype, D, rotary_dim, zero_centered, T):
    g = gen(D + rotary_dim + T)
    Hq, Hk = 5, 2
    q = rand(T, Hq, 2 * D, gen=g, dtype=dtype, scale=2.0)[..., :D]  # [query | gate] per head
    k = view_in(rand(T, 3 * Hk * D, gen=g, dtype=dtype), (T, Hk, D), Hk * D)  # qkv columns
    wq, wk = rand(D, gen=g, dtype=dtype), rand(D, gen=g, dtype=dtype)
    rope = RotaryEmbedding(D, rotary_dim, 10000.0)
    positions = torch.randint(0, 5000, (T,), generator=g).to(kernel_device())
    cos, sin = rope.cos_sin(positions)
    want_q, want_k = reference.qk_norm_rope(q, k, wq, wk, cos, sin, EPS, zero_centered)
    q_out = torch.full((T, Hq, D), float("nan"), dtype=dtype, device=q.device)
    got_q, got_k = triton_ops.qk_norm_rope(q, k, wq, wk, cos, sin, EPS, zero_centered, q_out=q_out)
    assert got_q is q_out and got_k.shape == (T, Hk, D)
    assert rel_err(got_q, want_q) < tol(dtype) and rel_err(got_k, want_k) < tol(dtype)
    # in place into the strided views
    triton_ops.qk_norm_rope(q, k, wq, wk, cos, sin, EPS, zero_centered, q_out=q, k_out=k)
    assert rel_err(q, want_q) < tol(dtype) and rel_err(k, want_k) < tol(dtype)


def test_reference_mla_rope_norm_equals_plain_math():
    """The MLA preparation reference: pairs (2i, 2i + 1) of q_pe and k_pe turned by angle i (a
    complex product per pair, float32), c_kv RMS-normed with float32 statistics."""
    g = gen(7)
    T, H, R, P = 3, 4, 24, 8
    q_pe, kv_a = torch.randn(T, H, P, generator=g), torch.randn(T, R + P, generator=g)
    w = torch.randn(R, generator=g)
    ang = torch.rand(T, P // 2, generator=g) * 6.0
    cos, sin = torch.cos(ang), torch.sin(ang)
    got_q, got_lat = reference.mla_rope_norm(q_pe, kv_a, w, cos, sin, EPS)
    turn = torch.polar(torch.ones_like(ang), ang)  # [T, P / 2] complex
    want_q = torch.view_as_real(torch.view_as_complex(q_pe.view(T, H, P // 2, 2)) * turn[:, None])
    want_k = torch.view_as_real(torch.view_as_complex(kv_a[:, R:].reshape(T, P // 2, 2)) * turn)
    c = kv_a[:, :R]
    want_c = w * c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + EPS)
    torch.testing.assert_close(got_q, want_q.reshape(T, H, P))
    torch.testing.assert_close(got_lat, torch.cat((want_c, want_k.reshape(T, P)), dim=-1))


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,R,P", [(1, 16, 64, 16), (3, 5, 40, 8), (2, 3, 512, 64)])
def test_mla_rope_norm(triton_ops, dtype, T, H, R, P):
    """The Triton kernel against the reference, on strided views (q_pe the rope part of each
    head's [nope | rope], kv_a a column slice of a fused projection), also into q_pe itself."""
    g = gen(T * H + R)
    N = 24
    q = rand(T, H, N + P, gen=g, dtype=dtype, scale=2.0)
    q_pe = q[..., N:]  # [T, H, P] strided
    kv_a = view_in(rand(T, 40 + R + P, gen=g, dtype=dtype), (T, R + P), 40)  # column slice
    w = rand(R, gen=g, dtype=dtype)
    ang = (torch.rand(T, P // 2, generator=g) * 6.0).to(kernel_device())
    cos, sin = torch.cos(ang), torch.sin(ang)
    want_q, want_lat = reference.mla_rope_norm(q_pe, kv_a, w, cos, sin, EPS)
    got_q, got_lat = triton_ops.mla_rope_norm(q_pe, kv_a, w, cos, sin, EPS)
    assert got_q.is_contiguous() and got_lat.shape == (T, R + P)
    assert rel_err(got_q, want_q) < tol(dtype) and rel_err(got_lat, want_lat) < tol(dtype)
    triton_ops.mla_rope_norm(q_pe, kv_a, w, cos, sin, EPS, q_pe_out=q_pe)  # in place
    assert rel_err(q_pe, want_q) < tol(dtype)
    with pytest.raises(ValueError, match="cos"):
        triton_ops.mla_rope_norm(q_pe, kv_a, w, cos[:, :-1], sin[:, :-1], EPS)


@requires_triton
def test_bad_inputs(triton_ops):
    x = torch.randn(3, 8, device=kernel_device())
    with pytest.raises(ValueError, match="unit stride"):
        triton_ops.rms_norm(x.t(), torch.ones(3, device=x.device), EPS)
    with pytest.raises(ValueError, match="weight"):
        triton_ops.rms_norm(x, torch.ones(7, device=x.device), EPS)
    with pytest.raises(ValueError, match="residual"):
        triton_ops.rms_norm(x, torch.ones(8, device=x.device), EPS, residual=x[:2])
    with pytest.raises(ValueError, match="even"):
        triton_ops.silu_and_mul(x[:, :7])
    assert triton_unavailable_reason(x.device) is None


# ---------------------------------------------------------------- GPU: real sizes, CUDA graph


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("hidden", [4096, 5120, 8192])
@pytest.mark.parametrize("T", [1, 77, 8192])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_gpu_rms_norm_residual(triton_ops, hidden, T, zero_centered):
    g, dtype = gen(hidden + T), torch.bfloat16
    x = rand(T, hidden, gen=g, dtype=dtype, scale=3.0)
    residual = rand(T, hidden, gen=g, dtype=dtype, scale=10.0)
    w = rand(hidden, gen=g, dtype=dtype)
    want_out, want_res = reference.rms_norm(x, w, EPS, zero_centered, residual.clone())
    out = torch.full_like(x, float("nan"))
    triton_ops.rms_norm(x, w, EPS, zero_centered, residual=residual, out=out)
    assert torch.equal(residual, want_res)
    assert rel_err(out, want_out) < 4e-3


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "Hq,Hk,D,rotary_dim,zero_centered,gated",
    [
        (16, 4, 256, 64, True, True),
        (40, 8, 128, 128, False, False),
        (32, 8, 128, 128, False, False),
    ],
)
@pytest.mark.parametrize("T", [1, 8192])
def test_gpu_attention_ops(triton_ops, Hq, Hk, D, rotary_dim, zero_centered, gated, T):
    g, dtype = gen(Hq + D + T), torch.bfloat16
    q_width = (2 if gated else 1) * Hq * D
    qkv = rand(T, q_width + 2 * Hk * D, gen=g, dtype=dtype, scale=2.0)
    q_part = view_in(qkv, (T, Hq, q_width // Hq), 0)
    q, gate = q_part[..., :D], q_part[..., D:]
    k = view_in(qkv, (T, Hk, D), q_width)
    wq, wk = rand(D, gen=g, dtype=dtype), rand(D, gen=g, dtype=dtype)
    rope = RotaryEmbedding(D, rotary_dim, 10_000_000.0)
    cos, sin = rope.cos_sin(torch.randint(0, 200_000, (T,), device="cuda"))
    want_q, want_k = reference.qk_norm_rope(q, k, wq, wk, cos, sin, EPS, zero_centered)
    got_q, got_k = triton_ops.qk_norm_rope(q, k, wq, wk, cos, sin, EPS, zero_centered)
    assert rel_err(got_q, want_q) < 4e-3 and rel_err(got_k, want_k) < 4e-3
    if gated:
        o = rand(T, Hq, D, gen=g, dtype=dtype)
        out = torch.full_like(o, float("nan"))
        triton_ops.sigmoid_gate_mul(o, gate, out=out)
        assert rel_err(out, reference.sigmoid_gate_mul(o, gate)) < 4e-3


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("T", [1, 33, 8192])
def test_gpu_gdn_norm_and_mlp(triton_ops, T):
    g, dtype = gen(T), torch.bfloat16
    HV, V, d = 32, 128, 12288
    x = rand(T, HV, V, gen=g, dtype=dtype)
    z = view_in(rand(T, 2 * HV * V + 64, gen=g, dtype=dtype), (T, HV, V), HV * V)
    w = rand(V, gen=g, dtype=dtype)
    out = torch.full_like(x, float("nan"))
    triton_ops.gated_rms_norm(x, z, w, EPS, out=out)
    assert rel_err(out, reference.gated_rms_norm(x, z, w, EPS)) < 4e-3
    gu = rand(T, 2 * d, gen=g, dtype=dtype, scale=3.0)
    act = torch.full((T, d), float("nan"), dtype=dtype, device="cuda")
    triton_ops.silu_and_mul(gu, out=act)
    assert rel_err(act, reference.silu_and_mul(gu)) < 4e-3


@pytest.mark.gpu
@requires_cuda
def test_gpu_cuda_graph_decoder_chain(triton_ops):
    """A decode step's elementwise chain captured in a CUDA graph, replayed on new inputs."""
    g, dtype, T, hidden, d = gen(5), torch.bfloat16, 4, 4096, 12288
    w = rand(hidden, gen=g, dtype=dtype)
    x, residual = rand(T, hidden, gen=g, dtype=dtype), rand(T, hidden, gen=g, dtype=dtype)
    gu = rand(T, 2 * d, gen=g, dtype=dtype)

    def step():
        h, _ = triton_ops.rms_norm(x, w, EPS, True, residual=residual)
        return h, triton_ops.silu_and_mul(gu)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h, act = step()
    for seed in (1, 2):
        gg = gen(seed)
        x.copy_(rand(T, hidden, gen=gg, dtype=dtype))
        residual.copy_(rand(T, hidden, gen=gg, dtype=dtype))
        gu.copy_(rand(T, 2 * d, gen=gg, dtype=dtype))
        want_h, want_res = reference.rms_norm(x, w, EPS, True, residual.clone())
        want_act = reference.silu_and_mul(gu)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(residual, want_res)
        assert rel_err(h, want_h) < 4e-3 and rel_err(act, want_act) < 4e-3
