"""The Triton row copy of state pools (ops/fused/copy_rows.py) against the torch reference:
several tensors of mixed dtypes and row sizes in one call (4-, 2- and 1-byte words), rows copied
bit for bit (NaN payloads included), other rows untouched. CPU: Triton's interpreter; GPU: the
same tests under `pytest -m gpu` plus a 9B-shaped restore."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import kernel_device, requires_triton

from deltaserve.ops.fused import reference

pytestmark = requires_triton


def pools(device: torch.device, rows: int = 9) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = [
        torch.randn(rows, 3, 40, generator=gen),  # fp32: 4-byte words
        torch.randn(rows, 5, 3, generator=gen).to(torch.bfloat16),  # 30 bytes: 2-byte words
        torch.randn(rows, 3, 40, generator=gen),  # a second tensor of the first row size
        torch.randint(-100, 100, (rows, 7), generator=gen, dtype=torch.int8),  # 7 bytes
        torch.randn(rows, 4100, generator=gen),  # a row of several blocks
    ]
    out[0][2, 0, 0] = float("nan")
    return [t.to(device) for t in out]


@pytest.mark.parametrize("pairs", [[(2, 0)], [(1, 3), (2, 8), (7, 0)], [(0, 1), (4, 5)]])
def test_copy_rows_equals_reference(pairs):
    from deltaserve.ops.fused.copy_rows import copy_rows

    device = kernel_device()
    got, want = pools(device), pools(device)
    src = torch.tensor([s for s, _ in pairs], device=device)
    dst = torch.tensor([d for _, d in pairs], device=device)
    copy_rows(got, src, dst)
    reference.copy_rows(want, src, dst)
    for g, w, before in zip(got, want, pools(device), strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
        for s, d in pairs:
            assert torch.equal(g[d].view(torch.uint8), before[s].view(torch.uint8))
        kept = [r for r in range(g.shape[0]) if r not in {d for _, d in pairs}]
        assert torch.equal(g[kept].view(torch.uint8), before[kept].view(torch.uint8))


def test_copy_rows_rejects_a_strided_pool():
    from deltaserve.ops.fused.copy_rows import copy_rows

    device = kernel_device()
    t = torch.zeros(4, 6, device=device)[:, :3]
    idx = torch.tensor([0], device=device)
    with pytest.raises(ValueError, match="contiguous"):
        copy_rows([t], idx, idx + 1)


@pytest.mark.gpu
def test_gpu_restore_at_9b_shapes():
    """A prefix-cache restore of 3 sequences at Qwen3.5-9B shapes: 24 GDN layers' conv pools
    [rows, 8192, 3] bf16 and SSM pools [rows, 32, 128, 128] fp32, one call."""
    from deltaserve.ops.fused.copy_rows import copy_rows

    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = []
    for _ in range(24):
        tensors.append(torch.randn(8, 8192, 3, device="cuda", generator=gen).to(torch.bfloat16))
        tensors.append(torch.randn(8, 32, 128, 128, device="cuda", generator=gen))
    want = [t.clone() for t in tensors]
    src = torch.tensor([5, 6, 7], device="cuda")
    dst = torch.tensor([0, 2, 1], device="cuda")
    copy_rows(tensors, src, dst)
    reference.copy_rows(want, src, dst)
    assert all(torch.equal(a, b) for a, b in zip(tensors, want, strict=True))
