"""Decode GEMM prologues (ops/linear/prologue.py): the op before a projection applied as the
GEMM loads its input. On CPU in Triton's interpreter (GPU: `pytest -m gpu`, model shapes):

- each prologue through the base and the split-K kernels (dot and FMA tiles, splits with a
  ragged last slice; at most 16 rows) equals the op's own Triton kernel
  (ops/fused) followed by the same GEMM bit for bit, and the float32 reference within the
  GEMM's tolerance;
- bad prologues fail naming what is wrong;
- with DELTASERVE_DECODE_GEMM_PROLOGUE=1 the MLP, the GDN layer and the gated attention hand
  their op to the GEMM
  (and only for decode-sized inputs without padded rows), and a model's greedy tokens and
  logprobs are those of the unfused layers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_helpers import kernel_device, lift_backend_check, requires_triton  # noqa: E402
from moe_cases import poisoned_empty  # noqa: E402

from deltaserve.ops.linear import prologue as P  # noqa: E402

pytestmark = requires_triton


def _dtype():
    return torch.float16 if kernel_device().type == "cpu" else torch.bfloat16


def _inputs(kind: str, M: int, N: int, K: int, head: int = 16, seed: int = 0):
    """(x, W, prologue) on the kernel device: x [M, 2K] for silu_mul, [M, K] otherwise, with
    z / the gate [M, K / head, head] a strided view (gated_norm: a column slice of a wider
    tensor, as the GDN in_proj output gives it; sigmoid_mul: every other head of a wider
    tensor, as Qwen3.5's per-head [query | gate] projection gives it)."""
    gen = torch.Generator().manual_seed(seed + 7 * M + 13 * N + K)
    dev, dtype = kernel_device(), _dtype()
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dev, dtype)
    if kind == "silu_mul":
        x = (2 * torch.randn(M, 2 * K, generator=gen)).to(dev, dtype)
        return x, w, P.silu_mul()
    x = (3 * torch.randn(M, K, generator=gen)).to(dev, dtype)
    heads = K // head
    if kind == "sigmoid_mul":
        wide = (2 * torch.randn(M, heads, 2 * head, generator=gen)).to(dev, dtype)
        return x, w, P.sigmoid_mul(wide[..., head:])  # head stride 2 * head
    wide = torch.randn(M, K + 9, generator=gen).to(dev, dtype)
    z = wide[:, 4 : 4 + K].view(M, heads, head)  # row stride K + 9
    nw = (1 + 0.3 * torch.randn(head, generator=gen)).to(dev, dtype)
    return x, w, P.gated_norm(z, nw, 1e-6)


def _unfused(x: torch.Tensor, pro: P.DecodePrologue) -> torch.Tensor:
    """The op by its own Triton kernel (ops/fused), as the layers run it unfused."""
    from deltaserve.ops.fused.activation import sigmoid_gate_mul, silu_and_mul
    from deltaserve.ops.fused.gated_norm import gated_rms_norm

    if pro.kind == "silu_mul":
        return silu_and_mul(x)
    heads = x.view(pro.z.shape)  # [M, H, D]
    if pro.kind == "sigmoid_mul":
        return sigmoid_gate_mul(heads, pro.z).reshape(x.shape)
    return gated_rms_norm(heads, pro.z, pro.norm_weight, pro.eps).reshape(x.shape)


def _check_reference(got, x, w, pro, tol=1e-2):
    want = P.reference(x, pro).float() @ w.float().T
    err = (got.float() - want).abs().max().item()
    assert err <= tol * (want.abs().max().item() + 1e-6), err


SPLITK_CASES = [
    (1, 37, 128, dict(block_n=16, block_k=32, split_k=4)),  # ragged: 4 slices of 32
    (3, 40, 96, dict(block_n=16, block_k=32, split_k=2, fma=True, prefetch=True)),
    (4, 20, 64, dict(block_n=16, block_k=16, split_k=1, fma=True)),
    (16, 33, 160, dict(block_n=32, block_k=32, split_k=2)),
]


KINDS = ["silu_mul", "gated_norm", "sigmoid_mul"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M,N,K,fields", SPLITK_CASES)
def test_splitk_prologue_equals_the_op_then_the_gemm(kind, M, N, K, fields):
    from deltaserve.ops.linear.triton_splitk import SplitKConfig, decode_gemm_splitk

    head = 16 if fields["block_k"] >= 16 else 8
    if kind == "sigmoid_mul":  # any head size: columns of a K tile may span heads
        head = 32 if K % 32 == 0 else 16
    x, w, pro = _inputs(kind, M, N, K, head)
    cfg = SplitKConfig(**fields)
    with poisoned_empty():  # output and workspace NaN until written
        got = decode_gemm_splitk(x, w, None, cfg, pro)
        want = decode_gemm_splitk(_unfused(x, pro), w, None, cfg)
    assert got.shape == (M, N) and not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    _check_reference(got, x, w, pro)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M,N,K", [(1, 37, 64), (5, 100, 96), (16, 24, 32)])
def test_base_prologue_equals_the_op_then_the_gemm(kind, M, N, K):
    from deltaserve.ops.linear.triton_gemm import decode_gemm_base

    x, w, pro = _inputs(kind, M, N, K, head=32)  # the interpreter's first tile: 32 columns
    got = decode_gemm_base(x, w, None, pro)
    torch.testing.assert_close(got, decode_gemm_base(_unfused(x, pro), w), rtol=0, atol=0)
    _check_reference(got, x, w, pro)


def test_base_kernel_takes_a_k_tile_of_whole_heads():
    """A head of 64 columns is wider than the K tile the kernel otherwise takes (32 under the
    interpreter; the tuner's configurations are pruned to those holding whole heads)."""
    from deltaserve.ops.linear.triton_gemm import decode_gemm_base

    x, w, pro = _inputs("gated_norm", 2, 30, 128, head=64)
    _check_reference(decode_gemm_base(x, w, None, pro), x, w, pro)


def test_default_config_keeps_whole_heads_in_a_k_tile():
    from deltaserve.ops.linear.triton_splitk import config_for, decode_gemm_splitk

    x, w, pro = _inputs("gated_norm", 1, 16, 1024, head=512)
    cfg = config_for(x, w, pro)
    assert cfg.block_k >= 512 and 1024 // cfg.split_k >= 512
    _check_reference(decode_gemm_splitk(x, w, None, None, pro), x, w, pro)


def test_bad_prologues_fail_naming_what_is_wrong():
    from deltaserve.ops.linear.triton_gemm import decode_gemm
    from deltaserve.ops.linear.triton_splitk import SplitKConfig, decode_gemm_splitk

    x, w, _ = _inputs("silu_mul", 2, 16, 32)
    with pytest.raises(ValueError, match="halves have 32 features but the weight expects 31"):
        decode_gemm(x, w[:, :31].contiguous(), None, "base", P.silu_mul())
    with pytest.raises(ValueError, match="even number of input columns"):
        decode_gemm(x[:, :63], w, None, "base", P.silu_mul())
    x, w, pro = _inputs("gated_norm", 2, 16, 48, head=16)
    with pytest.raises(ValueError, match=r"heads of 16 and a weight \(12,\)"):
        decode_gemm(x, w, None, "base", P.gated_norm(pro.z, pro.norm_weight[:12], 1e-6))
    z12 = pro.z.reshape(2, 4, 12)
    with pytest.raises(ValueError, match="heads of a power-of-two size"):
        decode_gemm(x, w, None, "base", P.gated_norm(z12, pro.norm_weight[:12], 1e-6))
    with pytest.raises(ValueError, match=r"must be \[M, H, D\] with M = 2 and H \* D = 48"):
        decode_gemm(x, w, None, "base", P.gated_norm(pro.z[:1], pro.norm_weight, 1e-6))
    with pytest.raises(ValueError, match="needs z and the norm weight"):
        decode_gemm(x, w, None, "base", P.DecodePrologue("gated_norm"))
    with pytest.raises(ValueError, match="sigmoid_mul prologue needs the gate"):
        decode_gemm(x, w, None, "base", P.DecodePrologue("sigmoid_mul"))
    with pytest.raises(ValueError, match="unit last stride and x's dtype"):
        decode_gemm(x, w, None, "base", P.sigmoid_mul(pro.z.float()))
    with pytest.raises(ValueError, match="unknown decode GEMM prologue 'gelu'"):
        decode_gemm(x, w, None, "base", P.DecodePrologue("gelu"))
    with pytest.raises(ValueError, match="splits the prologue's heads"):
        decode_gemm_splitk(x, w, None, SplitKConfig(16, 8, 1), pro)
    x, w, pro = _inputs("silu_mul", 17, 16, 32)  # the wide tiles take no prologue
    with pytest.raises(ValueError, match="prologue serves at most 16 rows, got 17"):
        decode_gemm_splitk(x, w, None, SplitKConfig(32, 32, 1), pro)


# ---- the layers ----------------------------------------------------------------------------
def _attach_triton_gemm(model, monkeypatch, on: bool) -> None:
    from deltaserve.ops.linear import attach_decode_gemm
    from deltaserve.ops.linear.triton_gemm import TritonDecodeGemm

    monkeypatch.setenv("DELTASERVE_DECODE_GEMM_PROLOGUE", "1" if on else "0")
    attach_decode_gemm(model, TritonDecodeGemm())


def test_mlp_hands_silu_mul_to_the_gemm_for_decode_rows(monkeypatch):
    from types import SimpleNamespace

    from deltaserve.layers.mlp import GatedMLP
    from deltaserve.ops.fused.triton_ops import TritonFusedOps

    torch.manual_seed(0)
    mlp = GatedMLP(32, 48).to(kernel_device(), _dtype())
    for p in mlp.parameters():
        p.data.normal_(0, 0.2)
    ctx = SimpleNamespace(kernels=SimpleNamespace(fused=TritonFusedOps()))  # what `ffn` reads
    calls = []
    x = torch.randn(4, 32, device=kernel_device()).to(_dtype())
    for on in (False, True):
        _attach_triton_gemm(mlp, monkeypatch, on)
        gemm = mlp.down_proj.decode_gemm
        seen = []
        monkeypatch.setattr(type(gemm), "__call__", _spy(type(gemm).__call__, seen))
        calls.append((mlp(x, ctx), seen))
        monkeypatch.undo()
    (unfused, seen_off), (fused, seen_on) = calls
    assert seen_off == [None, None] and seen_on == [None, "silu_mul"]
    torch.testing.assert_close(fused, unfused, rtol=0, atol=0)


def _spy(call, seen):
    def spy(self, x, w, b=None, prologue=None):
        seen.append(None if prologue is None else prologue.kind)
        return call(self, x, w, b, prologue)

    return spy


@pytest.mark.parametrize(
    "spec,kinds",
    [
        # value heads of 24: the GDN norm stays unfused
        ("qwen3_5_r2_g3", {"silu_mul", "sigmoid_mul"}),
        ("qwen3_next_e10k4_r2_mlponly_fused", {"silu_mul", "gated_norm", "sigmoid_mul"}),
    ],
)
def test_engine_greedy_tokens_equal_with_prologues(tmp_path, monkeypatch, spec, kinds):
    """Tiny hybrid models through the Triton decode GEMM and fused ops (fp16 on CPU): the same
    greedy tokens and logprobs, bit for bit, with the prologues as without, and the prologues
    did run."""
    from greedy_runs import greedy_run
    from hf_models import SPECS_BY_NAME, build_model

    from deltaserve.ops.linear.triton_gemm import TritonDecodeGemm

    model_dir, _ = build_model(SPECS_BY_NAME[spec], tmp_path / "m", load_oracle=False)
    lift_backend_check(monkeypatch, "decode_gemm")
    lift_backend_check(monkeypatch, "fused")  # unfused, the ops run the Triton kernels too
    seen: list = []
    monkeypatch.setattr(TritonDecodeGemm, "__call__", _spy(TritonDecodeGemm.__call__, seen))
    runs = []
    for on in ("0", "1"):
        monkeypatch.setenv("DELTASERVE_DECODE_GEMM_PROLOGUE", on)
        seen.clear()
        runs.append(greedy_run(model_dir, decode_gemm_backend="triton", fused_backend="triton"))
        assert set(seen) - {None} == (kinds if on == "1" else set())
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M", [1, 4, 16])
@pytest.mark.parametrize("N,K", [(4096, 12288), (4096, 4096), (2048, 4096)])
@pytest.mark.parametrize("kernel", ["splitk", "base"])
def test_gpu_prologue_model_shapes(kind, M, N, K, kernel):
    """9B / 35B-A3B shapes (down_proj: K 12288; out_proj: K 4096 of 32 heads of 128; o_proj:
    heads of 128 here, 256 in the models). The
    tuner may pick another K tile with the prologue than without (its key holds the prologue),
    so the two agree to the GEMM's rounding, not bit for bit."""
    from deltaserve.ops.linear.triton_gemm import decode_gemm

    x, w, pro = _inputs(kind, M, N, K, head=128)
    got = decode_gemm(x, w, None, kernel, pro)
    want = decode_gemm(_unfused(x, pro), w, None, kernel)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=1e-2 * scale)
    _check_reference(got, x, w, pro)
