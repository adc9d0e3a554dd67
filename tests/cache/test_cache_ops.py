"""Cache operations carried by a scheduled batch, applied to CPU tensors, with the reference row
copy and with the Triton one (`fused.copy_rows`: Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.cache.ops import CopySlot, TruncateBlocks, apply_cache_ops
from deltaserve.cache.spec import AttentionSpec, GDNSpec
from deltaserve.ops.fused import TorchFusedOps, triton_unavailable_reason


def copiers() -> list:
    out = [None, TorchFusedOps()]
    if triton_unavailable_reason("cpu") is None:
        from deltaserve.ops.fused.triton_ops import TritonFusedOps

        out.append(TritonFusedOps())
    return out


COPIERS = pytest.mark.parametrize(
    "fused", copiers(), ids=lambda f: "default" if f is None else f.name
)


def caches(num_slots=4, num_blocks=5):
    specs = [GDNSpec(1, 2, 3, 4, 3), AttentionSpec(2, 1, 4), GDNSpec(1, 2, 3, 4, 3)]
    gen = torch.Generator().manual_seed(0)
    out = []
    for s in specs:
        units = num_slots if s.pool == "slots" else num_blocks
        shapes = s.tensors(units, 2, torch.float32, torch.float32)
        out.append({n: torch.randn(shape, generator=gen) for n, (shape, _) in shapes.items()})
    return specs, out


@COPIERS
def test_copy_slot_copies_every_state_tensor_row_and_nothing_else(fused):
    specs, cs = caches()
    before = [{n: t.clone() for n, t in c.items()} for c in cs]
    apply_cache_ops([CopySlot(src=1, dst=3), CopySlot(src=2, dst=2)], specs, cs, fused)
    for spec, c, b in zip(specs, cs, before, strict=True):
        for name, t in c.items():
            if spec.pool == "slots":
                assert torch.equal(t[3], b[name][1]), name
                assert torch.equal(t[:3], b[name][:3]), name  # other slots untouched
            else:
                assert torch.equal(t, b[name]), name  # KV blocks untouched


@COPIERS
def test_ops_apply_in_order(fused):
    specs, cs = caches()
    orig1, orig2 = cs[0]["ssm_state"][1].clone(), cs[0]["ssm_state"][2].clone()
    apply_cache_ops([CopySlot(1, 3), CopySlot(2, 1), CopySlot(3, 2)], specs, cs, fused)  # swap
    assert torch.equal(cs[0]["ssm_state"][1], orig2)
    assert torch.equal(cs[0]["ssm_state"][2], orig1)


def test_truncate_needs_no_tensor_work_and_unknown_ops_fail():
    specs, cs = caches()
    before = [{n: t.clone() for n, t in c.items()} for c in cs]
    apply_cache_ops([TruncateBlocks(seq_id=7, num_tokens=3)], specs, cs)
    assert all(torch.equal(t, b[n]) for c, b in zip(cs, before) for n, t in c.items())
    with pytest.raises(TypeError, match="unknown cache op"):
        apply_cache_ops(["copy"], specs, cs)


@COPIERS
def test_batched_copies_equal_one_by_one(fused):
    """Runs of independent copies are batched (one copy_rows call); any sequence of copies gives
    what applying them one at a time gives."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        specs, cs = caches(num_slots=7)
        want = [{n: t.clone() for n, t in c.items()} for c in cs]
        pairs = torch.randint(0, 7, (6, 2), generator=gen).tolist()
        ops = [CopySlot(src, dst) for src, dst in pairs]
        for op in ops:  # the plain reference: one copy at a time
            for spec, c in zip(specs, want):
                if spec.pool == "slots" and op.src != op.dst:
                    for t in c.values():
                        t[op.dst] = t[op.src].clone()
        apply_cache_ops(ops, specs, cs, fused)
        for c, w in zip(cs, want):
            for name, t in c.items():
                assert torch.equal(t, w[name]), (ops, name)
