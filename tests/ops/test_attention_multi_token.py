"""Attention for decode rows of q tokens (speculative verification): query token i of decode
row b sits at `context_lens[b] + i` and sees keys 0 .. that position.

Decode rows of q tokens must equal the same tokens fed one at a time (reference) and the same
tokens taken as prefill chunks on the same context (reference and Triton), with the K/V
written the same. CPU tests run Triton in its interpreter; `gpu` tests use real shapes, a CUDA
graph and FlashInfer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_helpers import requires_triton
from meta_helpers import make_meta, rel_err
from test_triton_attention import TOL, make_case, meta_to, reference

from deltaserve.forward_context import BatchMetadata
from deltaserve.ops.attention import AttentionBackend
from deltaserve.ops.attention.reference import TorchAttentionBackend, write_kv

QUERY_LENS = [1, 2, 3, 5, 16]
# (context_len, q_len) of the prefill rows that follow the decode rows in mixed batches
PREFILLS = [(0, 9), (13, 22), (5, 1)]


def decode_rows(q: int, n: int = 3) -> list[tuple[int, int]]:
    """n decode rows of q tokens on contexts that end mid-page, on a page edge and short."""
    return [(c, q) for c in (7, 16, 1, 30)[:n]]


def as_prefill(meta: BatchMetadata) -> BatchMetadata:
    """The same batch with every row taken as a prefill chunk (no decode rows)."""
    return dataclasses.replace(meta, num_decodes=0, decode_query_len=1, _prefill=None)


def one_token_steps(meta: BatchMetadata, q: int, t: int) -> BatchMetadata:
    """Token t of each of the decode rows of `meta` as a plain one-token decode step."""
    n = meta.num_decodes
    return meta_to(
        make_meta(
            [1] * n,
            [c + t for c in meta.context_lens_cpu[:n]],
            n,
            block_tables=meta.block_tables[:n].tolist(),
            slot_mapping=meta.slot_mapping[t : n * q : q].tolist(),
        ),
        meta.slot_mapping.device,
    )


@pytest.mark.parametrize("q", QUERY_LENS)
def test_reference_decode_rows_equal_one_at_a_time(q):
    """TorchAttentionBackend on decode rows of q tokens == q one-token decode steps (keys of
    the earlier tokens written by the earlier steps): outputs and caches."""
    query, k, v, k_cache, v_cache, meta = make_case(
        decode_rows(q), 3, 6, 2, 16, 8, torch.float32, device=torch.device("cpu"),
        decode_query_len=q, seed=q,
    )  # fmt: skip
    want_k, want_v = k_cache.clone(), v_cache.clone()
    out = TorchAttentionBackend().forward(query, k, v, k_cache, v_cache, meta, 0.3)
    for t in range(q):
        rows = slice(t, 3 * q, q)
        step = one_token_steps(meta, q, t)
        got = TorchAttentionBackend().forward(
            query[rows], k[rows], v[rows], want_k, want_v, step, 0.3
        )
        assert rel_err(out[rows], got) < 1e-6, f"token {t}"
    torch.testing.assert_close(k_cache, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0, equal_nan=True)


def test_reference_decode_rows_are_causal():
    """Guards the mask: token 0 of a 3-token decode row must not see tokens 1 and 2."""
    query, k, v, k_cache, v_cache, meta = make_case(
        decode_rows(3), 3, 4, 2, 16, 8, torch.float32, device=torch.device("cpu"),
        decode_query_len=3,
    )  # fmt: skip
    causal = TorchAttentionBackend().forward(query, k, v, k_cache, v_cache, meta, 0.3, True)
    full = TorchAttentionBackend().forward(query, k, v, k_cache, v_cache, meta, 0.3, False)
    assert rel_err(causal[0::3], full[0::3]) > 1e-2
    torch.testing.assert_close(causal[2::3], full[2::3], rtol=0, atol=0)  # the last token


@requires_triton
@pytest.mark.parametrize("q", QUERY_LENS)
@pytest.mark.parametrize("mixed", [False, True], ids=["decodes", "mixed"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_triton_decode_rows(q, mixed, causal):
    """TritonAttentionBackend on decode rows of q tokens (optionally followed by prefills, and
    padding rows with slot -1) == the torch reference on the same batch == the Triton
    backend on the same tokens as prefill chunks; caches written identically; padding rows
    zero."""
    from deltaserve.ops.attention.triton_backend import TritonAttentionBackend

    seqs = decode_rows(q) + (PREFILLS if mixed else [])
    query, k, v, k_cache, v_cache, meta = make_case(
        seqs, 3, 6, 2, 16, 8, torch.float32, decode_query_len=q, seed=q
    )
    pad = 2
    query, k, v = (torch.cat([x, torch.randn_like(x[:pad])]) for x in (query, k, v))
    meta.slot_mapping = torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((pad,), -1)])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    pre_k, pre_v = k_cache.clone(), v_cache.clone()
    want = TorchAttentionBackend().forward(query, k, v, want_k, want_v, meta, 0.4, causal)
    out = TritonAttentionBackend().forward(query, k, v, k_cache, v_cache, meta, 0.4, causal)
    chunks = TritonAttentionBackend().forward(
        query, k, v, pre_k, pre_v, as_prefill(meta), 0.4, causal
    )
    for cache in (want_k, pre_k):
        torch.testing.assert_close(k_cache, cache, rtol=0, atol=0, equal_nan=True)
    for cache in (want_v, pre_v):
        torch.testing.assert_close(v_cache, cache, rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(out).all()
    assert rel_err(out, want) < 1e-5
    assert rel_err(out, chunks) < 1e-6
    assert torch.count_nonzero(out[-pad:]) == 0


@requires_triton
@pytest.mark.parametrize("q", [2, 5, 16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(6, 2), (5, 1), (4, 4)])
def test_triton_split_decode_kernel_rows(monkeypatch, q, splits, num_q_heads, num_kv_heads):
    """The split-KV decode kernel on rows of q tokens (q x group query rows per program), with
    the split scratch poisoned: equal to the reference, for one split and for several (where a
    split may hold no key a query row sees), and a padded row (seq_len 0) gives zeros."""
    from deltaserve.ops.attention import triton_decode

    monkeypatch.setattr(triton_decode, "POISON_SCRATCH", True)
    seqs = [(c, q) for c in (7, 16, 40)]
    query, k, v, k_cache, v_cache, meta = make_case(
        seqs, 3, num_q_heads, num_kv_heads, 16, 8, torch.float32, decode_query_len=q, seed=q
    )
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    want = reference(query, k_cache, v_cache, meta, 0.4)
    seq_lens = torch.cat([meta.seq_lens, meta.seq_lens.new_zeros(1)])  # a padded sequence
    tables = torch.cat([meta.block_tables, meta.block_tables[:1]])
    padded = torch.cat([query, torch.randn_like(query[:q])])
    out = triton_decode.paged_decode(
        padded, k_cache, v_cache, seq_lens, tables, 0.4,
        out=torch.full_like(padded, float("nan")), config={"NUM_SPLITS": splits}, query_len=q,
    )  # fmt: skip
    assert torch.isfinite(out).all()
    assert rel_err(out[: len(query)], want) < 1e-5
    assert torch.count_nonzero(out[len(query) :]) == 0


def test_graph_query_lens_declared():
    """Every backend says which decode query lengths it can run inside a CUDA graph."""
    assert AttentionBackend.graph_query_lens == (1,)
    assert TorchAttentionBackend.graph_query_lens == (1,)
    try:
        from deltaserve.ops.attention.triton_backend import TritonAttentionBackend
    except ImportError:
        pytest.skip("triton is not installed")
    assert set(TritonAttentionBackend.graph_query_lens) >= {1, 2, 3, 5, 16}


# --- GPU: realistic shapes, CUDA graph, FlashInfer ------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@gpu
@needs_cuda
@pytest.mark.parametrize("q", [2, 4, 16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(16, 4, 256), (40, 8, 128)])
def test_gpu_triton_decode_rows(q, num_q_heads, num_kv_heads, head_dim):
    from deltaserve.ops.attention.triton_backend import TritonAttentionBackend

    dev = torch.device("cuda")
    seqs = [(c, q) for c in (1, 15, 16, 1000, 4095)] + [(0, 515), (2047, 300)]
    query, k, v, k_cache, v_cache, meta = make_case(
        seqs, 5, num_q_heads, num_kv_heads, head_dim, 16, torch.bfloat16, device=dev,
        decode_query_len=q, seed=q,
    )  # fmt: skip
    scale = head_dim**-0.5
    out = TritonAttentionBackend().forward(query, k, v, k_cache, v_cache, meta, scale)
    want = reference(query, k_cache, v_cache, meta, scale)
    for b in range(len(seqs)):
        rows = slice(meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1])
        assert rel_err(out[rows], want[rows]) < TOL[torch.bfloat16], f"sequence {b}"


@gpu
@needs_cuda
@pytest.mark.parametrize("q", [2, 5])
def test_gpu_triton_cuda_graph_decode_rows(q):
    """Capture an all-decode step of 6 rows of q tokens; new lengths, tables and values in the
    same tensors; the replay equals the reference."""
    from deltaserve.ops.attention.triton_backend import TritonAttentionBackend

    assert q in TritonAttentionBackend.graph_query_lens
    dev = torch.device("cuda")
    backend = TritonAttentionBackend()
    width, page, hq, hkv, dim, dtype = 160, 16, 16, 4, 256, torch.bfloat16
    lens = [100, 2000, 7, 1, 2500, 333]
    case = make_case([(n, q) for n in lens], 6, hq, hkv, dim, page, dtype, device=dev,
                     table_width=width, decode_query_len=q, seed=1)  # fmt: skip
    query, k, v, _, _, meta = case
    num_blocks = 6 * width + 8
    k_big = torch.full((num_blocks, page, hkv, dim), float("nan"), dtype=dtype, device=dev)
    v_big = torch.full_like(k_big, float("nan"))
    static = dict(q=query.clone(), k=k.clone(), v=v.clone())

    def forward() -> torch.Tensor:
        return backend.forward(static["q"], static["k"], static["v"], k_big, v_big, meta, 0.06)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = forward()
    for round_ in range(2):
        new_lens = [(n * 7 + 1000 * round_) % (width * page - q - 1) for n in lens]
        nq, nk, nv, nk_cache, nv_cache, nmeta = make_case(
            [(n, q) for n in new_lens], 6, hq, hkv, dim, page, dtype, device=dev,
            table_width=width, decode_query_len=q, seed=10 + round_,
        )  # fmt: skip
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
        want = reference(nq, k_big, v_big, nmeta, 0.06)
        assert rel_err(graph_out, want) < TOL[dtype], f"round {round_}"


@gpu
@needs_cuda
@pytest.mark.parametrize("q", [2, 4, 16])
@pytest.mark.parametrize("mixed", [False, True], ids=["decodes", "mixed"])
def test_gpu_flashinfer_decode_rows(q, mixed):
    """FlashInfer serves decode rows of q > 1 tokens through its prefill wrapper (eagerly) and
    refuses to plan them for a CUDA graph."""
    pytest.importorskip("flashinfer")
    from deltaserve.ops.attention.flashinfer_backend import FlashInferAttentionBackend

    dev = torch.device("cuda")
    seqs = [(c, q) for c in (1, 15, 16, 250)] + ([(0, 37), (123, 5)] if mixed else [])
    query, k, v, k_cache, v_cache, meta = make_case(
        seqs, 4, 16, 4, 256, 16, torch.bfloat16, device=dev, decode_query_len=q, seed=q
    )
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = TorchAttentionBackend().forward(query, k, v, want_k, want_v, meta, 0.0625)
    backend = FlashInferAttentionBackend()
    out = backend.forward(query, k, v, k_cache, v_cache, meta, 0.0625)
    torch.testing.assert_close(k_cache, want_k, rtol=0, atol=0, equal_nan=True)
    for b in range(len(seqs)):
        rows = slice(meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1])
        assert rel_err(out[rows], want[rows]) < 1e-2, f"sequence {b}"
    assert FlashInferAttentionBackend.graph_query_lens == (1,)
    if not mixed:
        backend.configure(16, 4, 256, 16, torch.bfloat16)
        backend.init_cuda_graph(8, 32, dev)
        with pytest.raises(ValueError, match="decode rows of q"):
            backend.plan_graph(meta, 4)
