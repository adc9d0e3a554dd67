"""Programmatic dependent launch (deltaserve.ops.pdl): the switch and its environment variable;
compiled for sm_90 on CPU (Triton's NVIDIA backend, sm90_compile.py), the decode GEMM and the
RMSNorm wait for the previous kernel after issuing only their weight loads and before any store;
on the GPU (`pytest -m gpu`), a chain of PDL kernels in which each reads what the one before it
wrote (RMSNorm with its residual updated in place, the decode GEMMs split and unsplit, the MoE
decode path routing inside gate_up and summing in down) captured in a CUDA graph and replayed
with new inputs equals the same kernels run eagerly without PDL, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sm90_compile import compile_many, ptxas_path  # noqa: E402

from deltaserve import env  # noqa: E402
from deltaserve.ops import pdl  # noqa: E402


def test_env_values(monkeypatch):
    monkeypatch.delenv("DELTASERVE_PDL", raising=False)
    assert env.pdl() == "auto"
    for off in ("0", "off", " OFF "):
        monkeypatch.setenv("DELTASERVE_PDL", off)
        assert env.pdl() == "off"
    monkeypatch.setenv("DELTASERVE_PDL", "sometimes")
    with pytest.raises(ValueError, match="DELTASERVE_PDL"):
        env.pdl()


def test_off_on_cpu_and_under_the_interpreter(monkeypatch):
    assert pdl.launch_kwargs(torch.zeros(1)) == {"PDL": False}
    assert not pdl.enabled(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(torch.device("cuda", 0))  # decided before asking any device


def test_start_up_line_says_why(monkeypatch):
    cuda = torch.device("cuda", 0)
    assert pdl.describe(torch.device("cpu")) == "programmatic dependent launch: off (cpu device)"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.describe(cuda).endswith("off (Triton interpreter)")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("DELTASERVE_PDL", "0")
    assert pdl.describe(cuda).endswith("off (DELTASERVE_PDL=0)")
    monkeypatch.delenv("DELTASERVE_PDL")
    monkeypatch.setattr(pdl, "_capable", lambda index: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    assert pdl.describe(cuda).endswith("off (compute capability 8.0 < 9.0)")
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    assert pdl.describe(cuda).startswith("programmatic dependent launch: on")
    assert pdl.launch_kwargs(torch.zeros(1)) == {"PDL": False}  # a CPU tensor, whatever else


GEMM_SIG = {
    **{p: "*bf16" for p in ("x_ptr", "w_ptr", "b_ptr", "out_ptr")},
    **{i: "i32" for i in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om")},
    **{c: "constexpr" for c in ("HAS_BIAS", "INTERPRET", "PDL", "BLOCK_M", "BLOCK_N", "BLOCK_K")},
}
NORM_SIG = {
    **{p: "*bf16" for p in ("x_ptr", "res_ptr", "w_ptr", "out_ptr")},
    **{i: "i32" for i in ("num_rows", "H", "N", "stride_xt", "stride_xh", "stride_rt")},
    **{i: "i32" for i in ("stride_rh", "stride_ot", "stride_oh")},
    "eps": "fp32",
    **{c: "constexpr" for c in ("HAS_RESIDUAL", "ZERO_CENTERED", "BLOCK_R", "BLOCK_N", "PDL")},
}


def _jobs() -> list[dict]:
    jobs = []
    for on in (False, True):
        jobs.append(
            dict(
                kernel="deltaserve.ops.linear.triton_gemm:_decode_gemm_kernel",
                signature=GEMM_SIG,
                constexprs=dict(
                    HAS_BIAS=False, INTERPRET=False, PDL=on, BLOCK_M=16, BLOCK_N=16, BLOCK_K=256
                ),
                div16=["x_ptr", "w_ptr", "out_ptr", "K", "stride_xm", "stride_wn"],
                num_warps=4,
                num_stages=4,
            )
        )
        jobs.append(
            dict(
                kernel="deltaserve.ops.fused.rmsnorm:_rms_norm_kernel",
                signature=NORM_SIG,
                constexprs=dict(
                    HAS_RESIDUAL=True, ZERO_CENTERED=True, BLOCK_R=1, BLOCK_N=2048, PDL=on
                ),
                div16=["x_ptr", "res_ptr", "w_ptr", "out_ptr", "N", "stride_xt", "stride_rt"],
                num_warps=8,
                num_stages=1,
            )
        )
    return jobs


LATENT_SIG = {
    **{p: "*bf16" for p in ("c_kv_ptr", "k_pe_ptr", "cache_ptr")},
    "slot_mapping_ptr": "*i64",
    **{i: "i32" for i in ("stride_ct", "stride_pt", "stride_cb", "stride_cs")},
    **{c: "constexpr" for c in ("R", "P", "R_PAD", "P_PAD", "PAGE", "PDL")},
}
PREP_SIG = {
    **{p: "*bf16" for p in ("q_ptr", "qo_ptr", "kv_ptr", "lat_ptr", "w_ptr")},
    **{p: "*fp32" for p in ("cos_ptr", "sin_ptr")},
    **{i: "i32" for i in ("H", "stride_qt", "stride_qh", "stride_qot", "stride_qoh")},
    **{i: "i32" for i in ("stride_kv", "stride_lat", "stride_cos", "stride_sin")},
    "eps": "fp32",
    **{c: "constexpr" for c in ("R", "P", "BLOCK_H", "BLOCK_R", "BLOCK_P", "PDL")},
}


@pytest.mark.skipif(ptxas_path() is None, reason="this Triton has no NVIDIA backend / ptxas")
def test_mla_writer_and_prep_wait_first():
    """The MLA kernels no GPU run has launched with PDL yet (DeepSeek-V2's latent writer and
    rope + latent norm) compile with it, the wait before any load or store."""
    widths = dict(R=512, P=64)
    jobs = [
        dict(
            kernel="deltaserve.ops.mla.triton_writer:_store_latent_kernel",
            signature=LATENT_SIG,
            constexprs=dict(widths, R_PAD=512, P_PAD=64, PAGE=16, PDL=True),
            div16=["c_kv_ptr", "k_pe_ptr", "cache_ptr", "stride_ct", "stride_cb", "stride_cs"],
            num_warps=2,
            num_stages=1,
        ),
        dict(
            kernel="deltaserve.ops.fused.mla_prep:_mla_rope_norm_kernel",
            signature=PREP_SIG,
            constexprs=dict(widths, BLOCK_H=16, BLOCK_R=512, BLOCK_P=32, PDL=True),
            div16=["q_ptr", "qo_ptr", "kv_ptr", "lat_ptr", "w_ptr", "stride_qt", "stride_kv"],
            num_warps=1,
            num_stages=1,
        ),
    ]
    for c in compile_many(jobs):
        assert "error" not in c, c.get("error")
        assert c["pdl_wait"] and c["loads_before_wait"] == c["stores_before_wait"] == 0, c


@pytest.mark.skipif(ptxas_path() is None, reason="this Triton has no NVIDIA backend / ptxas")
def test_weights_before_the_wait_and_nothing_stored_before_it():
    gemm_off, norm_off, gemm_on, norm_on = compile_many(_jobs())
    for c in (gemm_off, norm_off, gemm_on, norm_on):
        assert "error" not in c, c.get("error")
        assert c["spill_bytes"] == 0
    assert not gemm_off["pdl_wait"] and not norm_off["pdl_wait"]
    for c in (gemm_on, norm_on):
        assert c["pdl_wait"]
        assert c["loads_before_wait"] > 0  # the first W tile / the norm weight
        assert c["stores_before_wait"] == 0
    assert gemm_off["async_copies"] > 0 and gemm_on["async_copies"] > 0  # still pipelined


def _chain(h, res, p):
    """norm (residual in place) -> GEMM to [router | 2 experts' worth] -> MoE decode (routing
    inside gate_up, top-k summed in down) -> split-K GEMM -> norm."""
    from deltaserve.ops.fused.activation import silu_and_mul
    from deltaserve.ops.fused.rmsnorm import rms_norm
    from deltaserve.ops.linear.triton_gemm import decode_gemm
    from deltaserve.ops.moe.triton_decode import RouteArgs, decode_experts

    n, res = rms_norm(h, p["norm"], 1e-6, zero_centered=True, residual=res)
    y = decode_gemm(n, p["w_in"])  # [1, E + 2 * 512]: one column tile per program
    logits = y[:, : p["E"]].contiguous()
    act = silu_and_mul(y[:, p["E"] :])
    ids = torch.empty(1, 8, dtype=torch.int32, device=h.device)
    weights = torch.empty(1, 8, dtype=h.dtype, device=h.device)
    moe = decode_experts(
        n, p["w13"], p["w2"], ids, weights, sum_tokens=True, route=RouteArgs(logits, True)
    )
    o = decode_gemm(act, p["w_o"], kernel="splitk")  # N = 2048: split K (not the default)
    out, res = rms_norm(moe + o, p["norm"], 1e-6, zero_centered=True, residual=res)
    return out, res, ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_graph_chain_equals_eager_without_pdl(monkeypatch):
    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0")
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, dt, H, E = "cuda", torch.bfloat16, 2048, 64

    def rand(*shape, scale=0.02):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dt)

    p = dict(
        E=E, norm=torch.randn(H, device=dev, generator=g).float() * 0.1,
        w_in=rand(E + 1024, H), w13=rand(E, 1024, H), w2=rand(E, H, 512), w_o=rand(H, 512),
    )  # fmt: skip
    h, res = rand(1, H, scale=1.0), rand(1, H, scale=1.0)
    steps = 6
    out = _chain(h, res.clone(), p)  # warm-up: compile and tune with PDL
    graph = torch.cuda.CUDAGraph()
    res_g = res.clone()
    with torch.cuda.graph(graph):
        h_g = h
        for _ in range(steps):  # each step's output feeds the next
            h_g, res_g, ids_g = _chain(h_g, res_g, p)
    for i in range(4):
        h.copy_(rand(1, H, scale=1.0 + i))
        res_in = rand(1, H, scale=1.0)
        res_g.copy_(res_in)
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setenv("DELTASERVE_PDL", "0")
        h_e, res_e = h.clone(), res_in.clone()
        for _ in range(steps):
            h_e, res_e, ids_e = _chain(h_e, res_e, p)
        monkeypatch.delenv("DELTASERVE_PDL")
        torch.cuda.synchronize()
        assert torch.equal(ids_g, ids_e)
        assert torch.equal(h_g, h_e), (h_g - h_e).abs().max()
        assert torch.equal(res_g, res_e)
    assert out[0].isfinite().all()


def _sources() -> list:
    """(path, parsed module) of every deltaserve source file."""
    import ast

    root = Path(__file__).resolve().parents[2] / "deltaserve"
    return [(path, ast.parse(path.read_text())) for path in sorted(root.rglob("*.py"))]


def _jit_functions(sources: list):
    """(path, FunctionDef) of every function decorated with triton.jit / autotune."""
    import ast

    for path, tree in sources:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list
            ):
                yield path, node


def test_every_kernel_with_a_pdl_flag_waits():
    """Every Triton function taking the `PDL` flag either calls `pdl.wait(PDL)` or hands the flag
    to a function that does (ops/pdl.py's rule: every program of a PDL-launched kernel waits
    for the previous kernel), and every launch of such a kernel passes pdl.launch_kwargs."""
    import ast

    sources = _sources()
    funcs = {node.name: node for _, node in _jit_functions(sources)}

    def waits(name: str, seen: set[str]) -> bool:
        node = funcs.get(name)
        if node is None or name in seen:
            return False
        seen.add(name)
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            text = ast.unparse(call)
            if text == "pdl.wait(PDL)":
                return True
            callee = ast.unparse(call.func).split(".")[-1]
            if "PDL" in [ast.unparse(a) for a in call.args] and waits(callee, seen):
                return True
        return False

    flagged = [n for n, f in funcs.items() if "PDL" in [a.arg for a in f.args.args]]
    flagged.remove("wait")  # ops/pdl.py's own
    assert len(flagged) >= 18, flagged  # the decode-path kernels of ops/pdl.py
    assert [n for n in flagged if not waits(n, set())] == []
    kernels = {n for n in flagged if n.endswith("_kernel")}
    for path, tree in sources:
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            func = call.func
            if isinstance(func, ast.Subscript) and ast.unparse(func.value) in kernels:
                passed = [ast.unparse(k.value) for k in call.keywords if k.arg is None]
                assert any(p.startswith("pdl.launch_kwargs(") for p in passed), (
                    f"{path.name}: {ast.unparse(func.value)} launched without pdl.launch_kwargs"
                )
