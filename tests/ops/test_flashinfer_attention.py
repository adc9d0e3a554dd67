"""FlashInfer paged attention against the torch reference (`pytest -m gpu`).

Random bf16 inputs on page size 16 with shuffled block ids; every cache entry no sequence owns
(other blocks, the null block 0, the tail of each last page) holds NaN, so reading a wrong or
stale slot shows as a non-finite error. Sequence lengths cross page edges (15, 16, 17, ...).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from meta_helpers import make_meta, rel_err

from deltaserve.forward_context import BatchMetadata
from deltaserve.ops.attention.reference import TorchAttentionBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
PAGE = 16
BF16 = torch.bfloat16
TOL = 1e-2  # measured on the H200: <= 3.5e-3 (bf16 output rounding)

# (context_len, q_len), decodes first
CASES = {
    "mixed": (
        [(16, 1), (37, 1), (1, 1), (250, 1), (0, 37), (16, 16), (123, 5), (0, 1), (47, 64)],
        4,
    ),
    "decode": ([(1, 1), (15, 1), (16, 1), (17, 1), (300, 1), (1000, 1), (63, 1)], 7),
    "prefill": ([(0, 100), (15, 1), (31, 33), (0, 16), (200, 77)], 0),
}
# (Hq, Hkv, D): GQA groups 1, 4, 5, 8; head dims 128 and 256
SHAPES = [(8, 8, 128), (16, 4, 256), (40, 8, 128), (32, 4, 128), (8, 8, 256)]


def _to_device(meta: BatchMetadata) -> BatchMetadata:
    moved = {
        f.name: getattr(meta, f.name).to(DEV)
        for f in dataclasses.fields(meta)
        if isinstance(getattr(meta, f.name), torch.Tensor)
    }
    return dataclasses.replace(meta, **moved)


@dataclasses.dataclass
class Case:
    q: torch.Tensor  # [T (+ pad), Hq, D]
    k: torch.Tensor  # [T (+ pad), Hkv, D]
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, PAGE, Hkv, D], NaN where no sequence owns the slot
    v_cache: torch.Tensor
    meta: BatchMetadata
    scale: float


def build_case(
    seqs: list[tuple[int, int]],
    num_decodes: int,
    hq: int,
    hkv: int,
    d: int,
    seed: int = 0,
    table_seed: int | None = None,
    pad_rows: int = 1,
    num_blocks: int | None = None,
    caches: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Case:
    """Random queries, new keys / values and cached prefixes in shuffled blocks (never 0).
    `pad_rows` extra token rows belong to no sequence (slot -1). With `caches`, prefixes are
    written into those (NaN-filled by the caller) instead of fresh caches. `seed` draws the
    values, `table_seed` (default: `seed`) the block tables."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed if table_seed is None else table_seed)
    pages = [math.ceil((c + n) / PAGE) for c, n in seqs]
    if caches is None:
        num_blocks = num_blocks or 1 + sum(pages) + 5
        shape = (num_blocks, PAGE, hkv, d)
        caches = (
            torch.full(shape, float("nan"), dtype=BF16, device=DEV),
            torch.full(shape, float("nan"), dtype=BF16, device=DEV),
        )
    k_cache, v_cache = caches
    perm = (torch.randperm(k_cache.shape[0] - 1, generator=cpu_gen) + 1).tolist()
    tables, slots = [], []
    for (ctx, n), p in zip(seqs, pages):
        table, perm = perm[:p], perm[p:]
        tables.append(table)
        flat = [table[i // PAGE] * PAGE + i % PAGE for i in range(ctx + n)]
        slots.extend(flat[ctx:])
        if ctx:  # the cached prefix
            idx = torch.tensor(flat[:ctx], device=DEV)
            for cache in (k_cache, v_cache):
                prefix = torch.randn(ctx, hkv, d, device=DEV, generator=gen).to(BF16)
                cache.view(-1, hkv, d)[idx] = prefix
    total = sum(n for _, n in seqs)
    rows = total + pad_rows
    meta = make_meta(
        [n for _, n in seqs],
        [c for c, _ in seqs],
        num_decodes,
        block_tables=tables,
        slot_mapping=slots + [-1] * pad_rows,
    )
    q = torch.randn(rows, hq, d, device=DEV, generator=gen).to(BF16)
    k = torch.randn(rows, hkv, d, device=DEV, generator=gen).to(BF16)
    v = torch.randn(rows, hkv, d, device=DEV, generator=gen).to(BF16)
    return Case(q, k, v, k_cache, v_cache, _to_device(meta), d**-0.5)


def reference(case: Case, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, k_cache, v_cache) of the torch reference, on copies of the caches."""
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    out = TorchAttentionBackend().forward(
        case.q, case.k, case.v, kc, vc, case.meta, case.scale, causal
    )
    return out, kc, vc


def check(actual: torch.Tensor, expected: torch.Tensor, meta: BatchMetadata) -> None:
    """Per-sequence relative error, so a failure names the sequence."""
    qsl = meta.query_start_loc_cpu
    for b in range(meta.num_seqs):
        s, e = qsl[b], qsl[b + 1]
        err = rel_err(actual[s:e], expected[s:e])
        ctx = meta.context_lens_cpu[b]
        assert err < TOL, f"sequence {b} (context {ctx}, {e - s} new): rel err {err:.2e}"


@pytest.fixture(scope="module")
def flashinfer_backend_cls():
    pytest.importorskip("flashinfer")
    from deltaserve.ops.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend


@pytest.mark.parametrize("tensor_cores", [True, False], ids=["tc", "cuda-cores"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv-d{s[2]}")
def test_matches_reference(flashinfer_backend_cls, shape, case_name, causal, tensor_cores):
    hq, hkv, d = shape
    seqs, nd = CASES[case_name]
    case = build_case(seqs, nd, hq, hkv, d, seed=hq + d)
    expected, kc_ref, vc_ref = reference(case, causal)
    backend = flashinfer_backend_cls(use_tensor_cores=tensor_cores)
    backend.plan(case.meta)
    out = backend.forward(
        case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale, causal
    )
    torch.cuda.synchronize()
    assert out.shape == case.q.shape and out.dtype == BF16
    check(out, expected, case.meta)
    total = case.meta.query_start_loc_cpu[-1]
    assert torch.equal(out[total:], torch.zeros_like(out[total:])), "padding rows not zero"
    # every owned slot holds the reference's bits; block 0 (the skip target) is scratch
    for mine, ref in ((case.k_cache, kc_ref), (case.v_cache, vc_ref)):
        torch.testing.assert_close(mine[1:], ref[1:], rtol=0, atol=0, equal_nan=True)


def test_plans_once_per_step(flashinfer_backend_cls, monkeypatch):
    """Four layers (own caches) share one plan per wrapper; a second step plans again."""
    import flashinfer

    calls = {"decode": 0, "prefill": 0}
    for name, cls in (
        ("decode", flashinfer.BatchDecodeWithPagedKVCacheWrapper),
        ("prefill", flashinfer.BatchPrefillWithPagedKVCacheWrapper),
    ):
        original = cls.plan

        def counted(self, *args, _orig=original, _name=name, **kwargs):
            calls[_name] += 1
            return _orig(self, *args, **kwargs)

        monkeypatch.setattr(cls, "plan", counted)

    hq, hkv, d = 16, 4, 128
    seqs, nd = CASES["mixed"]
    backend = flashinfer_backend_cls()
    backend.configure(hq, hkv, d, PAGE, BF16)
    for step in range(2):
        # one layout (block tables) per step, different values per layer
        layers = [
            build_case(seqs, nd, hq, hkv, d, seed=10 * step + i, table_seed=step) for i in range(4)
        ]
        meta = layers[0].meta
        for layer in layers:
            layer.meta = meta
        backend.plan(meta)
        assert calls == {"decode": step + 1, "prefill": step + 1}
        for layer in layers:
            expected, _, _ = reference(layer, True)
            out = backend.forward(
                layer.q, layer.k, layer.v, layer.k_cache, layer.v_cache, meta, layer.scale
            )
            check(out, expected, meta)
        assert calls == {"decode": step + 1, "prefill": step + 1}


@pytest.mark.parametrize(
    "shape,tensor_cores",
    [((16, 4, 256), True), ((16, 4, 256), False), ((40, 8, 128), True)],
    ids=["16q4kv-d256-tc", "16q4kv-d256-cuda-cores", "40q8kv-d128-tc"],
)
def test_cuda_graph_decode(flashinfer_backend_cls, shape, tensor_cores):
    """Capture one decode step of a padded batch, then replay it on new steps (new lengths,
    block tables and values) after `plan_graph` / `plan`; real rows match the reference."""
    hq, hkv, d = shape
    bs, real, max_blocks = 8, 5, 64
    num_blocks = 1 + real * max_blocks + 8
    cache_shape = (num_blocks, PAGE, hkv, d)
    k_cache = torch.full(cache_shape, float("nan"), dtype=BF16, device=DEV)
    v_cache = torch.full(cache_shape, float("nan"), dtype=BF16, device=DEV)
    steps = [[5, 16, 31, 200, 47], [6, 17, 32, 1000, 48], [300, 1, 15, 64, 999]]

    def step_case(i: int) -> tuple[Case, BatchMetadata]:
        """Case of the real rows, and the padded metadata of the graph (bs rows)."""
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
        seqs = [(c, 1) for c in steps[i]]
        case = build_case(
            seqs, real, hq, hkv, d, seed=100 + i, pad_rows=0, caches=(k_cache, v_cache)
        )
        tables = [t + [0] * (max_blocks - len(t)) for t in case.meta.block_tables.tolist()]
        tables += [[0] * max_blocks] * (bs - real)  # padded rows: the null block
        padded = make_meta(
            [1] * bs,
            steps[i] + [0] * (bs - real),  # padded rows: seq_len 1 on the null block
            bs,
            state_slots=list(range(1, real + 1)) + [0] * (bs - real),
            block_tables=tables,
            slot_mapping=case.meta.slot_mapping.tolist() + [-1] * (bs - real),
        )
        return case, _to_device(padded)

    backend = flashinfer_backend_cls(use_tensor_cores=tensor_cores)
    backend.configure(hq, hkv, d, PAGE, BF16)
    backend.init_cuda_graph(16, max_blocks, DEV)

    case, static = step_case(0)
    q_s = torch.zeros(bs, hq, d, dtype=BF16, device=DEV)
    k_s = torch.zeros(bs, hkv, d, dtype=BF16, device=DEV)
    v_s = torch.zeros(bs, hkv, d, dtype=BF16, device=DEV)

    def load(case: Case, padded: BatchMetadata) -> None:
        for dst, src in ((q_s, case.q), (k_s, case.k), (v_s, case.v)):
            dst[:real].copy_(src)
        for f in ("slot_mapping", "seq_lens", "context_lens", "block_tables", "query_start_loc"):
            getattr(static, f).copy_(getattr(padded, f))
        static.seq_lens_cpu = padded.seq_lens_cpu
        static.context_lens_cpu = padded.context_lens_cpu

    load(case, static)
    backend.plan_graph(static, bs)
    backend.forward(q_s, k_s, v_s, k_cache, v_cache, static, case.scale)  # warm-up, eager
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = backend.forward(q_s, k_s, v_s, k_cache, v_cache, static, case.scale)

    for i in range(len(steps)):
        case, padded = step_case(i)
        expected, _, _ = reference(case, True)
        load(case, padded)
        if i < 2:
            backend.plan_graph(static, bs)
        else:
            backend.plan(static)  # all decodes, num_seqs == a captured size: graph plan
        out_s.fill_(float("nan"))  # poison: the replay must write every real row
        graph.replay()
        torch.cuda.synchronize()
        check(out_s[:real], expected, case.meta)


def test_page_table_host_arrays_are_pinned_and_exact():
    """build_page_table's host arrays (what FlashInfer's plan copies to the device) are in
    page-locked memory for a CUDA step, so those copies do not wait for the GPU, and hold the
    CSR view: query rows from 0, pages per sequence, tokens in each last page, padding rows on
    the null block."""
    pytest.importorskip("flashinfer")
    from deltaserve.ops.attention.flashinfer_backend import build_page_table

    lens = [(16, 1), (37, 1), (0, 20)]  # (context, query): 17, 38 and 20 tokens
    tables = [[3, 4], [5, 6, 7], [8, 9]]
    slots = (
        [4 * PAGE, 7 * PAGE + 5]
        + [8 * PAGE + i for i in range(16)]
        + [9 * PAGE + i for i in range(4)]
    )
    meta = make_meta(
        [q for _, q in lens], [c for c, _ in lens], 2, block_tables=tables, slot_mapping=slots
    )
    table = build_page_table(_to_device(meta), 0, 3, PAGE, pad_to=5)
    for name in ("qo_indptr", "kv_indptr", "last_page_len"):
        host = getattr(table, name)
        assert host.device.type == "cpu" and host.is_pinned(), name
    assert table.qo_indptr.tolist() == [0, 1, 2, 22, 23, 24]
    assert table.kv_indptr.tolist() == [0, 2, 5, 7, 8, 9]
    assert table.last_page_len.tolist() == [1, 6, 4, 1, 1]
    assert table.kv_indices.is_cuda
    assert table.kv_indices.tolist() == [3, 4, 5, 6, 7, 8, 9, 0, 0]
