"""The Triton MLA kernels compile for sm_90 at DeepSeek-V2's widths (R 512, P 64, bf16) in
their default configurations without register spills, the latent loads pipelined through
shared memory (on CPU: Triton's NVIDIA backend and bundled ptxas, see sm90_compile.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sm90_compile import compile_many, ptxas_path  # noqa: E402

pytestmark = pytest.mark.skipif(
    ptxas_path() is None, reason="this Triton has no NVIDIA backend / ptxas"
)

STRIDES = ["stride_qt", "stride_qh", "stride_pt", "stride_ph", "stride_cb", "stride_cs"]
STRIDES += ["stride_bt", "stride_ot", "stride_oh"]
COMMON = {
    **{p: "*bf16" for p in ("q_lat_ptr", "q_pe_ptr", "cache_ptr", "out_ptr")},
    "block_tables_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "qk_scale": "fp32",
    **dict.fromkeys(STRIDES, "i32"),
}
DIV16 = ["q_lat_ptr", "q_pe_ptr", "cache_ptr", "block_tables_ptr", "out_ptr", *STRIDES]
WIDTHS = dict(R=512, R_PAD=512, P=64, P_PAD=64, PAGE=16, UPCAST=False, PRECISION="tf32")


def _split(cfg: dict) -> tuple[dict, dict]:
    """(constexprs, launch options) of a config dict."""
    opts = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
    return cfg, opts


DECODE_SIG = {
    **COMMON,
    "part_out_ptr": "*fp32",
    "part_lse_ptr": "*fp32",
    **dict(c_new_ptr="*bf16", pe_new_ptr="*bf16", slots_ptr="*i64"),
    **dict(stride_nc="i32", stride_np="i32"),
    **dict.fromkeys(("H", "R", "R_PAD", "P", "P_PAD", "PAGE", "BLOCK_H", "BLOCK_N"), "constexpr"),
    **dict.fromkeys(("NUM_SPLITS", "UPCAST", "PRECISION", "INTERPRET", "QLEN"), "constexpr"),
    **dict.fromkeys(("QLEN_PAD", "NEW", "PDL", "R_CHUNKS"), "constexpr"),
}


def _decode_job(
    triton_decode,  # noqa: ANN001 (the module, its `interpreting` patched by the caller)
    heads: int,
    qlen: int,
    new: bool,
    overrides: dict | None = None,
) -> dict:
    """The split decode's compile job at B 64 (256 blocks of 16): `decode_config`'s choice
    with `overrides`, at least 4 splits (the partials' path, the one B 64 runs), programmatic
    dependent launch at one query token (ops/pdl.py), as decode runs it."""
    cfg = triton_decode.decode_config(
        64, heads, 512, 256, 16, torch.bfloat16, torch.device("cpu"), qlen, overrides
    )
    opts = {k: cfg.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in cfg}
    consts = {**cfg, **WIDTHS, "H": heads, "INTERPRET": False, "QLEN": qlen}
    consts.update(QLEN_PAD=1 << (qlen - 1).bit_length(), NEW=new, PDL=qlen == 1)
    consts["NUM_SPLITS"] = max(cfg["NUM_SPLITS"], 4)
    return dict(
        kernel="deltaserve.ops.mla.triton_decode:_mla_decode_split_kernel",
        signature=DECODE_SIG,
        constexprs=consts,
        div16=[*DIV16, "c_new_ptr", "pe_new_ptr", "stride_nc", "stride_np"],
        **opts,
    )


def test_default_configs_compile_without_spills(monkeypatch):
    from deltaserve.ops.mla import triton_decode, triton_prefill

    monkeypatch.setattr(triton_decode, "interpreting", lambda: False)
    monkeypatch.setattr(triton_prefill, "interpreting", lambda: False)
    jobs, names = [], []
    # NEW: the decode writes the step's latents itself (the all-decode default); without it as
    # mixed steps run it
    for heads, qlen, new in ((16, 1, True), (128, 1, True), (16, 3, True), (128, 2, True),
                             (16, 1, False)):  # fmt: skip
        job = _decode_job(triton_decode, heads, qlen, new)
        jobs.append(job)
        names.append(f"decode H={heads} q={qlen} new={new} {job['constexprs']}")
    pre_sig = {**COMMON, "query_start_loc_ptr": "*i32", "num_seqs": "i32"}
    for name in ("H", "R", "R_PAD", "P", "P_PAD", "PAGE", "BLOCK_M", "BLOCK_N"):
        pre_sig[name] = "constexpr"
    for name in ("UPCAST", "PRECISION", "INTERPRET"):
        pre_sig[name] = "constexpr"
    for heads in (16, 128):
        consts, opts = _split(triton_prefill.prefill_config(512, torch.bfloat16))
        consts = {**consts, **WIDTHS, "H": heads, "INTERPRET": False}
        jobs.append(
            dict(
                kernel="deltaserve.ops.mla.triton_prefill:_mla_prefill_kernel",
                signature=pre_sig,
                constexprs=consts,
                div16=DIV16,
                **opts,
            )  # fmt: skip
        )
        names.append(f"prefill H={heads}")
    for name, res in zip(names, compile_many(jobs), strict=True):
        assert "error" not in res, (name, res)
        # 64 query rows a program (H 128): a few bytes of spill at 255 registers (the test
        # below); nothing else may spill
        allowed = 128 if "'BLOCK_H': 64" in name else 0
        assert res["spill_bytes"] <= allowed, (name, res)
        assert res["async_copies"] > 0, (name, res)  # latent loads pipelined
        if name.startswith("decode"):
            assert res["pdl_wait"] == (" q=1 " in name), (name, res)
        if res["pdl_wait"]:  # the wait first: nothing loaded or stored before it
            assert res["loads_before_wait"] == res["stores_before_wait"] == 0, (name, res)


def test_chunked_decode_fits_its_register_cap(monkeypatch):
    """The column-chunked decode (R_CHUNKS > 1) compiles for sm_90 without spills: the H 16
    default (64 latents a tile, no register cap) in at most 168 registers a thread (145 when
    measured: three 4-warp programs an SM by registers) with and without the latent store
    (all-decode and mixed steps), and the variants `bench kernels --only mla` times around it
    as the bench runs them (without the store) within their caps, their loads pipelined."""
    from deltaserve.bench.mla_kernels import TRITON_VARIANTS
    from deltaserve.ops.mla import triton_decode

    monkeypatch.setattr(triton_decode, "interpreting", lambda: False)

    def resolved(variant: dict) -> dict:
        return triton_decode.decode_config(
            64, 16, 512, 256, 16, torch.bfloat16, torch.device("cpu"), 1, dict(variant)
        )

    default = resolved({})
    assert default["R_CHUNKS"] == 8 and default["BLOCK_N"] == 64 and "maxnreg" not in default
    cases = [({}, True), ({}, False)]
    cases += [(v, False) for v in TRITON_VARIANTS if v and resolved(v)["R_CHUNKS"] > 1]
    assert len(cases) >= 6
    jobs = [_decode_job(triton_decode, 16, 1, new, dict(v)) for v, new in cases]
    for (variant, new), res in zip(cases, compile_many(jobs), strict=True):
        name = f"{variant} new={new}"
        assert "error" not in res, (name, res)
        assert res["spill_bytes"] == 0, (name, res)
        assert res["registers"] <= resolved(variant).get("maxnreg", 168), (name, res)
        assert res["async_copies"] > 0, (name, res)


def test_chunked_decode_at_128_heads_spills_at_most_a_few_bytes(monkeypatch):
    """At H 128 (64 query rows a program, 8 warps) the default reads the latents in 8 column
    chunks without a register cap, at 255 registers: where the whole tile spilled ~500 bytes,
    it spills at most 128 (20 bytes without the step's latent store, about 60 with it), and so
    do 4 chunks. The bench times it as compiled here."""
    from deltaserve.ops.mla import triton_decode

    monkeypatch.setattr(triton_decode, "interpreting", lambda: False)
    cfg = triton_decode.decode_config(
        64, 128, 512, 256, 16, torch.bfloat16, torch.device("cpu"), 1, None
    )
    assert cfg["BLOCK_H"] == 64 and cfg["R_CHUNKS"] == 8 and "maxnreg" not in cfg
    variants = [{}, {"R_CHUNKS": 4}]
    jobs = [_decode_job(triton_decode, 128, 1, False, dict(v)) for v in variants]
    for variant, res in zip(variants, compile_many(jobs), strict=True):
        assert "error" not in res, (variant, res)
        assert res["spill_bytes"] <= 128, (variant, res)
        assert res["async_copies"] > 0, (variant, res)


HEAD_MATMUL_SIG = {
    **{p: "*bf16" for p in ("x_ptr", "w_ptr", "out_ptr")},
    **{i: "i32" for i in ("T", "stride_xt", "stride_xh", "stride_wh", "stride_wk")},
    **{i: "i32" for i in ("stride_ot", "stride_oh")},
    **{c: "constexpr" for c in ("K", "N", "K_PAD", "T_PAD", "PRECISION", "PDL")},
    **{c: "constexpr" for c in ("BLOCK_K", "BLOCK_N")},
}


HEAD_MATMUL_DIV16 = ["x_ptr", "w_ptr", "out_ptr", "stride_wh", "stride_wk"]


def _tuned_job(kernel: str, signature: dict, consts: dict, div16: list, cfg) -> dict:  # noqa: ANN001
    """A compile job for deltaserve.ops.mla's `kernel` ("module:name") in the tuner
    configuration `cfg` (its warps and stages)."""
    return dict(
        kernel=f"deltaserve.ops.mla.{kernel}", signature=signature, constexprs=consts,
        div16=div16, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _assert_clean_pdl_compiles(jobs: list[dict]) -> None:
    """Every job compiles for sm_90 without spills, loads before its PDL wait and stores
    nothing before it."""
    for job, res in zip(jobs, compile_many(jobs)):
        assert "error" not in res, (job["constexprs"], res.get("error"))
        assert res["spill_bytes"] == 0, (job["constexprs"], job["num_warps"])
        assert res["pdl_wait"] and res["loads_before_wait"] > 0
        assert res["stores_before_wait"] == 0


@pytest.mark.parametrize("k,n", [(128, 512), (512, 128)])
def test_head_matmul_configs_compile_without_spills(k, n, monkeypatch):
    """Every configuration the per-head matmul's tuner keeps at V2's W_UK and W_UV widths, at
    16, 32 and 64 padded rows, with PDL: no spills, W's loads before the wait and no store
    before it."""
    from deltaserve.ops.mla import triton_head_matmul

    monkeypatch.setattr(triton_head_matmul, "interpreting", lambda: False)
    everything = triton_head_matmul._configs()
    jobs = []
    for t_pad in (16, 32, 64):
        configs = triton_head_matmul._prune_tiles(everything, {}, K_PAD=k, T_PAD=t_pad)
        assert configs
        for cfg in configs:
            consts = dict(
                K=k, N=n, K_PAD=k, T_PAD=t_pad, PRECISION="tf32", PDL=True, BLOCK_K=k, **cfg.kwargs
            )
            jobs.append(_tuned_job("triton_head_matmul:_head_matmul_kernel", HEAD_MATMUL_SIG,
                                   consts, HEAD_MATMUL_DIV16, cfg))  # fmt: skip
    _assert_clean_pdl_compiles(jobs)


PREP_SIG = {
    **HEAD_MATMUL_SIG,
    **{p: "*bf16" for p in ("q_ptr", "qo_ptr", "kv_ptr", "lat_ptr", "nw_ptr")},
    **{p: "*fp32" for p in ("cos_ptr", "sin_ptr")},
    **{i: "i32" for i in ("H", "stride_qt", "stride_qh", "stride_qot", "stride_qoh")},
    **{i: "i32" for i in ("stride_kv", "stride_lat", "stride_cos", "stride_sin")},
    "eps": "fp32",
    **{c: "constexpr" for c in ("R", "P", "BLOCK_H", "BLOCK_R", "BLOCK_P")},
}


@pytest.mark.parametrize("heads", [16, 128])
def test_prep_kernel_configs_compile_without_spills(heads, monkeypatch):
    """The step preparation in one launch (rope / latent norm + W_UK, triton_head_matmul
    `_prep_kernel`) in every configuration its tuner keeps at V2's widths (nope 128, R 512, rope
    64), 16 and 64 padded rows, with PDL: no spills, W_UK's first step loaded before the wait,
    nothing stored before it."""
    from deltaserve.ops.mla import triton_head_matmul

    monkeypatch.setattr(triton_head_matmul, "interpreting", lambda: False)
    everything = triton_head_matmul._configs()
    jobs = []
    for t_pad in (16, 64):
        for cfg in triton_head_matmul._prune_tiles(everything, {}, K_PAD=128, T_PAD=t_pad):
            consts = dict(
                K=128, N=512, K_PAD=128, T_PAD=t_pad, PRECISION="tf32", PDL=True, BLOCK_K=128,
                R=512, P=64, BLOCK_H=heads, BLOCK_R=512, BLOCK_P=64, **cfg.kwargs,
            )  # fmt: skip
            jobs.append(_tuned_job("triton_head_matmul:_prep_kernel", PREP_SIG, consts,
                                   HEAD_MATMUL_DIV16, cfg))  # fmt: skip
    assert jobs
    _assert_clean_pdl_compiles(jobs)


MERGE_SIG = {
    **{p: "*fp32" for p in ("part_out_ptr", "part_lse_ptr")},
    **{p: "*bf16" for p in ("w_ptr", "out_ptr")},
    **{i: "i32" for i in ("rows", "H", "stride_wh", "stride_wk", "stride_ot", "stride_oh")},
    **{c: "constexpr" for c in ("R", "R_PAD", "V", "NUM_SPLITS", "S_PAD", "STEP", "PDL")},
    "BLOCK_N": "constexpr",
}


@pytest.mark.parametrize("splits", [2, 32])
def test_merge_w_uv_configs_compile_without_spills(splits, monkeypatch):
    """The split merge joined to W_UV (triton_merge_out.py) in every configuration of its tuner
    at V2's widths (R 512, V 128), with PDL: no spills, W_UV's tile loaded before the wait and
    nothing stored before it."""
    from deltaserve.ops.mla import triton_merge_out

    monkeypatch.setattr(triton_merge_out, "interpreting", lambda: False)
    jobs = []
    for cfg in triton_merge_out._configs():
        consts = dict(R=512, R_PAD=512, V=128, NUM_SPLITS=splits, S_PAD=max(8, splits), STEP=8,
                      PDL=True, **cfg.kwargs)  # fmt: skip
        div16 = ["part_out_ptr", "part_lse_ptr", "w_ptr", "out_ptr", "stride_wh"]
        jobs.append(
            _tuned_job("triton_merge_out:_merge_w_uv_kernel", MERGE_SIG, consts, div16, cfg)
        )
    _assert_clean_pdl_compiles(jobs)


def test_h16_decode_fits_the_shared_memory_of_a_block_on_sm_86(monkeypatch):
    """The H 16 default (tiles of 64 latents, three stages) takes 94.5 KB of shared memory a
    program: within the 99 KB (101,376 bytes) a block may have on sm_86 / sm_89 GPUs, the
    smallest limit among those it runs on (sm_90: 227 KB)."""
    from deltaserve.ops.mla import triton_decode

    monkeypatch.setattr(triton_decode, "interpreting", lambda: False)
    job = _decode_job(triton_decode, 16, 1, True)
    assert job["constexprs"]["BLOCK_N"] == 64, job["constexprs"]
    job["constexprs"]["PDL"] = False  # griddepcontrol needs sm_90
    (res,) = compile_many([{**job, "capability": 86}])
    assert "error" not in res, res
    assert 0 < res["shared_bytes"] <= 101_376, res
