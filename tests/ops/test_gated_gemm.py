"""The mixers' output gates fused into the decode GEMM (ops/linear/triton_gated_gemm.py) against
their float32 torch reference and against the two kernels they replace (the gate kernel, then the
base decode GEMM), at one token and more; the zero padded rows; the argument checks; when
`TritonDecodeGemm.gated` declines a call (more than one token among others); the GDN and
gated-attention layers' `post` with the fused path against the unfused one (and that it was
taken). CPU: Triton's interpreter at small sizes in fp16 (its bf16
`tl.dot` is not a float product: bf16 runs on the GPU only); GPU
(`pytest -m gpu`): the Qwen3.5 9B and 35B-A3B shapes at 1, 16 and 64 rows, eagerly and in a
replayed CUDA graph."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_helpers import kernel_device, requires_triton  # noqa: E402

EPS = 1e-6
ON_GPU = torch.cuda.is_available()


def _inputs(gate, T, H, head, N, dtype, device, seed=0):
    """o [T, H, head] contiguous; z [T, H, head] a strided view (heads 2 * head + 3 apart, as a
    projection's column slice); W [N, H * head]; the norm weight [head] around 1."""
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(T, H, head, generator=g).to(dtype).to(device)
    wide = (torch.randn(T, H, 2 * head + 3, generator=g) * 2).to(dtype).to(device)
    z = wide[:, :, 3 : 3 + head]
    w = (torch.randn(N, H * head, generator=g) / (H * head) ** 0.5).to(dtype).to(device)
    nw = (torch.randn(head, generator=g) * 0.3 + 1).to(dtype).to(device)
    return o, z, w, nw


def _two_kernels(gate, o, z, w, nw, rows):
    """What the layers ran before: the gate kernel (zero padded rows), then the base GEMM."""
    from deltaserve.ops.fused.activation import sigmoid_gate_mul
    from deltaserve.ops.fused.gated_norm import gated_rms_norm
    from deltaserve.ops.linear.triton_gemm import decode_gemm_base

    x = o.new_zeros(rows, *o.shape[1:])
    if gate == "gated_norm":
        gated_rms_norm(o, z, nw, EPS, out=x[: o.shape[0]])
    else:
        sigmoid_gate_mul(o, z, out=x[: o.shape[0]])
    return decode_gemm_base(x.reshape(rows, -1), w)


def _rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


CASES = [  # (gate, T, rows, H, head, N); T = 1 runs the one-token path
    ("gated_norm", 1, 1, 6, 128, 37),
    ("gated_norm", 1, 4, 2, 64, 40),
    ("sigmoid", 1, 2, 2, 512, 24),
    ("gated_norm", 3, 5, 3, 64, 40),
    ("gated_norm", 16, 16, 2, 256, 33),
    ("gated_norm", 20, 33, 3, 128, 17),
    ("sigmoid", 1, 1, 3, 256, 37),
    ("sigmoid", 5, 7, 5, 32, 24),
    ("sigmoid", 16, 16, 2, 128, 50),
    ("sigmoid", 30, 64, 2, 64, 9),
]


@requires_triton
@pytest.mark.parametrize("gate,T,rows,H,head,N", CASES)
def test_matches_reference_and_two_kernels(gate, T, rows, H, head, N):
    from deltaserve.ops.linear.triton_gated_gemm import gated_decode_gemm, gated_decode_gemm_torch

    device = kernel_device()
    for dtype in (torch.float16, torch.bfloat16) if device.type == "cuda" else (torch.float16,):
        o, z, w, nw = _inputs(gate, T, H, head, N, dtype, device, seed=T * 7 + head)
        got = gated_decode_gemm(gate, o, z, w, rows, nw, EPS)
        assert got.shape == (rows, N) and got.dtype == dtype
        assert torch.all(got[T:] == 0), "rows past T must be zero"
        two = _two_kernels(gate, o, z, w, nw, rows)
        assert _rel_err(got, two) < 1e-2, f"{dtype}: against the two kernels"
        f32 = [t.float() for t in (o, z, w, nw)]
        want = gated_decode_gemm_torch(gate, f32[0], f32[1], f32[2], rows, f32[3], EPS)
        assert _rel_err(got, want) < 1e-2, f"{dtype}: against the float32 reference"


@requires_triton
def test_gated_norm_is_per_head():
    """Scaling one head of o leaves the others' normalised values (and a zero W for that head's
    columns leaves the output) unchanged: the statistics are per head, not per tile."""
    from deltaserve.ops.linear.triton_gated_gemm import gated_decode_gemm

    o, z, w, nw = _inputs("gated_norm", 2, 4, 64, 16, torch.float16, kernel_device())
    w[:, 64:128] = 0  # head 1's columns
    a = gated_decode_gemm("gated_norm", o, z, w, 2, nw, EPS)
    o2 = o.clone()
    o2[:, 1] *= 8
    b = gated_decode_gemm("gated_norm", o2, z, w, 2, nw, EPS)
    torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


@requires_triton
def test_rejects_bad_inputs():
    from deltaserve.ops.linear.triton_gated_gemm import gated_decode_gemm

    o, z, w, nw = _inputs("gated_norm", 2, 2, 64, 8, torch.float16, kernel_device())
    with pytest.raises(ValueError, match="unknown gate"):
        gated_decode_gemm("relu", o, z, w, 2, nw, EPS)
    with pytest.raises(ValueError, match="must be \\[T, H, head\\]"):
        gated_decode_gemm("sigmoid", o.reshape(2, -1), z.reshape(2, -1), w, 2)
    with pytest.raises(ValueError, match="does not take"):
        gated_decode_gemm("sigmoid", o, z, w[:, :64], 2)
    with pytest.raises(ValueError, match="rows must be"):
        gated_decode_gemm("sigmoid", o, z, w, 1)
    with pytest.raises(ValueError, match="rows must be"):
        gated_decode_gemm("sigmoid", o, z, w, 65)
    with pytest.raises(ValueError, match="contiguous \\[64\\] weight"):
        gated_decode_gemm("gated_norm", o, z, w, 2, None, EPS)
    with pytest.raises(ValueError, match="float32"):
        f = [t.float() for t in (o, z, w)]
        gated_decode_gemm("sigmoid", *f, 2)
    odd = torch.zeros(2, 2, 48, dtype=torch.float16, device=o.device)
    with pytest.raises(ValueError, match="48 channels"):
        gated_decode_gemm("sigmoid", odd, odd, w[:, :96], 2)


def test_unsupported_reasons():
    from deltaserve.ops.linear.triton_gated_gemm import gate_unsupported

    assert gate_unsupported("gated_norm", 128, torch.bfloat16) is None
    assert gate_unsupported("sigmoid", 256, torch.float16) is None
    assert "float32" in gate_unsupported("sigmoid", 256, torch.float32)
    assert "512 channels" in gate_unsupported("gated_norm", 512, torch.bfloat16)
    assert gate_unsupported("sigmoid", 512, torch.bfloat16) is None
    assert "96 channels" in gate_unsupported("sigmoid", 96, torch.bfloat16)
    assert "unknown gate" in gate_unsupported("tanh", 128, torch.bfloat16)


def _spy(monkeypatch):
    """Count the fused kernel's calls (TritonDecodeGemm.gated imports it at each call)."""
    import deltaserve.ops.linear.triton_gated_gemm as mod

    calls = []
    real = mod.gated_decode_gemm

    def spy(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "gated_decode_gemm", spy)
    return calls


@requires_triton
def test_backend_declines_what_it_does_not_serve(monkeypatch):
    from deltaserve.ops.linear.triton_gemm import TritonDecodeGemm

    calls = _spy(monkeypatch)
    dev = kernel_device()
    o, z, w, nw = _inputs("sigmoid", 2, 2, 64, 8, torch.float16, dev)
    one_o, one_z = o[:1], z[:1]
    gemm = TritonDecodeGemm("auto", 64)
    assert gemm.gated("sigmoid", one_o, one_z, w, 1) is not None and calls == ["sigmoid"]
    assert gemm.gated("sigmoid", one_o, one_z, w, 3) is not None  # padded rows
    assert gemm.gated("sigmoid", o, z, w, 2) is None  # two tokens: the two kernels are faster
    assert TritonDecodeGemm("auto", 16).gated("sigmoid", one_o, one_z, w, 17) is None
    assert TritonDecodeGemm("splitk", 64).gated("sigmoid", one_o, one_z, w, 1) is None
    f = [t.float() for t in (one_o, one_z, w)]
    assert gemm.gated("sigmoid", *f, 1) is None  # float32
    monkeypatch.setenv("DELTASERVE_GATED_GEMM", "0")
    assert TritonDecodeGemm("auto", 64).gated("sigmoid", one_o, one_z, w, 1) is None
    assert calls == ["sigmoid", "sigmoid"]


def _gdn(dtype, device):
    from deltaserve.layers.gdn import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(0, 96, 2, 4, 32, 64, 4, EPS).to(dtype).to(device)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    with torch.no_grad():
        layer.norm.weight.add_(1.0)
    return layer


def _attention(dtype, device):
    from deltaserve.layers.attention import Attention

    torch.manual_seed(0)
    layer = Attention(0, 96, 3, 1, 64, None, EPS, output_gate=True).to(dtype).to(device)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


def _post_parts(kind, layer, rows, dtype, device):
    """(o, parts) as the layer's `pre` and `core` hand them to `post`."""
    g = torch.Generator().manual_seed(rows)
    if kind == "gdn":
        width = layer.in_proj.out_features
        y = torch.randn(rows, width, generator=g).to(dtype).to(device)
        o = torch.randn(rows, layer.spec.num_v_heads, layer.spec.head_v_dim, generator=g)
        return o.to(dtype).to(device), (y,)
    D, H = layer.head_dim, layer.num_heads
    q_gate = torch.randn(rows, H, 2 * D, generator=g).to(dtype).to(device)
    q, gate = q_gate[..., :D], q_gate[..., D:]
    o = torch.randn(rows, H, D, generator=g).to(dtype).to(device)
    return o, (q, None, None, gate)


@requires_triton
@pytest.mark.parametrize("kind", ["gdn", "attention"])
@pytest.mark.parametrize("rows,tokens", [(1, None), (4, 1), (5, None), (8, 3)])
def test_layer_post_fused_equals_unfused(monkeypatch, kind, rows, tokens):
    """`post` of one token through the fused kernel equals `post` through the gate kernel and
    the GEMM, with padded rows (ctx.num_tokens < rows) zero in both; more tokens take the two
    kernels."""
    from deltaserve.forward_context import ForwardContext, Kernels
    from deltaserve.ops.fused.triton_ops import TritonFusedOps
    from deltaserve.ops.linear import attach_decode_gemm
    from deltaserve.ops.linear.triton_gemm import TritonDecodeGemm

    calls = _spy(monkeypatch)
    device, dtype = kernel_device(), torch.float16
    layer = (_gdn if kind == "gdn" else _attention)(dtype, device)
    o, parts = _post_parts(kind, layer, rows, dtype, device)
    T = rows if tokens is None else tokens
    ctx = ForwardContext(meta=None, caches=[], kernels=Kernels(fused=TritonFusedOps()))
    ctx.num_tokens = tokens
    gemm = TritonDecodeGemm("auto", 64)
    attach_decode_gemm(layer, gemm)
    fused = layer.post(o[:T], parts, ctx)
    want_calls = [{"gdn": "gated_norm", "attention": "sigmoid"}[kind]] if T == 1 else []
    assert calls == want_calls
    gemm.fuse_gates = False
    unfused = layer.post(o[:T], parts, ctx)
    assert calls == want_calls
    assert fused.shape == unfused.shape == (rows, 96)
    assert torch.all(fused[T:] == 0) and torch.all(unfused[T:] == 0)
    assert _rel_err(fused, unfused) < 1e-2


# ---- GPU: the models' shapes ---------------------------------------------------------------
GPU_SHAPES = [  # (gate, H, head, N): 35B-A3B / 9B out_proj, 35B-A3B / 9B o_proj
    ("gated_norm", 32, 128, 2048),
    ("gated_norm", 32, 128, 4096),
    ("sigmoid", 16, 256, 2048),
    ("sigmoid", 16, 256, 4096),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("gate,H,head,N", GPU_SHAPES)
@pytest.mark.parametrize("T,rows", [(1, 1), (13, 16), (64, 64), (40, 64)])
def test_gpu_model_shapes(gate, H, head, N, T, rows):
    from deltaserve.ops.linear.triton_gated_gemm import gated_decode_gemm, gated_decode_gemm_torch

    o, z, w, nw = _inputs(gate, T, H, head, N, torch.bfloat16, "cuda", seed=T)
    got = gated_decode_gemm(gate, o, z, w, rows, nw, EPS)
    assert torch.all(got[T:] == 0)
    assert _rel_err(got, _two_kernels(gate, o, z, w, nw, rows)) < 1e-2
    f32 = [t.float() for t in (o, z, w, nw)]
    want = gated_decode_gemm_torch(gate, f32[0], f32[1], f32[2], rows, f32[3], EPS)
    assert _rel_err(got, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_gpu_graph_replay_equals_eager():
    from deltaserve.ops.linear.triton_gated_gemm import gated_decode_gemm

    o, z, w, nw = _inputs("gated_norm", 1, 32, 128, 2048, torch.bfloat16, "cuda")
    eager = gated_decode_gemm("gated_norm", o, z, w, 1, nw, EPS)  # tunes outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gated_decode_gemm("gated_norm", o, z, w, 1, nw, EPS)
    o.copy_(torch.randn_like(o))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, gated_decode_gemm("gated_norm", o, z, w, 1, nw, EPS))
    assert not torch.equal(out, eager)
