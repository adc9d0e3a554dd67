"""The fused residual add + RMSNorm + decode GEMM (ops/linear/triton_norm_gemm.py) against the
two kernels it replaces (`rms_norm(..., residual=)` then `decode_gemm_base`: bit for bit) and
against its float32 torch reference (relative error); its argument checks; compiled for sm_90
on CPU (Triton's NVIDIA backend and bundled ptxas, sm90_compile.py) with the JIT's own
specialisation of real launches: no spills, the PDL wait before any store with only the first W
tile loaded before it, and the sum of squares reduced in the same layout (so the same order) as
the rms_norm kernel's; on the GPU (`pytest -m gpu`), the same equalities at Qwen3.5 shapes,
eagerly and in a replayed CUDA graph.

On CPU the interpreter rounds float32 -> bfloat16 by truncation and its bf16 `tl.dot` is not a
float product, so bf16 is compared only with the two-kernel path (same interpreter, same
roundings) there; fp16 with the reference too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_helpers import kernel_device, requires_triton  # noqa: E402
from sm90_compile import STAND_IN_DRIVER, ptxas_path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EPS = 1e-6
ON_GPU = torch.cuda.is_available()


def _inputs(M, K, N, dtype, bias, zero_centered, strided, seed, device, norm_fp32=False):
    """x [M, K], residual [M, K] (a column slice of a wider tensor when `strided`), the norm's
    weight [K] (around 0 when zero-centred, else around 1), W [N, K], bias [N]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    wide = torch.randn(M, K + 9, generator=g).to(dtype).to(device)
    residual = wide[:, 5 : 5 + K] if strided else wide[:, :K].contiguous()  # row stride K + 9
    nw = torch.randn(K, generator=g) * 0.5 + (0.0 if zero_centered else 1.0)
    nw = nw.to(torch.float32 if norm_fp32 else dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    b = b.to(device) if b is not None else None
    return x.to(device), residual, nw.to(device), w.to(device), b


def _two_kernels(x, residual, nw, w, b, zero_centered):
    """What the engine runs today: the add + norm kernel, then the base decode GEMM."""
    from deltaserve.ops.fused.rmsnorm import rms_norm
    from deltaserve.ops.linear.triton_gemm import decode_gemm_base

    h, residual = rms_norm(x, nw, EPS, zero_centered, residual=residual)
    return decode_gemm_base(h, w, b)


def _check(M, K, N, dtype, bias, zero_centered, strided, device, norm_fp32=False):
    from deltaserve.ops.linear.triton_norm_gemm import (
        add_rms_norm_gemm,
        add_rms_norm_gemm_reference,
    )
    from deltaserve.ops.tile_counters import arrival_counters

    seed = M * 1000 + K + N + 7 * bias + 3 * zero_centered
    x, res, nw, w, b = _inputs(
        M, K, N, dtype, bias, zero_centered, strided, seed, device, norm_fp32
    )
    x_in, res_in = x.clone(), res.clone()
    res_two = res.clone()
    want = _two_kernels(x, res_two, nw, w, b, zero_centered)
    got = add_rms_norm_gemm(x, res, nw, EPS, w, b, zero_centered)
    assert got.shape == (M, N) and got.dtype == dtype
    assert torch.equal(x, x_in)
    assert torch.equal(res, res_two), "residual not updated as rms_norm updates it"
    assert torch.equal(got, want), f"max |fused - two kernels| {(got - want).abs().max()}"
    assert arrival_counters("norm_gemm", w, 1).item() == 0
    if ON_GPU or dtype != torch.bfloat16:  # (the interpreter's bf16: module docstring)
        out_ref, r_ref = add_rms_norm_gemm_reference(x_in, res_in, nw, EPS, w, b, zero_centered)
        assert torch.equal(res, r_ref)
        err = (got.float() - out_ref.float()).abs().max().item()
        assert err <= 1e-2 * (out_ref.float().abs().max().item() + 1e-6), err
    return got


@requires_triton
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("zero_centered", [False, True], ids=["plain", "zero_centered"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_equals_norm_then_gemm(M, dtype, zero_centered, bias):
    """K = 200 (not a multiple of BLOCK_K), N = 77 (odd, a partial column tile); the residual
    a column slice (row stride K + 9) from 3 rows."""
    _check(M, 200, 77, dtype, bias, zero_centered, strided=M > 1, device=kernel_device())


@requires_triton
def test_float32_norm_weight_and_more_rows_per_norm_tile():
    """A float32 zero-centred weight (rms_norm takes one); K = 40: rms_norm's tiles hold 16
    rows (NORM_R = 16), K = 600: 2 rows per tile, the last tile half empty at M = 3."""
    dev = kernel_device()
    _check(16, 40, 21, torch.float16, True, True, strided=True, device=dev, norm_fp32=True)
    _check(3, 600, 33, torch.float16, False, True, strided=False, device=dev, norm_fp32=True)


@requires_triton
def test_repeated_calls_reuse_the_counter():
    """The arrival counter is back at 0 after each call: a second call with the same weight
    writes the residual again (x + (x + residual))."""
    from deltaserve.ops.linear.triton_norm_gemm import add_rms_norm_gemm

    x, res, nw, w, _ = _inputs(2, 96, 40, torch.float16, False, False, False, 5, kernel_device())
    want = ((x.float() + res.float()).half().float() + x.float()).half()
    add_rms_norm_gemm(x, res, nw, EPS, w)
    add_rms_norm_gemm(x, res, nw, EPS, w)
    assert torch.equal(res, want)


@requires_triton
def test_rejects_bad_inputs():
    from deltaserve.ops.linear.triton_norm_gemm import add_rms_norm_gemm

    dev, dt = kernel_device(), torch.float16
    x, res, nw, w, b = _inputs(2, 32, 8, dt, True, False, False, 1, dev)

    def bad(name, **over):
        args = dict(x=x, residual=res, norm_weight=nw, eps=EPS, weight=w, bias=b) | over
        with pytest.raises(ValueError, match=f"^{name}"):
            add_rms_norm_gemm(**args)

    bad("x", x=torch.zeros(17, 32, dtype=dt, device=dev), residual=torch.zeros(17, 32, dtype=dt))
    bad("x", x=x.float(), residual=res.float())
    bad("x", x=torch.zeros(32, 2, dtype=dt, device=dev).T)
    bad("residual", residual=res[:1])
    bad("residual", residual=res.to(torch.bfloat16))
    bad("norm_weight", norm_weight=nw[:31])
    bad("norm_weight", norm_weight=nw.to(torch.bfloat16))
    bad("weight", weight=w[:, :31])
    bad("weight", weight=w.to(torch.bfloat16))
    bad("bias", bias=b[:7])
    bad("bias", bias=b.float())


# ---- compiled for sm_90 on CPU: the launches' own specialisation (kernel.warmup) ----

COMPILE_SCRIPT = STAND_IN_DRIVER + textwrap.dedent(
    """
    import json
    import sys

    from sm90_compile import inspect_sm90
    from dataclasses import asdict

    from deltaserve.ops import pdl
    from deltaserve.ops.fused import rmsnorm
    from deltaserve.ops.linear import triton_norm_gemm as ng

    CASES = json.loads(sys.argv[1])
    PDL = {"PDL": True, "launch_pdl": True}
    results = []


    def compiled(c):
        return asdict(inspect_sm90(c.asm["ptx"], c.asm["ttgir"]))


    class Launch:  # kernel[grid](...) compiles (warmup) instead of launching
        def __init__(self, kernel, configs):
            self.kernel, self.configs = kernel, configs

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                for cfg in self.configs(kwargs):
                    meta = cfg.all_kwargs() if cfg is not None else {}
                    g = grid(meta) if callable(grid) else grid
                    try:
                        c = self.kernel.warmup(*args, grid=g, **kwargs, **meta)
                        out = compiled(c)
                    except Exception as e:  # reported to the test
                        out = {"error": f"{type(e).__name__}: {e}"}
                    results[-1].append(dict(out, config=str(cfg), meta=str(meta)))
            return launch


    fused = ng._add_rms_norm_gemm_kernel
    ng._add_rms_norm_gemm_kernel = Launch(
        fused.fn, lambda kw: ng._at_norm_warps(fused.configs, {}, **kw)
    )
    rmsnorm._rms_norm_kernel = Launch(rmsnorm._rms_norm_kernel, lambda kw: [None])
    for m, k, n, zc, bias, offset, on in CASES:
        pdl.launch_kwargs = lambda t: PDL if on else {"PDL": False}
        x = torch.zeros(m, k, dtype=torch.bfloat16)
        res = torch.zeros(m, k + 16, dtype=torch.bfloat16)[:, offset : offset + k]
        nw = torch.zeros(k, dtype=torch.float32 if zc else torch.bfloat16)
        w = torch.zeros(n, k, dtype=torch.bfloat16)
        b = torch.zeros(n, dtype=torch.bfloat16) if bias else None
        results.append([])
        rmsnorm.rms_norm(x, nw, 1e-6, zc, residual=res)
        ng.add_rms_norm_gemm(x, res, nw, 1e-6, w, b, zc)
    print(json.dumps(results))
    """
)

# (M, K, N, zero_centered, bias, residual column offset, PDL): Qwen3.5-9B's GDN in_proj at
# batch 1 and 16 (8 warps), Qwen3.5-35B-A3B's qkv (4 warps), a hidden size of 5120 (16 warps),
# a residual 3 elements off alignment, the small sizes of the CPU tests (1 and 2 warps; one
# without PDL). Every configuration tuned at the case's warp count is compiled.
CASES = [
    (1, 4096, 12352, True, False, 0, True),
    (16, 4096, 12352, True, True, 0, True),
    (16, 2048, 9216, True, True, 0, True),
    (16, 5120, 10240, False, False, 0, True),
    (16, 4096, 12352, False, True, 3, True),
    (1, 200, 77, True, False, 0, True),
    (16, 40, 21, True, False, 0, True),
    (3, 200, 77, False, True, 0, False),
]


@pytest.fixture(scope="module")
def sm90(tmp_path_factory) -> list:
    """Per case: [the rms_norm kernel, then the fused kernel at each configuration tuned]."""
    tmp = tmp_path_factory.mktemp("norm_gemm_sm90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(REPO), str(Path(__file__).resolve().parent)]
    env |= {"TRITON_CACHE_DIR": str(tmp / "triton"), "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT, json.dumps(CASES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(ptxas_path() is None, reason="this Triton has no NVIDIA backend / ptxas")
@pytest.mark.parametrize("case", range(len(CASES)))
def test_sm90_no_spills_pdl_order_and_rms_norms_reduction(sm90, case):
    from deltaserve.ops.fused._common import row_tile

    m, k, n, zc, bias, offset, on = CASES[case]
    norm, *fused = sm90[case]
    assert "error" not in norm, norm["error"]
    assert len(fused) >= 3, fused  # every configuration at rms_norm's warp count
    norm_r, norm_n, warps = row_tile(m, k)
    # the rms_norm kernel's sum of squares: one reduce of its [NORM_R, NORM_N] tile
    [tile] = [r for r in norm["reduce_operands"] if r[0] == f"{norm_r}x{norm_n}xf32"]
    for c in fused:
        assert "error" not in c, c["error"]
        assert f"'num_warps': {warps}" in c["meta"], c["meta"]
        assert c["spill_bytes"] == 0, c
        if k % 16 == 0:  # the W stream pipelined through shared memory (16-byte copies)
            assert c["async_copies"] > 0, c
        # the same tile in the same layout: its elements added in the same order
        assert tile in c["reduce_operands"], (tile, c["reduce_operands"])
        assert c["pdl_wait"] == on
        if on:
            assert c["stores_before_wait"] == 0, c
            # the first W tile only: BLOCK_N x BLOCK_K bf16 over the threads, in 16-byte
            # vectors where K is a multiple of 16 (else the mask k < K is unaligned: 1 each)
            meta = c["meta"]
            block_n = int(meta.split("'BLOCK_N': ")[1].split(",")[0])
            block_k = int(meta.split("'BLOCK_K': ")[1].split(",")[0])
            vec = 8 if k % 16 == 0 else 1
            w_loads = max(1, block_n * block_k // (vec * 32 * warps))
            assert c["loads_before_wait"] == w_loads, c


# ---- on the GPU ----

GPU_SHAPES = [(12352, 4096), (10240, 4096), (9216, 2048), (1281, 2048), (24576, 4096)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("N,K", GPU_SHAPES)
@pytest.mark.parametrize("zero_centered", [True, False], ids=["zero_centered", "plain"])
def test_gpu_equals_norm_then_gemm_at_model_shapes(M, N, K, zero_centered):
    """Bit for bit on the GPU too: the same rstd (rms_norm's reduction tile, warps and layout),
    the same rounded h, the same tensor-core accumulation chain over K."""
    for dtype in (torch.bfloat16, torch.float16):
        _check(M, K, N, dtype, N == 1281, zero_centered, strided=M == 5, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_gpu_graph_replay_equals_eager():
    """Captured in a CUDA graph (with PDL where on) and replayed on new inputs, the fused op
    gives the eager two-kernel path's output and residual, several calls chained."""
    from deltaserve.ops.linear.triton_norm_gemm import add_rms_norm_gemm

    M, K, N = 1, 4096, 12352
    x, res, nw, w, _ = _inputs(M, K, N, torch.bfloat16, False, True, False, 0, "cuda")
    w2 = (torch.randn(K, N, device="cuda") / N**0.5).to(torch.bfloat16)  # back to K columns

    def chain(x, res, fused):
        for _ in range(3):
            h = (
                add_rms_norm_gemm(x, res, nw, EPS, w, None, True)
                if fused
                else _two_kernels(x, res, nw, w, None, True)
            )
            x = h @ w2.T  # [M, K]: the next layer's input
        return x

    chain(x, res.clone(), True)  # compile and tune outside the graph
    graph = torch.cuda.CUDAGraph()
    x_g, res_g = x.clone(), res.clone()
    with torch.cuda.graph(graph):
        out_g = chain(x_g, res_g, True)
    for i in range(3):
        x_in = torch.randn(M, K, device="cuda").to(torch.bfloat16) * (1 + i)
        r_in = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        x_g.copy_(x_in)
        res_g.copy_(r_in)
        graph.replay()
        r_e = r_in.clone()
        out_e = chain(x_in, r_e, False)
        torch.cuda.synchronize()
        assert torch.equal(res_g, r_e)
        assert torch.equal(out_g, out_e), (out_g - out_e).abs().max()
