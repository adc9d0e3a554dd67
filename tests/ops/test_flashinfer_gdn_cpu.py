"""FlashInfer GDN decode backend without a GPU: its capability reasons, its place in the registry
and flags, and how our call maps onto FlashInfer's API (a stand-in `flashinfer.gdn_decode`
module records the call and computes the reference math on what it was given)."""

from __future__ import annotations

import gc
import sys
import types

import pytest
import torch

import deltaserve.backend_checks as backend_checks
from deltaserve.backend_checks import check_flashinfer_gdn, flashinfer_gdn_kernel_reason
from deltaserve.backends import OP_FAMILIES, BackendUnavailable, Capabilities, select
from deltaserve.cache.spec import GDNSpec
from deltaserve.ops.gdn.flashinfer_decode import (
    FlashInferGDNDecode,
    _Float32Params,
    flashinfer_gdn_decode,
)
from deltaserve.ops.gdn.reference import TorchGDNDecode

SPEC_128 = GDNSpec(16, 32, 128, 128, 4)  # Qwen3.5-9B's GDN layer


def _caps(monkeypatch, installed=("triton", "flashinfer"), *, dtype=torch.bfloat16,
          state=torch.float32, gdn=(SPEC_128,), cc=(9, 0), kernels=None):  # fmt: skip
    """A pretend CUDA device with `installed` packages; `kernels`: what the CuTe DSL probe
    answers (None: the kernels are there)."""
    monkeypatch.setattr(backend_checks, "package_installed", lambda name: name in installed)
    monkeypatch.setattr(Capabilities, "compute_capability", property(lambda self: cc))
    monkeypatch.setattr(backend_checks, "flashinfer_gdn_kernel_reason", lambda state: kernels)
    return Capabilities(torch.device("cuda"), dtype, state, 16, (), gdn)


def test_priority_is_triton_flashinfer_torch():
    assert OP_FAMILIES["gdn_decode"].backend_names == ("triton", "flashinfer", "torch")


def test_refused_on_cpu_and_when_not_installed(monkeypatch):
    cpu = Capabilities(torch.device("cpu"), torch.bfloat16, torch.float32, 16, (), (SPEC_128,))
    assert check_flashinfer_gdn(cpu) == "no CUDA device"
    with pytest.raises(BackendUnavailable, match="flashinfer.*no CUDA device"):
        select("gdn_decode", cpu, forced="flashinfer")
    caps = _caps(monkeypatch, installed=("triton",))
    assert dict(select("gdn_decode", caps).passed_over) == {}  # triton first, nothing passed
    with pytest.raises(BackendUnavailable, match="flashinfer not installed"):
        select("gdn_decode", caps, forced="flashinfer")


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(cc=(8, 0)), "compute capability 8.0 < 9.0"),
        (dict(dtype=torch.float32), "float32 activations unsupported (bfloat16 only"),
        (dict(dtype=torch.float16), "float16 activations unsupported (bfloat16 only"),
        (
            dict(gdn=(GDNSpec(2, 4, 64, 64, 4),)),
            "head dims K=64, V=64 unsupported (K = V = 128 only",
        ),
        (dict(gdn=(SPEC_128, GDNSpec(16, 32, 128, 256, 4))), "head dims K=128, V=256 unsupported"),
        (dict(state=torch.float16), "state dtype float16 unsupported (float32 or bfloat16)"),
        (dict(kernels="no CuTe DSL runtime (x)"), "no CuTe DSL runtime (x)"),
    ],
)
def test_each_refusal_has_its_reason(monkeypatch, kwargs, reason):
    caps = _caps(monkeypatch, installed=("flashinfer",), **kwargs)
    assert check_flashinfer_gdn(caps).startswith(reason)
    decision = select("gdn_decode", caps)
    assert decision.chosen.name == "torch"
    assert dict(decision.passed_over)["flashinfer"].startswith(reason)
    with pytest.raises(BackendUnavailable, match="cannot serve this model"):
        select("gdn_decode", caps, forced="flashinfer")


@pytest.mark.parametrize("state", [torch.float32, torch.bfloat16])
def test_able_when_everything_is_there(monkeypatch, state):
    caps = _caps(monkeypatch, state=state)
    assert check_flashinfer_gdn(caps) is None
    assert select("gdn_decode", caps).chosen.name == "triton"  # auto: by measured speed
    assert select("gdn_decode", caps, forced="flashinfer").chosen.name == "flashinfer"
    without_triton = _caps(monkeypatch, installed=("flashinfer",), state=state)
    decision = select("gdn_decode", without_triton)
    assert decision.chosen.name == "flashinfer"
    assert decision.passed_over == (("triton", "triton not installed"),)


def _fake_flashinfer(monkeypatch, **flags):
    """A stand-in `flashinfer` package whose gdn_decode module carries `flags`."""
    package = types.ModuleType("flashinfer")
    package.__path__ = []
    module = types.ModuleType("flashinfer.gdn_decode")
    for name, value in flags.items():
        setattr(module, name, value)
    package.gdn_decode = module
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.gdn_decode", module)
    return module


def test_kernel_probe_reasons(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert flashinfer_gdn_kernel_reason("float32").startswith(
        "flashinfer.gdn_decode failed to import (ModuleNotFoundError"
    )
    ready = dict(
        _PRETRANSPOSE_AVAILABLE=True, _MTP_AVAILABLE=True, _GDN_DECODE_BF16_STATE_AVAILABLE=True
    )
    _fake_flashinfer(monkeypatch, **ready)
    assert flashinfer_gdn_kernel_reason("float32") is None
    assert flashinfer_gdn_kernel_reason("bfloat16") is None
    _fake_flashinfer(monkeypatch, **dict(ready, _GDN_DECODE_BF16_STATE_AVAILABLE=False))
    monkeypatch.setitem(sys.modules, "flashinfer.gdn_kernels", None)
    assert flashinfer_gdn_kernel_reason("float32") is None
    reason = flashinfer_gdn_kernel_reason("bfloat16")
    assert reason.startswith("no CuTe DSL runtime (its GDN kernels failed to import: ")
    _fake_flashinfer(monkeypatch, _PRETRANSPOSE_AVAILABLE=True)  # no MTP kernel
    for name in ("flashinfer.gdn_kernels", "flashinfer.gdn_kernels.gdn_decode_pretranspose"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    assert flashinfer_gdn_kernel_reason("float32") == (
        "no CuTe DSL runtime (_PRETRANSPOSE_AVAILABLE, _MTP_AVAILABLE unset in "
        "flashinfer.gdn_decode)"
    )


def test_flag_and_config_accept_flashinfer():
    from deltaserve.cli import build_parser

    args = build_parser().parse_args(["generate", "--gdn-decode-backend", "flashinfer", "x"])
    assert args.gdn_decode_backend == "flashinfer"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--gdn-decode-backend", "flashinfr", "x"])


# --- the call mapping, against a stand-in kernel ------------------------------------------------


def _aligned_view(rows: int, *shape: int, gen: torch.Generator, pad: int = 16) -> torch.Tensor:
    """A random bf16 [rows, *shape] view inside wider rows (a split projection output), row and
    base offsets multiples of 32 bytes."""
    width = 1
    for s in shape:
        width *= s
    base = torch.randn(rows, width + 2 * pad, generator=gen).to(torch.bfloat16)
    return base[:, pad : pad + width].unflatten(1, shape)


def _reference_kernel(calls: list):
    """A stand-in for gated_delta_rule_decode_pretranspose: records its arguments and computes
    our reference math on them, in place, into `output` (as the real one does)."""

    def kernel(q, k, v, state, A_log, a, dt_bias, b, scale=None, output=None, use_qk_l2norm=True,
               initial_state=None, initial_state_indices=None, backend="auto"):  # fmt: skip
        calls.append(dict(q=q, a=a, state=state, A_log=A_log, scale=scale, output=output,
                          l2=use_qk_l2norm, pool=initial_state, idx=initial_state_indices,
                          backend=backend))  # fmt: skip
        n, t = q.shape[:2]
        flat = [x.flatten(0, 1) for x in (q, k, v, a, b)]  # [N, T, ...] -> [N * T, ...]
        o = TorchGDNDecode().forward(
            *flat, A_log, dt_bias, initial_state, initial_state_indices.long(), t
        )
        output.copy_(o.unflatten(0, (n, t)))
        return output, initial_state

    return kernel


@pytest.mark.parametrize("query_len", [1, 3])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_call_mapping_matches_reference(monkeypatch, query_len, state_dtype):
    calls: list = []
    module = _fake_flashinfer(monkeypatch)
    module.gated_delta_rule_decode_pretranspose = _reference_kernel(calls)
    gen = torch.Generator().manual_seed(query_len)
    n, hk, hv, d = 5, 2, 4, 128
    rows = n * query_len
    q, k = (_aligned_view(rows, hk, d, gen=gen) for _ in range(2))
    v = _aligned_view(rows, hv, d, gen=gen)
    a, b = (_aligned_view(rows, hv, gen=gen) for _ in range(2))
    A_log = torch.empty(hv).uniform_(1, 16, generator=gen).log().to(torch.bfloat16)
    dt_bias = torch.randn(hv, generator=gen).to(torch.bfloat16)
    pool = (0.3 * torch.randn(9, hv, d, d, generator=gen)).to(state_dtype)
    slots = torch.tensor([3, 7, 1, 0, 0])  # two padding rows on the null slot
    want_pool = pool.clone()
    backend = FlashInferGDNDecode()
    out = backend.forward(q, k, v, a, b, A_log, dt_bias, pool, slots, query_len)
    want = TorchGDNDecode().forward(q, k, v, a, b, A_log, dt_bias, want_pool, slots, query_len)
    (call,) = calls
    assert call["q"].shape == (n, query_len, hk, d) and call["a"].shape == (n, query_len, hv)
    assert call["state"] is None and call["pool"] is pool  # the pool itself, in place
    assert call["idx"].dtype == torch.int32 and call["idx"].tolist() == slots.tolist()
    assert call["A_log"].dtype == torch.float32 and call["scale"] == d**-0.5
    assert call["l2"] is True and call["backend"] == "flashinfer"
    assert call["output"].shape == (n, query_len, hv, d) and call["output"].dtype == torch.bfloat16
    assert out.shape == (rows, hv, d) and out.data_ptr() == call["output"].data_ptr()
    real = slice(0, 3 * query_len)
    assert torch.equal(out[real], want[real])
    assert torch.equal(pool[[3, 7, 1]], want_pool[[3, 7, 1]])
    # the float32 copy of A_log is made once per parameter
    backend.forward(q, k, v, a, b, A_log, dt_bias, pool, slots, query_len)
    assert calls[1]["A_log"] is call["A_log"]


def test_bad_input_is_named(monkeypatch):
    _fake_flashinfer(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    q = _aligned_view(2, 1, 128, gen=gen)
    v = _aligned_view(2, 2, 128, gen=gen)
    a = _aligned_view(2, 2, gen=gen)
    A_log, dt_bias = torch.zeros(2), torch.zeros(2)
    pool = torch.zeros(3, 2, 128, 128)
    slots = torch.tensor([1, 2])
    args = (A_log, dt_bias, pool, slots)
    with pytest.raises(ValueError, match="3 rows != 2 sequences x 1"):
        flashinfer_gdn_decode(q[:1].expand(3, 1, 128), q, v, a, a, *args)
    with pytest.raises(ValueError, match="v is torch.float32 \\(needs bfloat16\\)"):
        flashinfer_gdn_decode(q, q, v.float(), a, a, *args)
    with pytest.raises(ValueError, match="state dtype torch.float16"):
        flashinfer_gdn_decode(q, q, v, a, a, A_log, dt_bias, pool.half(), slots)
    with pytest.raises(ValueError, match="K=64"):
        flashinfer_gdn_decode(q[..., :64], q[..., :64], v, a, a, *args)
    misaligned = torch.zeros(2, 1, 129, dtype=torch.bfloat16)[..., 1:]
    with pytest.raises(ValueError, match="q is not 32-byte aligned"):
        flashinfer_gdn_decode(misaligned, q, v, a, a, *args)
    with pytest.raises(ValueError, match="unit last stride"):
        flashinfer_gdn_decode(q, q, v.transpose(1, 2).contiguous().transpose(1, 2), a, a, *args)


def test_float32_params_copy_tracks_the_parameter():
    copies = _Float32Params()
    p = torch.nn.Parameter(torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    first = copies(p)
    assert first.dtype == torch.float32 and torch.equal(first, p.float())
    assert copies(p) is first
    with torch.no_grad():
        p.mul_(2)  # an in-place update (weights reloaded) bumps the version
    second = copies(p)
    assert second is not first and torch.equal(second, p.float())
    f32 = torch.ones(2)
    assert copies(f32) is f32
    key = id(p)
    del p
    gc.collect()
    other = torch.tensor([3.0, 4.0], dtype=torch.bfloat16)
    if id(other) == key:  # same address reused: the dead entry must not be returned
        assert torch.equal(copies(other), other.float())
    assert torch.equal(copies(other), other.float())
