"""Triton MLA kernels (latent writer, split-latent decode, ragged prefill, backend) against the
torch reference (deltaserve.ops.mla.reference).

CPU tests run the kernels in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
without a GPU), so they stay small: R and P not powers of two, H 1, 3 and 16, pages and tiles
that sequences cross. The `gpu` tests use the real shapes (R 512, P 64, H 16 and 128, bf16).
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import requires_triton
from meta_helpers import meta_to, rel_err
from mla_cases import make_mla_case, reference

from deltaserve.ops.mla.reference import TorchMLABackend, write_latent

pytestmark = requires_triton

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def test_store_latent_matches_write_latent():
    from deltaserve.ops.mla.triton_writer import store_latent

    case = make_mla_case([(3, 4), (0, 5)], 0, 2, 20, 6, 8, torch.float32)
    slots = case.meta.slot_mapping.clone()
    slots[[0, 4, 8]] = -1  # skipped tokens first, in the middle and last
    want = case.cache.clone()
    write_latent(case.c_kv, case.k_pe, want, slots)
    store_latent(case.c_kv, case.k_pe, case.cache, slots)
    torch.testing.assert_close(case.cache, want, rtol=0, atol=0, equal_nan=True)


def test_store_latent_rejects_wrong_width():
    from deltaserve.ops.mla.triton_writer import store_latent

    case = make_mla_case([(0, 2)], 0, 1, 20, 6, 8, torch.float32)
    with pytest.raises(ValueError, match="latent cache width 26"):
        store_latent(case.c_kv, case.k_pe[:, :5], case.cache, case.meta.slot_mapping)


DECODE_CASES = [
    # (H, R, P, page, dtype, query_len, config overrides)
    (3, 20, 6, 8, torch.float32, 1, {}),  # one split
    (1, 24, 8, 16, torch.float32, 1, {"NUM_SPLITS": 3}),  # one head, some splits empty
    (16, 32, 16, 8, torch.float32, 1, {"NUM_SPLITS": 2, "BLOCK_N": 16}),  # all heads, one tile
    (3, 20, 6, 8, torch.float32, 3, {"NUM_SPLITS": 2}),  # verify rows: 9 query rows
    (16, 32, 16, 8, torch.float32, 3, {"NUM_SPLITS": 2, "BLOCK_H": 16}),  # 3 row tiles
    (3, 48, 16, 8, torch.bfloat16, 1, {"NUM_SPLITS": 2}),
    # the latent width in column chunks (mla_tile_chunked): the last chunk part padding
    (3, 20, 6, 8, torch.float32, 1, {"R_CHUNKS": 2, "maxnreg": 128}),  # one split: direct store
    (16, 32, 16, 8, torch.float32, 3, {"NUM_SPLITS": 2, "BLOCK_H": 16, "R_CHUNKS": 2}),
    (3, 48, 16, 8, torch.bfloat16, 1, {"NUM_SPLITS": 3, "R_CHUNKS": 4}),
]


@pytest.mark.parametrize("heads,r,p,page,dtype,qlen,config", DECODE_CASES)
def test_decode_matches_reference(monkeypatch, heads, r, p, page, dtype, qlen, config):
    from deltaserve.ops.mla import triton_decode

    monkeypatch.setattr(triton_decode, "POISON_SCRATCH", True)
    seqs = [(18, qlen), (0, qlen), (40, qlen)]  # crosses pages, tiles and splits
    case = make_mla_case(seqs, 3, heads, r, p, page, dtype, seed=heads + r, decode_query_len=qlen)
    write_latent(case.c_kv, case.k_pe, case.cache, case.meta.slot_mapping)
    out = triton_decode.mla_decode(
        case.q_lat, case.q_pe, case.cache, case.meta.seq_lens, case.meta.block_tables, 0.3,
        out=nan_like(case.q_lat), config=config, query_len=qlen,
    )  # fmt: skip
    want = reference(case, 0.3)
    assert out.dtype == dtype and torch.isfinite(out).all()
    for b in range(len(seqs)):
        rows = slice(b * qlen, (b + 1) * qlen)
        assert rel_err(out[rows], want[rows]) < TOL[dtype], f"sequence {b}"


@pytest.mark.parametrize(
    "seqs,qlen,config",
    [
        ([(18, 1), (0, 1), (40, 1), (7, 1)], 1, {"NUM_SPLITS": 3}),  # new latent mid-tile
        ([(15, 1), (31, 1)], 1, {"NUM_SPLITS": 1}),  # new latent opens a tile / page
        ([(18, 3), (0, 3), (13, 3)], 3, {"NUM_SPLITS": 2}),  # verify rows across a split edge
        ([(30, 3), (5, 3)], 3, {"NUM_SPLITS": 4, "BLOCK_H": 16}),  # several row tiles
        ([(18, 1), (0, 1), (40, 1)], 1, {"NUM_SPLITS": 3, "R_CHUNKS": 2}),  # column chunks
        ([(18, 3), (13, 3)], 3, {"NUM_SPLITS": 2, "R_CHUNKS": 2}),
    ],
)
def test_decode_fused_store_matches_store_then_decode(seqs, qlen, config):
    """`new_latents`: the decode writes the step's latents itself (skipping slot -1) and its
    output and cache equal the latent writer's then the decode's, bit for bit."""
    from deltaserve.ops.mla.triton_decode import mla_decode
    from deltaserve.ops.mla.triton_writer import store_latent

    case = make_mla_case(seqs, len(seqs), 16, 20, 6, 8, torch.float32, seed=len(seqs) + qlen,
                         decode_query_len=qlen)  # fmt: skip
    slots = case.meta.slot_mapping.clone()
    slots[qlen] = -1  # one skipped token (its query still sees its own latent)
    m = case.meta
    want_cache = case.cache.clone()
    store_latent(case.c_kv, case.k_pe, want_cache, slots)
    # the reference path reads the skipped token's latent back from the cache: give it there
    skipped = m.slot_mapping[qlen]
    seen_cache = want_cache.clone()
    own = torch.cat([case.c_kv[qlen], case.k_pe[qlen]])
    seen_cache.view(-1, want_cache.shape[-1])[skipped] = own
    want = mla_decode(
        case.q_lat, case.q_pe, seen_cache, m.seq_lens, m.block_tables, 0.3, config=config,
        query_len=qlen,
    )  # fmt: skip
    got = mla_decode(
        case.q_lat, case.q_pe, case.cache, m.seq_lens, m.block_tables, 0.3, config=config,
        query_len=qlen, new_latents=(case.c_kv, case.k_pe, slots),
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(case.cache, want_cache, rtol=0, atol=0, equal_nan=True)


def test_decode_rejects_chunks_that_do_not_split_the_width():
    """R_CHUNKS must split the padded latent width into power-of-two chunks of 16 or more."""
    from deltaserve.ops.mla.triton_decode import mla_decode

    case = make_mla_case([(5, 1)], 1, 3, 20, 6, 8, torch.float32, seed=1)  # R 20: padded 32
    m = case.meta
    for bad in (0, 3, 4):
        with pytest.raises(ValueError, match="R_CHUNKS must be a power of two"):
            mla_decode(case.q_lat, case.q_pe, case.cache, m.seq_lens, m.block_tables, 0.3,
                       config={"R_CHUNKS": bad})  # fmt: skip


def test_decode_fused_store_rejects_wrong_width():
    from deltaserve.ops.mla.triton_decode import mla_decode

    case = make_mla_case([(4, 1)], 1, 3, 20, 6, 8, torch.float32)
    m = case.meta
    with pytest.raises(ValueError, match="new latents"):
        mla_decode(
            case.q_lat, case.q_pe, case.cache, m.seq_lens, m.block_tables, 0.3,
            new_latents=(case.c_kv, case.k_pe[:, :5], m.slot_mapping),
        )  # fmt: skip


def test_decode_padding_rows():
    """CUDA-graph padding: rows with seq_len 0 and token rows past the batch come back zero."""
    from deltaserve.ops.mla.triton_decode import mla_decode

    case = make_mla_case([(9, 1), (0, 1)], 2, 3, 20, 6, 8, torch.float32)
    write_latent(case.c_kv, case.k_pe, case.cache, case.meta.slot_mapping)
    seq_lens = case.meta.seq_lens.clone()
    seq_lens[1] = 0  # a padded batch row
    q_lat = torch.cat([case.q_lat, torch.randn_like(case.q_lat[:1])])
    q_pe = torch.cat([case.q_pe, torch.randn_like(case.q_pe[:1])])
    out = mla_decode(
        q_lat, q_pe, case.cache, seq_lens, case.meta.block_tables, 0.5, out=nan_like(q_lat),
        config={"NUM_SPLITS": 2},
    )  # fmt: skip
    assert rel_err(out[0], reference(case, 0.5)[0]) < 1e-5
    assert torch.count_nonzero(out[1:]) == 0


# (context_len, q_len): decodes first, then a prefill with no prefix, one on top of a prefix
# that ends mid-page, and a single-token prefill.
MIXED = [(7, 1), (20, 1), (0, 9), (13, 22), (5, 1)]


@pytest.mark.parametrize(
    "heads,r,p,page,dtype,config",
    [
        (3, 20, 6, 8, torch.float32, {}),  # tiles of 16 rows straddle tokens
        (1, 24, 8, 16, torch.float32, {}),
        (16, 32, 16, 8, torch.float32, {}),  # one token per tile
        (16, 32, 16, 8, torch.float32, {"BLOCK_M": 32, "BLOCK_N": 32}),
        (3, 48, 16, 16, torch.bfloat16, {}),
    ],
)
def test_prefill_matches_reference(heads, r, p, page, dtype, config):
    from deltaserve.ops.mla.triton_prefill import mla_prefill

    case = make_mla_case(MIXED, 2, heads, r, p, page, dtype, seed=page + heads)
    write_latent(case.c_kv, case.k_pe, case.cache, case.meta.slot_mapping)
    m = case.meta
    out = mla_prefill(
        case.q_lat, case.q_pe, case.cache, m.query_start_loc, m.seq_lens, m.block_tables, 0.25,
        out=nan_like(case.q_lat), config=config,
    )  # fmt: skip
    want = reference(case, 0.25)
    assert out.dtype == dtype and torch.isfinite(out).all()
    for b in range(len(MIXED)):
        rows = slice(m.query_start_loc_cpu[b], m.query_start_loc_cpu[b + 1])
        assert rel_err(out[rows], want[rows]) < TOL[dtype], f"sequence {b}"


@pytest.mark.parametrize(
    "seqs,num_decodes,qlen",
    [
        ([(11, 1), (30, 1)], 2, 1),  # all decodes
        ([(4, 3), (17, 3)], 2, 3),  # all verify rows
        ([(4, 1), (9, 6), (0, 3)], 1, 1),  # mixed
        ([(4, 3), (21, 3), (2, 5), (0, 1)], 2, 3),  # verify rows and prefills
        ([(0, 7), (30, 2)], 0, 1),  # prefills only
    ],
)
def test_backend_forward_matches_torch_backend(monkeypatch, seqs, num_decodes, qlen):
    """Write + attention through the backend, with CUDA-graph padding rows (slot -1)."""
    from deltaserve.ops.mla import triton_decode
    from deltaserve.ops.mla.triton_backend import TritonMLABackend

    monkeypatch.setattr(triton_decode, "POISON_SCRATCH", True)
    case = make_mla_case(seqs, num_decodes, 3, 20, 6, 8, torch.float32, decode_query_len=qlen)
    pad = 2
    q_lat, q_pe, c_kv, k_pe = (
        torch.cat([x, torch.randn_like(x[:pad])])
        for x in (case.q_lat, case.q_pe, case.c_kv, case.k_pe)
    )
    meta = case.meta
    meta.slot_mapping = torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((pad,), -1)])
    want_cache = case.cache.clone()
    want = TorchMLABackend().forward(q_lat, q_pe, c_kv, k_pe, want_cache, meta, 0.4)
    out = TritonMLABackend().forward(q_lat, q_pe, c_kv, k_pe, case.cache, meta, 0.4)
    torch.testing.assert_close(case.cache, want_cache, rtol=0, atol=0, equal_nan=True)
    assert rel_err(out, want) < 1e-5
    assert torch.count_nonzero(out[-pad:]) == 0


# --- GPU: the real shapes (R 512, P 64, H 16 and 128, bf16) -------------------------------------

R_REAL, P_REAL = 512, 64
SCALE = (128 + 64) ** -0.5  # DeepSeek-V2: qk_nope 128 + rope 64


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("qlen", [1, 3])
def test_gpu_decode_real_shapes(monkeypatch, heads, qlen):
    from deltaserve.ops.mla import triton_decode

    monkeypatch.setattr(triton_decode, "POISON_SCRATCH", True)
    lens = [qlen, 17, 4095, 4096, 2051, 700, 1, 3000]
    lens = [max(n, qlen) for n in lens]
    seqs = [(n - qlen, qlen) for n in lens]
    case = make_mla_case(
        seqs, len(seqs), heads, R_REAL, P_REAL, 16, torch.bfloat16, seed=heads,
        decode_query_len=qlen,
    )  # fmt: skip
    write_latent(case.c_kv, case.k_pe, case.cache, case.meta.slot_mapping)
    want = reference(case, SCALE)
    # the earlier H 16 default (tiles of 32 latents in 128 registers)
    chunked = {"BLOCK_N": 32, "R_CHUNKS": 8, "num_stages": 3, "maxnreg": 128}
    whole = {"R_CHUNKS": 1, "num_stages": 2, "maxnreg": None, "PROGRAMS_PER_SM": 2}
    for config in ({}, {"NUM_SPLITS": 1}, {"NUM_SPLITS": 7, "BLOCK_N": 32}, chunked,
                   {**chunked, "NUM_SPLITS": 1}, {"R_CHUNKS": 4, "BLOCK_N": 16}, whole,
                   {**whole, "NUM_SPLITS": 1}):  # fmt: skip
        out = triton_decode.mla_decode(
            case.q_lat, case.q_pe, case.cache, case.meta.seq_lens, case.meta.block_tables,
            SCALE, out=nan_like(case.q_lat), config=config, query_len=qlen,
        )  # fmt: skip
        assert torch.isfinite(out).all()
        for b in range(len(seqs)):
            rows = slice(b * qlen, (b + 1) * qlen)
            assert rel_err(out[rows], want[rows]) < TOL[torch.bfloat16], f"{b}, {config}"


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("qlen", [1, 3])
def test_gpu_decode_fused_store(heads, qlen):
    """The decode writing the step's latents itself (`new_latents`, the all-decode default)
    against the latent writer then the decode: the same cache, bit for bit, and the same
    output."""
    from deltaserve.ops.mla.triton_decode import mla_decode
    from deltaserve.ops.mla.triton_writer import store_latent

    lens = [max(n, qlen) for n in (qlen, 17, 4095, 2051, 700, 1, 3000, 64)]
    case = make_mla_case(
        [(n - qlen, qlen) for n in lens], len(lens), heads, R_REAL, P_REAL, 16,
        torch.bfloat16, seed=heads + qlen, decode_query_len=qlen,
    )  # fmt: skip
    m = case.meta
    want_cache = case.cache.clone()
    store_latent(case.c_kv, case.k_pe, want_cache, m.slot_mapping)
    want = mla_decode(
        case.q_lat, case.q_pe, want_cache, m.seq_lens, m.block_tables, SCALE, query_len=qlen
    )
    got = mla_decode(
        case.q_lat, case.q_pe, case.cache, m.seq_lens, m.block_tables, SCALE, query_len=qlen,
        new_latents=(case.c_kv, case.k_pe, m.slot_mapping),
    )  # fmt: skip
    torch.testing.assert_close(case.cache, want_cache, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_prefill_mixed_real_shapes(heads):
    from deltaserve.ops.mla.triton_prefill import mla_prefill

    seqs = [(1000, 1), (37, 1), (0, 515), (2047, 300), (63, 64), (4000, 7), (0, 1)]
    case = make_mla_case(seqs, 2, heads, R_REAL, P_REAL, 16, torch.bfloat16, seed=heads)
    write_latent(case.c_kv, case.k_pe, case.cache, case.meta.slot_mapping)
    m = case.meta
    out = mla_prefill(
        case.q_lat, case.q_pe, case.cache, m.query_start_loc, m.seq_lens, m.block_tables,
        SCALE, out=nan_like(case.q_lat),
    )  # fmt: skip
    want = reference(case, SCALE)
    assert torch.isfinite(out).all()
    for b in range(len(seqs)):
        rows = slice(m.query_start_loc_cpu[b], m.query_start_loc_cpu[b + 1])
        assert rel_err(out[rows], want[rows]) < TOL[torch.bfloat16], f"sequence {b}"


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_decode_cuda_graph_replay(heads):
    """Capture an all-decode backend forward; new lengths / tables / inputs in the same
    tensors, replay, and compare with the reference and with an eager forward."""
    from deltaserve.ops.mla.triton_backend import TritonMLABackend

    backend = TritonMLABackend()
    batch, width, page, dtype = 6, 160, 16, torch.bfloat16
    base = (100, 2000, 7, 1, 2500, 333)
    case = make_mla_case(
        [(n - 1, 1) for n in base], batch, heads, R_REAL, P_REAL, page, dtype, table_width=width
    )
    big = torch.full((batch * width + 8, page, R_REAL + P_REAL), float("nan"), dtype=dtype,
                     device="cuda")  # fmt: skip
    static = dict(q_lat=case.q_lat.clone(), q_pe=case.q_pe.clone(), c_kv=case.c_kv.clone(),
                  k_pe=case.k_pe.clone())  # fmt: skip
    meta = case.meta

    def forward() -> torch.Tensor:
        s = static
        return backend.forward(s["q_lat"], s["q_pe"], s["c_kv"], s["k_pe"], big, meta, SCALE)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = forward()
    for round_ in range(3):
        lens = [(n * 7 + 1000 * round_) % (width * page - 1) + 1 for n in base]
        new = make_mla_case(
            [(n - 1, 1) for n in lens], batch, heads, R_REAL, P_REAL, page, dtype,
            table_width=width, seed=10 + round_,
        )  # fmt: skip
        big.fill_(float("nan"))
        big[: new.cache.shape[0]] = new.cache
        for name in static:
            static[name].copy_(getattr(new, name))
        for name in ("slot_mapping", "seq_lens", "context_lens", "block_tables", "query_start_loc"):
            getattr(meta, name).copy_(getattr(new.meta, name))
        graph.replay()
        torch.cuda.synchronize()
        want = reference(new, SCALE, cache=big)
        assert rel_err(graph_out, want) < TOL[dtype], f"round {round_}"
        torch.testing.assert_close(graph_out, forward(), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("all_decode", [True, False])
def test_gpu_flashinfer_matches_reference(heads, all_decode):
    """FlashInfer's MLA wrapper over views of our `[c_kv | k_pe]` cache (writes included)."""
    pytest.importorskip("flashinfer")
    from deltaserve.ops.mla.flashinfer_backend import FlashInferMLABackend

    if all_decode:
        seqs, nd = [(n - 1, 1) for n in (1, 17, 4096, 2051, 700, 3000)], 6
    else:
        seqs, nd = [(1000, 1), (37, 1), (0, 515), (2047, 300), (4000, 7)], 2
    case = make_mla_case(seqs, nd, heads, R_REAL, P_REAL, 16, torch.bfloat16, seed=heads)
    want_cache = case.cache.clone()
    args = (case.q_lat, case.q_pe, case.c_kv, case.k_pe)
    want = TorchMLABackend().forward(*args, want_cache, case.meta, SCALE)
    out = FlashInferMLABackend().forward(*args, case.cache, case.meta, SCALE)
    torch.testing.assert_close(case.cache, want_cache, rtol=0, atol=0, equal_nan=True)
    for b in range(len(seqs)):
        rows = slice(case.meta.query_start_loc_cpu[b], case.meta.query_start_loc_cpu[b + 1])
        assert rel_err(out[rows], want[rows]) < TOL[torch.bfloat16], f"sequence {b}"


@pytest.mark.gpu
def test_gpu_flashinfer_cuda_graph_replay():
    """plan_graph before capture and before each replay (padded to the graph's batch)."""
    pytest.importorskip("flashinfer")
    from deltaserve.engine.cuda_graph import DecodeGraphs
    from deltaserve.ops.mla.flashinfer_backend import FlashInferMLABackend

    heads, page, width, dtype = 16, 16, 64, torch.bfloat16
    backend = FlashInferMLABackend()
    backend.configure(heads, R_REAL, P_REAL, page, dtype, SCALE)
    backend.init_cuda_graph(8, width, torch.device("cuda"))
    cache = torch.randn(8 * width + 1, page, R_REAL + P_REAL, dtype=dtype, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    tables = {"q_lat": torch.randn(100, heads * R_REAL, generator=g, device="cuda").to(dtype)}
    tables["q_pe"] = torch.randn(100, heads * P_REAL, generator=g, device="cuda").to(dtype)

    def forward(ids, pos, meta):
        q_lat = tables["q_lat"][ids].view(-1, heads, R_REAL)
        q_pe = tables["q_pe"][ids].view(-1, heads, P_REAL)
        c = q_lat[:, 0] * 0.5  # this step's latent: any function of the token
        k = q_pe[:, 0] * 0.5
        return backend.forward(q_lat, q_pe, c, k, cache, meta, SCALE).flatten(1)

    graphs = DecodeGraphs(forward, backend.plan_graph, 8, width, torch.device("cuda"))
    graphs.capture()
    from meta_helpers import make_meta

    for lens in ([5, 900, 33], [6, 901, 34, 1000, 17]):
        n = len(lens)
        tbl = [[1 + b * width + i for i in range(width)] for b in range(n)]
        slots = [tbl[b][(s - 1) // page] * page + (s - 1) % page for b, s in enumerate(lens)]
        meta = make_meta([1] * n, [s - 1 for s in lens], n, block_tables=tbl, slot_mapping=slots)
        meta = meta_to(meta, torch.device("cuda"))
        ids = torch.arange(n, device="cuda") * 7
        pos = meta.context_lens.long()
        want_cache = cache.clone()
        q_lat = tables["q_lat"][ids].view(-1, heads, R_REAL)
        q_pe = tables["q_pe"][ids].view(-1, heads, P_REAL)
        want = TorchMLABackend().forward(
            q_lat, q_pe, q_lat[:, 0] * 0.5, q_pe[:, 0] * 0.5, want_cache, meta, SCALE
        )
        got = graphs.replay(ids, pos, meta)
        assert rel_err(got, want.flatten(1)) < TOL[dtype], lens
