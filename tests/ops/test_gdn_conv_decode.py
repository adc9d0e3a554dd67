"""The fused GDN decode (ops/gdn/triton_conv_decode.py: conv1d update + delta rule in one kernel)
against the two kernels it replaces (triton_conv1d.conv1d_decode, then
triton_decode.gdn_decode): the output, the SSM pool and the conv pool equal theirs bit for bit,
at awkward sizes (value heads per key head 1 to 3, V not a power of two, conv widths 2 to 4,
float32 and bfloat16 state), with the arrival counters back at zero after every call; bad
shapes fail naming what is wrong; with DELTASERVE_GDN_FUSED_CONV=1 a model's one-token decode
steps take it and its greedy tokens and logprobs are unchanged. CPU: Triton's interpreter;
GPU (`pytest -m gpu`): the 9B / 35B-A3B shapes in a CUDA graph, replayed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_helpers import kernel_device, lift_backend_check, requires_triton  # noqa: E402

pytestmark = requires_triton


def _case(n, hk, hv, dk, dv, width, state_dtype, num_slots=9, seed=0):
    """Inputs on the kernel device: the raw in_proj output (qkv columns inside wider rows, as
    the fused in_proj's split gives them), conv weight and windows, a, b, A_log, dt_bias, the
    SSM pool and distinct slots."""
    dev = kernel_device()
    dtype = torch.float16 if dev.type == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    conv_dim = 2 * hk * dk + hv * dv
    wide = torch.randn(n, conv_dim + 11, generator=gen)
    qkv = wide.to(dev, dtype)[:, 3 : 3 + conv_dim]  # row stride conv_dim + 11
    weight = (0.5 * torch.randn(conv_dim, width, generator=gen)).to(dev, dtype)
    conv_state = torch.randn(num_slots, conv_dim, width - 1, generator=gen).to(dev, dtype)
    ab = torch.randn(n, 2 * hv + 5, generator=gen).to(dev, dtype)
    a, b = ab[:, :hv], ab[:, hv + 5 :]
    A_log = torch.empty(hv).uniform_(0.01, 16, generator=gen).log().to(dev)
    dt_bias = torch.randn(hv, generator=gen).to(dev)
    ssm = (0.3 * torch.randn(num_slots, hv, dv, dk, generator=gen)).to(dev, state_dtype)
    slots = torch.randperm(num_slots - 1, generator=gen)[:n].add(1).to(dev)
    return qkv, weight, conv_state, a, b, A_log, dt_bias, ssm, slots


def _unfused(qkv, weight, conv_state, a, b, A_log, dt_bias, ssm, slots, hk, dk):
    from deltaserve.ops.gdn.triton_conv1d import conv1d_decode
    from deltaserve.ops.gdn.triton_decode import gdn_decode

    n, hv, dv = qkv.shape[0], ssm.shape[1], ssm.shape[2]
    y = conv1d_decode(qkv, weight, conv_state, slots)
    q, k, v = torch.split(y, [hk * dk, hk * dk, hv * dv], dim=-1)
    return gdn_decode(
        q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), a, b, A_log,
        dt_bias, ssm, slots,
    )  # fmt: skip


def _counters_zero() -> bool:
    from deltaserve.ops.tile_counters import all_counters

    return all(int(c.abs().sum()) == 0 for c in all_counters())


@pytest.mark.parametrize(
    "n,hk,hv,dk,dv,width",
    [(1, 2, 4, 16, 8, 4), (3, 1, 3, 16, 24, 4), (2, 2, 2, 32, 16, 2), (4, 3, 6, 16, 12, 3)],
)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_conv_then_delta_rule(n, hk, hv, dk, dv, width, state_dtype):
    from deltaserve.ops.gdn.triton_conv_decode import gdn_conv_decode

    case = _case(n, hk, hv, dk, dv, width, state_dtype)
    qkv, weight, conv_state, a, b, A_log, dt_bias, ssm, slots = case
    conv_ref, ssm_ref = conv_state.clone(), ssm.clone()
    want = _unfused(qkv, weight, conv_ref, a, b, A_log, dt_bias, ssm_ref, slots, hk, dk)
    for _ in range(2):  # the second call starts from the first's pools and counters
        got = gdn_conv_decode(qkv, weight, conv_state, a, b, A_log, dt_bias, ssm, slots, hk, dk)
        assert _counters_zero()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(conv_state, conv_ref, rtol=0, atol=0)
        torch.testing.assert_close(ssm, ssm_ref, rtol=0, atol=0)
        want = _unfused(qkv, weight, conv_ref, a, b, A_log, dt_bias, ssm_ref, slots, hk, dk)


def test_fused_rejects_bad_shapes():
    from deltaserve.ops.gdn.triton_conv_decode import gdn_conv_decode

    qkv, weight, conv_state, a, b, A_log, dt_bias, ssm, slots = _case(
        2, 2, 4, 16, 8, 4, torch.float32
    )
    args = (a, b, A_log, dt_bias, ssm, slots)
    with pytest.raises(ValueError, match="does not fit HK=3"):
        gdn_conv_decode(qkv, weight, conv_state, *args, 3, 16)
    with pytest.raises(ValueError, match="is not 2 \\* HK \\* K \\+ HV \\* V"):
        gdn_conv_decode(qkv, weight[:-1], conv_state[:, :-1], *args, 2, 16)
    with pytest.raises(ValueError, match="must be \\[N=2"):
        gdn_conv_decode(qkv[:1], weight, conv_state, *args, 2, 16)
    with pytest.raises(ValueError, match="does not fit the conv weight"):
        gdn_conv_decode(qkv, weight, conv_state[..., :2], *args, 2, 16)


@pytest.mark.parametrize("spec", ["qwen3_5_r2_g3", "qwen3_next_e10k4_r2_mlponly_fused"])
def test_engine_decode_steps_take_the_fused_kernel(tmp_path, monkeypatch, spec):
    """A tiny hybrid model with the Triton conv1d and GDN decode backends (fp16 on CPU): the
    same greedy tokens and logprobs, bit for bit, with the fused decode as without, and its
    one-token decode steps ran it."""
    from greedy_runs import greedy_run
    from hf_models import SPECS_BY_NAME, build_model

    from deltaserve.ops.gdn import triton_conv_decode

    model_dir, _ = build_model(SPECS_BY_NAME[spec], tmp_path / "m", load_oracle=False)
    for op in ("conv1d", "gdn_decode"):
        lift_backend_check(monkeypatch, op)
    calls = []
    fused = triton_conv_decode.gdn_conv_decode

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return fused(*args, **kwargs)

    monkeypatch.setattr(triton_conv_decode, "gdn_conv_decode", spy)
    runs = []
    for on in ("0", "1"):
        monkeypatch.setenv("DELTASERVE_GDN_FUSED_CONV", on)
        calls.clear()
        runs.append(greedy_run(model_dir, conv1d_backend="triton", gdn_decode_backend="triton"))
        assert bool(calls) == (on == "1") and set(calls) <= {1, 2, 3}
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("hk,hv", [(16, 32), (16, 16)])
@pytest.mark.parametrize("n", [1, 7, 64])
def test_gpu_fused_real_shapes_in_a_graph(hk, hv, n):
    """Qwen3.5-9B / 35B-A3B GDN shapes (K = V = 128, width 4, float32 state): captured in a
    CUDA graph and replayed three times, each replay equal to the two kernels."""
    from deltaserve.ops.gdn.triton_conv_decode import gdn_conv_decode

    case = _case(n, hk, hv, 128, 128, 4, torch.float32, num_slots=n + 5)
    qkv, weight, conv_state, a, b, A_log, dt_bias, ssm, slots = case
    conv_ref, ssm_ref = conv_state.clone(), ssm.clone()
    args = (qkv, weight, conv_state, a, b, A_log, dt_bias, ssm, slots, hk, 128)
    gdn_conv_decode(*args)  # compile outside the capture
    _unfused(qkv, weight, conv_ref, a, b, A_log, dt_bias, ssm_ref, slots, hk, 128)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gdn_conv_decode(*args)
    for _ in range(3):
        graph.replay()
        want = _unfused(qkv, weight, conv_ref, a, b, A_log, dt_bias, ssm_ref, slots, hk, 128)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        torch.testing.assert_close(conv_state, conv_ref, rtol=0, atol=0)
        torch.testing.assert_close(ssm, ssm_ref, rtol=0, atol=0)
    assert _counters_zero()


def test_bench_rows_time_the_same_step():
    """`bench kernels --only gdn`'s rows with the conv1d (ops/gdn/triton_bench.CONV_IMPLS): the
    two kernels and the fused one compute the same step from the same inputs."""
    from deltaserve.ops.gdn.triton_bench import _conv_decode_fn

    dev, dtype = kernel_device(), torch.float16 if kernel_device().type == "cpu" else None
    dtype = dtype or torch.bfloat16
    hk, hv, d, batch = 2, 4, 16, 3
    outs = []
    for impl in ("conv+triton", "triton-fused-conv"):
        gen = torch.Generator(device=dev).manual_seed(5)
        fn, extra = _conv_decode_fn(impl, batch, hk, hv, d, dev, gen, dtype, 1)
        assert extra == batch * (2 * hk * d + hv * d) * 2 * 7  # columns + windows read, written
        ab = torch.randn(batch, 2 * hv, generator=gen.manual_seed(6)).to(dev, dtype)
        state = torch.zeros(batch + 1, hv, d, d, device=dev)
        slots = torch.arange(1, batch + 1, device=dev)
        A_log, dt_bias = torch.zeros(hv, device=dev), torch.zeros(hv, device=dev)
        outs.append(fn(None, None, None, ab[:, :hv], ab[:, hv:], A_log, dt_bias, state, slots))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_fused_only_for_all_decode_steps_of_one_token():
    """GDNKernels.fuses: on with both backends Triton's and asked for, and only for steps of
    decodes alone, one token each (not with prefill rows, drafts, or the reference backends)."""
    from meta_helpers import make_meta

    from deltaserve.ops.gdn import GDNKernels
    from deltaserve.ops.gdn.reference import TorchConv1d, TorchGDNDecode, TorchGDNPrefill
    from deltaserve.ops.gdn.triton_conv1d import TritonConv1d
    from deltaserve.ops.gdn.triton_decode import TritonGDNDecode

    triton = GDNKernels(TritonConv1d(), TorchGDNPrefill(), TritonGDNDecode(), fuse_decode=True)
    decodes = make_meta([1, 1, 1], [5, 9, 2], num_decodes=3)
    assert triton.fuses(decodes)
    assert not triton.fuses(make_meta([1, 1, 4], [5, 9, 0], num_decodes=2))  # a prefill row
    drafts = make_meta([3, 3], [5, 9], num_decodes=2, decode_query_len=3)  # verify rows
    assert not triton.fuses(drafts)
    off = GDNKernels(TritonConv1d(), TorchGDNPrefill(), TritonGDNDecode(), fuse_decode=False)
    torch_conv = GDNKernels(TorchConv1d(), TorchGDNPrefill(), TritonGDNDecode(), True)
    torch_decode = GDNKernels(TritonConv1d(), TorchGDNPrefill(), TorchGDNDecode(), True)
    assert not any(k.fuses(decodes) for k in (off, torch_conv, torch_decode))
