"""The one KV writer (`deltaserve.ops.attention.kv_writer.write_kv`): slot -1 skips the token on
every path (torch reference and Triton kernel, the latter in Triton's interpreter on CPU), and
every attention backend's forward leaves the cache untouched for skipped tokens."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import HAS_TRITON, kernel_device, requires_triton

from deltaserve.ops.attention.kv_writer import write_kv, write_kv_torch

IMPLS = [
    "torch",
    pytest.param("triton", marks=requires_triton),
]
SLOT_PATTERNS = [
    [-1, 0, 5, -1, 9, 2, -1],  # skipped tokens first, middle and last; slot 0 written
    [3, -1, -1, 0],
    [5, 0, -1],  # a skipped token after slot 0's writer must not clobber it
    [-1, 4],
    [-1, -1, -1],  # nothing to write at all
    [11],
]


def poisoned_caches(num_blocks, page, heads, dim, dtype, device, seed=0):
    """K and V caches of random values with NaN sprinkled in (slot 0 included), so a stray
    write shows as a changed bit and a stray read of the cache as a NaN."""
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(2):
        c = torch.randn(num_blocks, page, heads, dim, generator=gen)
        c[torch.rand(c.shape, generator=gen) < 0.2] = float("nan")
        c[0, 0] = float("nan")
        caches.append(c.to(device, dtype))
    return caches


def expected(k, v, k_cache, v_cache, slot_mapping):
    """Token-by-token writes of the valid slots (plain Python), on clones."""
    want_k, want_v = k_cache.clone(), v_cache.clone()
    page = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping):
        if slot >= 0:
            want_k[slot // page, slot % page] = k[i].to(k_cache.dtype)
            want_v[slot // page, slot % page] = v[i].to(v_cache.dtype)
    return want_k, want_v


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("slot_mapping", SLOT_PATTERNS)
def test_minus_one_skips(impl, slot_mapping):
    dev = kernel_device() if impl == "triton" else torch.device("cpu")
    k_cache, v_cache = poisoned_caches(3, 4, 2, 8, torch.float32, dev)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(len(slot_mapping), 2, 8, generator=gen).to(dev)
    v = torch.randn(len(slot_mapping), 2, 8, generator=gen).to(dev)
    want_k, want_v = expected(k, v, k_cache, v_cache, slot_mapping)
    slots = torch.tensor(slot_mapping, dtype=torch.int64, device=dev)
    write_kv(k, v, k_cache, v_cache, slots, impl=impl)
    torch.testing.assert_close(k_cache, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "heads, dim, dtype",
    [(3, 24, torch.float32), (1, 16, torch.bfloat16), (5, 8, torch.float16)],
)
def test_awkward_shapes_strides_and_extra_rows(impl, heads, dim, dtype):
    """Head counts and dims that are not powers of two, a cache dtype other than k's, k / v as
    strided views of a wider projection, and rows past the slot mapping (ignored)."""
    dev = kernel_device() if impl == "triton" else torch.device("cpu")
    k_cache, v_cache = poisoned_caches(4, 8, heads, dim, dtype, dev, seed=heads)
    gen = torch.Generator().manual_seed(heads)
    slot_mapping = [9, -1, 31, 0, -1, 17]
    rows = len(slot_mapping) + 2  # two trailing rows with no slot
    proj = torch.randn(rows, 2 * heads * dim + 5, generator=gen)
    # float32 values exact in the cache dtype: Triton's interpreter rounds casts unlike torch
    proj = proj.to(dtype).to(dev, torch.float32)
    k = proj[:, : heads * dim].unflatten(1, (heads, dim))  # [rows, heads, dim], row stride wider
    v = proj[:, heads * dim + 5 :].unflatten(1, (heads, dim))
    want_k, want_v = expected(k, v, k_cache, v_cache, slot_mapping)
    slots = torch.tensor(slot_mapping, dtype=torch.int64, device=dev)
    write_kv(k, v, k_cache, v_cache, slots, impl=impl)
    torch.testing.assert_close(k_cache, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0, equal_nan=True)


def test_auto_and_unknown_impl():
    k_cache, v_cache = poisoned_caches(2, 4, 1, 8, torch.float32, "cpu")
    k, v = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    slots = torch.tensor([-1, 6])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_torch(k, v, want_k, want_v, slots)
    write_kv(k, v, k_cache, v_cache, slots)  # auto: torch on a CPU cache
    torch.testing.assert_close(k_cache, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="unknown KV writer"):
        write_kv(k, v, k_cache, v_cache, slots, impl="cuda")


def _backends():
    from deltaserve.ops.attention.reference import TorchAttentionBackend

    backends = [TorchAttentionBackend()]
    if HAS_TRITON:
        from deltaserve.ops.attention.triton_backend import TritonAttentionBackend

        backends.append(TritonAttentionBackend())
    return backends


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)
def test_backend_forward_skips_minus_one(backend):
    """A backend's forward over a batch whose tokens all have slot -1 (a decode row of 3 tokens
    and a prefill) changes no cache bit, the null block's included."""
    from test_triton_attention import make_case

    dev = kernel_device() if backend.name != "torch" else torch.device("cpu")
    q, k, v, k_cache, v_cache, meta = make_case(
        [(9, 3), (5, 4)], 1, 4, 2, 16, 8, torch.float32, device=dev, decode_query_len=3
    )
    written = meta.slot_mapping.clone()
    meta.slot_mapping = torch.full_like(meta.slot_mapping, -1)
    before = k_cache.clone(), v_cache.clone()
    backend.forward(q, k, v, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(k_cache, before[0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, before[1], rtol=0, atol=0, equal_nan=True)
    # and with the real slots the same forward does write (the check above can fail)
    meta.slot_mapping = written
    backend.forward(q, k, v, k_cache, v_cache, meta, 0.3)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    torch.testing.assert_close(flat_k[written], k, rtol=0, atol=0)
