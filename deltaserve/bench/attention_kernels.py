"""`deltaserve bench kernels --only attention`: paged decode attention per batch size, context
and head shape, ours (Triton split-KV) and FlashInfer's tensor-core and CUDA-core decode, each
timed in a CUDA graph; bytes = every sequence's K and V plus q and the output (rows and tables:
deltaserve.bench.kernels)."""

from __future__ import annotations

from deltaserve.bench.kernels import measured_row

# (Hq, Hkv, D): Qwen3.5-9B's 16q / 4kv of 256, and a group-5 shape of 128
ATTN_SHAPES = [(16, 4, 256), (40, 8, 128)]
ATTN_POINTS = [(b, c) for b in (1, 16, 64, 256) for c in (1024, 4096)] + [(16, 16384)]
ATTN_POINTS_QUICK = [(1, 4096), (64, 4096)]
PAGE = 16


def _decode_inputs(batch: int, context: int, hq: int, hkv: int, d: int, dtype) -> dict:
    """Random q and a full paged cache, each sequence's blocks at random places."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    pages = -(-context // PAGE)
    shape = (batch * pages, PAGE, hkv, d)
    return dict(
        q=torch.randn(batch, hq, d, device="cuda", generator=gen).to(dtype),
        k_cache=torch.randn(shape, device="cuda", generator=gen).to(dtype),
        v_cache=torch.randn(shape, device="cuda", generator=gen).to(dtype),
        indices=torch.randperm(batch * pages, device="cuda", generator=gen).to(torch.int32),
        kv_indptr=torch.arange(batch + 1, dtype=torch.int32) * pages,
        last_page_len=torch.full((batch,), context - (pages - 1) * PAGE, dtype=torch.int32),
    )


def bench_flashinfer_decode(
    batch: int, context: int, hq: int, hkv: int, d: int, dtype, tensor_cores: bool
) -> dict[str, float]:
    """One FlashInfer decode call (plan once, `run` timed in a CUDA graph, as the engine
    replays it). Returns {"us", "tb_s", "bytes"} counted like ours (KV + q + out)."""
    import flashinfer
    import torch
    import triton.testing

    x = _decode_inputs(batch, context, hq, hkv, d, dtype)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=tensor_cores, backend="fa2"
    )
    table = (x["kv_indptr"], x["indices"], x["last_page_len"])
    wrapper.plan(*table, hq, hkv, d, PAGE, q_data_type=dtype, kv_data_type=dtype, sm_scale=d**-0.5)
    out = torch.empty_like(x["q"])
    kv = (x["k_cache"], x["v_cache"])

    def step() -> None:
        wrapper.run(x["q"], kv, out=out)

    step()  # JIT / warm-up
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(step, rep=100)
    elem = torch.finfo(dtype).bits // 8
    total = 2 * batch * context * hkv * d * elem + 2 * x["q"].numel() * elem
    return {"us": ms * 1e3, "tb_s": total / (ms * 1e-3) / 1e12, "bytes": float(total)}


def bench_attention(points: list[tuple[int, int]], errors: list[str]) -> list[dict]:
    """Paged decode rows: ours (Triton) and FlashInfer, per point and head shape."""
    import torch

    from deltaserve.backend_checks import FLASHINFER_CUDA_CORE_GROUPS, package_installed

    try:
        from deltaserve.ops.attention.triton_bench import bench_decode
    except ImportError as e:
        errors.append(f"attention: deltaserve.ops.attention.triton_bench.bench_decode ({e})")
        bench_decode = None
    has_fi = package_installed("flashinfer")
    if not has_fi:
        errors.append("attention: flashinfer not installed, its rows are skipped")
    rows = []
    for hq, hkv, d in ATTN_SHAPES:
        for batch, context in points:
            shape = dict(batch=batch, context=context, hq=hq, hkv=hkv, head_dim=d)
            runs = []  # (impl, function, extra args)
            if bench_decode is not None:
                runs.append(("triton", bench_decode, ()))
            if has_fi:
                runs.append(("flashinfer-tc", bench_flashinfer_decode, (True,)))
                if hq // hkv in FLASHINFER_CUDA_CORE_GROUPS:
                    runs.append(("flashinfer-cuda-cores", bench_flashinfer_decode, (False,)))
            for impl, fn, extra in runs:

                def measure(fn=fn, extra=extra, point=(batch, context, hq, hkv, d)) -> tuple:
                    res = fn(*point, torch.bfloat16, *extra)
                    return res["bytes"], res["us"], {}

                what = f"attention {impl} {shape}"
                rows.append(measured_row("attention", impl, what, shape, errors, measure))
    return rows
