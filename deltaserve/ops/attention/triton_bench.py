"""Microbenchmark of the Triton paged decode kernel (used by `deltaserve bench kernels`).

Figures are bandwidth against the bytes a decode step must move: every sequence's K and V
(`batch * context * num_kv_heads * head_dim` elements each), plus q and the output.
"""

from __future__ import annotations

import torch

from deltaserve.ops.attention.triton_decode import paged_decode


def make_decode_inputs(
    batch: int,
    context: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    page: int = 16,
    device: str = "cuda",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Random q and a full paged cache, each sequence's blocks scattered at random."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-context // page)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)  # [B, blocks_per_seq]
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, num_q_heads, head_dim, generator=gen, device=device).to(dtype)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, block_tables=block_tables)


def bench_decode(
    batch: int,
    context: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    page: int = 16,
    config: dict | None = None,
    use_cuda_graph: bool = True,
) -> dict[str, float]:
    """Time one decode attention call (split + merge kernels) over a full cache of `context`
    tokens per sequence. Returns {"us": median microseconds, "tb_s": TB/s, "bytes": bytes}."""
    import triton.testing

    x = make_decode_inputs(batch, context, num_q_heads, num_kv_heads, head_dim, dtype, page)
    out = torch.empty_like(x["q"])
    scale = head_dim**-0.5

    def step() -> None:
        paged_decode(
            x["q"], x["k_cache"], x["v_cache"], x["seq_lens"], x["block_tables"], scale, out, config
        )

    step()  # compile
    torch.cuda.synchronize()
    if use_cuda_graph:
        ms = triton.testing.do_bench_cudagraph(step, rep=100)
    else:
        ms = triton.testing.do_bench(step, warmup=25, rep=100)
    elem = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * elem
    total = kv_bytes + 2 * x["q"].numel() * elem
    return {"us": ms * 1e3, "tb_s": total / (ms * 1e-3) / 1e12, "bytes": float(total)}
