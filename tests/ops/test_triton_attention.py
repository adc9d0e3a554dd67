"""Triton paged attention (store, split-KV decode, ragged prefill) against the torch reference.

CPU tests run the kernels in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
without a GPU), so they stay small: float32 / bf16, head dim 16 or 32, a few sequences. The
`gpu` tests use realistic shapes and a CUDA graph.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_helpers import kernel_device, requires_triton
from meta_helpers import make_meta, meta_to, rel_err

from deltaserve.forward_context import BatchMetadata
from deltaserve.ops.attention.reference import TorchAttentionBackend, paged_attention, write_kv

pytestmark = requires_triton

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def make_case(
    seqs: list[tuple[int, int]],
    num_decodes: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page: int,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    device: torch.device | None = None,
    table_width: int | None = None,
    decode_query_len: int = 1,
):
    """A paged cache (blocks handed out in shuffled order, every unwritten slot NaN) holding each
    sequence's `context_len` cached tokens, plus the step's q / k / v and its metadata.

    `seqs` lists (context_len, q_len) per sequence. Returns q, k, v, k_cache, v_cache, meta."""
    device = device or kernel_device()
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [math.ceil((c + q) / page) for c, q in seqs]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN
    perm = torch.randperm(num_blocks, generator=gen, device=device).tolist()
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    flat_k, flat_v = (
        k_cache.view(-1, num_kv_heads, head_dim),
        v_cache.view(-1, num_kv_heads, head_dim),
    )

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device).to(dtype)

    tables, slot_mapping = [], []
    for (context_len, q_len), n in zip(seqs, blocks_per_seq, strict=True):
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        pos = torch.arange(context_len + q_len, device=device)
        slots = torch.tensor(table, device=device)[pos // page] * page + pos % page  # [S]
        flat_k[slots[:context_len]] = randn(context_len, num_kv_heads, head_dim)
        flat_v[slots[:context_len]] = randn(context_len, num_kv_heads, head_dim)
        slot_mapping += slots[context_len:].tolist()
    if table_width is not None:
        tables = [t + [0] * (table_width - len(t)) for t in tables]
    meta = make_meta(
        [q for _, q in seqs],
        [c for c, _ in seqs],
        num_decodes,
        block_tables=tables,
        slot_mapping=slot_mapping,
        decode_query_len=decode_query_len,
    )
    num_tokens = sum(q for _, q in seqs)
    q = randn(num_tokens, num_q_heads, head_dim)
    k = randn(num_tokens, num_kv_heads, head_dim)
    v = randn(num_tokens, num_kv_heads, head_dim)
    return q, k, v, k_cache, v_cache, meta_to(meta, device)


def reference(q, k_cache, v_cache, meta: BatchMetadata, scale: float, causal: bool = True):
    """The torch reference in float32 over float32 copies of the (already written) cache."""
    return paged_attention(
        q.float(),
        k_cache.float(),
        v_cache.float(),
        meta.query_start_loc_cpu,
        meta.seq_lens_cpu,
        meta.block_tables,
        scale,
        causal,
    )


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


# --- CPU (interpreter) and GPU: small shapes -------------------------------------------------


def test_store_kv_matches_write_kv():
    q, k, v, k_cache, v_cache, meta = make_case([(3, 4), (0, 5)], 0, 3, 3, 16, 8, torch.float32)
    slot_mapping = meta.slot_mapping.clone()
    slot_mapping[[0, 4, 8]] = -1  # skipped tokens first, in the middle and last
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv(k, v, want_k, want_v, slot_mapping, impl="torch")
    write_kv(k, v, k_cache, v_cache, slot_mapping, impl="triton")
    torch.testing.assert_close(k_cache, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0, equal_nan=True)


DECODE_CASES = [
    # (Hq, Hkv, head_dim, page, dtype, config overrides)
    (5, 1, 32, 8, torch.float32, {}),  # group 5, one split
    (6, 2, 16, 16, torch.float32, {"NUM_SPLITS": 3}),  # group 3, some splits empty
    (2, 2, 16, 8, torch.bfloat16, {"NUM_SPLITS": 2}),  # group 1
    (16, 1, 16, 8, torch.float32, {"NUM_SPLITS": 2, "BLOCK_N": 16}),  # group 16, tile < page
]


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,page,dtype,config", DECODE_CASES)
def test_decode_matches_reference(
    monkeypatch, num_q_heads, num_kv_heads, head_dim, page, dtype, config
):
    from deltaserve.ops.attention import triton_decode

    monkeypatch.setattr(triton_decode, "POISON_SCRATCH", True)
    seqs = [(18, 1), (0, 1), (44, 1)]  # sequence lengths 19, 1, 45
    q, k, v, k_cache, v_cache, meta = make_case(
        seqs, 3, num_q_heads, num_kv_heads, head_dim, page, dtype, seed=num_q_heads
    )
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = triton_decode.paged_decode(
        q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 0.3, out=nan_like(q), config=config
    )
    want = reference(q, k_cache, v_cache, meta, 0.3)
    assert out.dtype == dtype and torch.isfinite(out).all()
    for b in range(len(seqs)):
        assert rel_err(out[b], want[b]) < TOL[dtype], f"sequence {b}"


def test_decode_padding_rows():
    """CUDA-graph padding: rows with seq_len 0 and rows past the batch come back as zeros."""
    from deltaserve.ops.attention.triton_decode import paged_decode

    q, k, v, k_cache, v_cache, meta = make_case([(9, 1), (0, 1)], 2, 4, 2, 16, 8, torch.float32)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    seq_lens = meta.seq_lens.clone()
    seq_lens[1] = 0  # a padded batch row
    q_pad = torch.cat([q, torch.randn_like(q[:1])])  # and one token row past the batch
    out = paged_decode(q_pad, k_cache, v_cache, seq_lens, meta.block_tables, 0.5, config={})
    want = reference(q, k_cache, v_cache, meta, 0.5)
    assert rel_err(out[0], want[0]) < 1e-5
    assert torch.count_nonzero(out[1:]) == 0


# (context_len, q_len): decodes first, then a prefill with no prefix, one on top of a prefix
# that ends mid-page, and a single-token prefill.
MIXED = [(7, 1), (20, 1), (0, 9), (13, 22), (5, 1)]


@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,page,dtype,causal",
    [
        (6, 2, 8, torch.float32, True),
        (6, 2, 8, torch.float32, False),
        (12, 1, 16, torch.bfloat16, True),
    ],
)
def test_prefill_matches_reference(num_q_heads, num_kv_heads, page, dtype, causal):
    from deltaserve.ops.attention.triton_prefill import paged_prefill

    q, k, v, k_cache, v_cache, meta = make_case(
        MIXED, 2, num_q_heads, num_kv_heads, 16, page, dtype, seed=page
    )
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_prefill(
        q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.25,
        causal, out=nan_like(q),
    )  # fmt: skip
    want = reference(q, k_cache, v_cache, meta, 0.25, causal)
    assert out.dtype == dtype and torch.isfinite(out).all()
    for b in range(len(MIXED)):
        rows = slice(meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1])
        assert rel_err(out[rows], want[rows]) < TOL[dtype], f"sequence {b}"


@pytest.mark.parametrize("all_decode", [True, False])
def test_backend_forward_matches_torch_backend(monkeypatch, all_decode):
    """Store + attention through the backend, with CUDA-graph padding rows (slot -1)."""
    from deltaserve.ops.attention import triton_decode
    from deltaserve.ops.attention.triton_backend import TritonAttentionBackend

    monkeypatch.setattr(triton_decode, "POISON_SCRATCH", True)
    seqs, num_decodes = ([(11, 1), (30, 1)], 2) if all_decode else ([(4, 1), (9, 6)], 1)
    q, k, v, k_cache, v_cache, meta = make_case(seqs, num_decodes, 3, 1, 16, 8, torch.float32)
    pad = 2
    q, k, v = (torch.cat([x, torch.randn_like(x[:pad])]) for x in (q, k, v))
    meta.slot_mapping = torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((pad,), -1)])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = TorchAttentionBackend().forward(q, k, v, want_k, want_v, meta, 0.4)
    out = TritonAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.4)
    torch.testing.assert_close(k_cache, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0, equal_nan=True)
    assert rel_err(out, want) < 1e-5
    assert torch.count_nonzero(out[-pad:]) == 0


# --- GPU: realistic shapes ----------------------------------------------------------------------

GROUPS = [(4, 4), (12, 4), (20, 4), (24, 4), (24, 2), (16, 1)]  # groups 1, 3, 5, 6, 12, 16


# (Hq, Hkv, head_dim, dtype): every group and head dim in bf16, the other dtypes on a few
SHAPES = [(hq, hkv, d, torch.bfloat16) for hq, hkv in GROUPS for d in (64, 128, 256)]
SHAPES += [(40, 8, 128, torch.float16), (16, 4, 256, torch.float16), (24, 4, 128, torch.float32)]
SHAPES += [(16, 4, 256, torch.float32), (8, 8, 64, torch.float32)]


@pytest.mark.gpu
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,dtype", SHAPES)
def test_gpu_decode(monkeypatch, num_q_heads, num_kv_heads, head_dim, dtype):
    from deltaserve.ops.attention import triton_decode

    monkeypatch.setattr(triton_decode, "POISON_SCRATCH", True)
    gen = torch.Generator().manual_seed(head_dim + num_q_heads)
    lens = [1, 17, 4095, 4097, 2 * 1024 + 3] + torch.randint(1, 3000, (7,), generator=gen).tolist()
    seqs = [(n - 1, 1) for n in lens]
    q, k, v, k_cache, v_cache, meta = make_case(
        seqs, len(seqs), num_q_heads, num_kv_heads, head_dim, 16, dtype, seed=head_dim
    )
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    want = reference(q, k_cache, v_cache, meta, head_dim**-0.5)
    for splits in [None, 7]:
        config = {} if splits is None else {"NUM_SPLITS": splits}
        out = triton_decode.paged_decode(
            q, k_cache, v_cache, meta.seq_lens, meta.block_tables, head_dim**-0.5,
            out=nan_like(q), config=config,
        )  # fmt: skip
        assert torch.isfinite(out).all()
        for b in range(len(seqs)):
            assert rel_err(out[b], want[b]) < TOL[dtype], f"sequence {b}, splits {splits}"


@pytest.mark.gpu
@pytest.mark.parametrize("page", [8, 16, 32, 128])
def test_gpu_decode_page_sizes(page):
    from deltaserve.ops.attention.triton_decode import paged_decode

    seqs = [(n - 1, 1) for n in (5, 130, 1000, 2049)]
    q, k, v, k_cache, v_cache, meta = make_case(seqs, 4, 40, 8, 128, page, torch.bfloat16)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 0.1, nan_like(q))
    assert rel_err(out, reference(q, k_cache, v_cache, meta, 0.1)) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,dtype", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_prefill_mixed(num_q_heads, num_kv_heads, head_dim, dtype, causal):
    from deltaserve.ops.attention.triton_prefill import paged_prefill

    seqs = [(1000, 1), (37, 1), (0, 1), (0, 515), (2047, 300), (63, 64), (4000, 7), (0, 1)]
    q, k, v, k_cache, v_cache, meta = make_case(
        seqs, 3, num_q_heads, num_kv_heads, head_dim, 16, dtype, seed=head_dim
    )
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    scale = head_dim**-0.5
    out = paged_prefill(
        q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
        causal, out=nan_like(q),
    )  # fmt: skip
    want = reference(q, k_cache, v_cache, meta, scale, causal)
    assert torch.isfinite(out).all()
    for b in range(len(seqs)):
        rows = slice(meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1])
        assert rel_err(out[rows], want[rows]) < TOL[dtype], f"sequence {b}"


@pytest.mark.gpu
def test_gpu_decode_cuda_graph_replay():
    """Capture an all-decode forward; new seq_lens / block tables / q / k / v in the same
    tensors, replay, and compare with the reference and with an eager forward."""
    from deltaserve.ops.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend()
    batch, width, page, hq, hkv, dim, dtype = 6, 160, 16, 16, 4, 256, torch.bfloat16
    seqs = [(n - 1, 1) for n in (100, 2000, 7, 1, 2500, 333)]
    q, k, v, k_cache, v_cache, meta = make_case(
        seqs, batch, hq, hkv, dim, page, dtype, table_width=width, seed=1
    )
    # one cache big enough for every round: rounds re-home sequences into fresh random blocks
    num_blocks = batch * width + 8
    k_big = torch.full((num_blocks, page, hkv, dim), float("nan"), dtype=dtype, device="cuda")
    v_big = torch.full_like(k_big, float("nan"))
    static = dict(q=q.clone(), k=k.clone(), v=v.clone())

    def forward() -> torch.Tensor:
        return backend.forward(static["q"], static["k"], static["v"], k_big, v_big, meta, dim**-0.5)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = forward()

    for round_ in range(3):
        lens = [
            (n * 7 + 1000 * round_) % (width * page - 1) + 1 for n in (100, 2000, 7, 1, 2500, 333)
        ]
        new = make_case(
            [(n - 1, 1) for n in lens], batch, hq, hkv, dim, page, dtype,
            table_width=width, seed=10 + round_,
        )  # fmt: skip
        nq, nk, nv, nk_cache, nv_cache, nmeta = new
        k_big.fill_(float("nan"))
        v_big.fill_(float("nan"))
        k_big[: nk_cache.shape[0]] = nk_cache
        v_big[: nv_cache.shape[0]] = nv_cache
        for name, x in (("q", nq), ("k", nk), ("v", nv)):
            static[name].copy_(x)
        for name in ("slot_mapping", "seq_lens", "context_lens", "block_tables", "query_start_loc"):
            getattr(meta, name).copy_(getattr(nmeta, name))
        graph.replay()
        torch.cuda.synchronize()
        want = reference(nq, k_big, v_big, nmeta, dim**-0.5)
        assert rel_err(graph_out, want) < TOL[dtype], f"round {round_}"
        eager = forward()
        torch.testing.assert_close(graph_out, eager, rtol=0, atol=0)
