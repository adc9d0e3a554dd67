"""Shared inputs and checks of the fast `moe` backends' tests (Triton, grouped_mm): random
experts, routings of awkward kinds, poisoned scratch buffers and the comparison against the
torch reference."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from deltaserve.ops.moe.reference import TorchMoE


def experts(num_experts: int, hidden: int, inter: int, seed: int, dtype, device):
    """(w13 [E, 2I, H], w2 [E, H, I], generator) with unit-scale outputs."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return w13.to(device, dtype), w2.to(device, dtype), gen


def random_routing(num_tokens: int, num_experts: int, top_k: int, gen, allowed=None):
    """(ids [T, k] int64 distinct per token, weights [T, k] float32 in (0, 1]); only experts in
    `allowed` (default: all) are chosen."""
    pool = torch.tensor(allowed) if allowed is not None else torch.arange(num_experts)
    rows = [pool[torch.randperm(len(pool), generator=gen)[:top_k]] for _ in range(num_tokens)]
    ids = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.long)
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.05
    return ids, weights


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """Within the block, float tensors from torch.empty are NaN-filled (a row a kernel forgets
    to write shows as NaN in the result)."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def check_against_reference(backend, x, w13, w2, tol: float, **routing) -> torch.Tensor:
    """Run `backend` (scratch buffers poisoned) and the torch reference on the same call;
    assert the max error is within `tol` x the reference's max magnitude. Returns the output."""
    want = TorchMoE()(x, w13, w2, **routing)
    with poisoned_empty():
        got = backend(x, w13, w2, **routing)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert not got.isnan().any(), "a row was never written"
    err = (got.float() - want.float()).abs().max().item() if x.shape[0] else 0.0
    scale = want.float().abs().max().item() + 1e-6 if x.shape[0] else 1.0
    assert err <= tol * scale, f"max error {err:.3e} vs scale {scale:.3e}"
    return got


def shared_terms(num_tokens: int, hidden: int, gen, dtype, device, gated: bool = True):
    """The optional shared-expert arguments of a `moe` call, read through strided views as a
    MoE block passes them (slices of a wider projection output): {shared_out [T, H] with row
    stride H + 5, shared_gate [T, 1] (or absent when not `gated`)}."""
    wide = (torch.randn(num_tokens, hidden + 5, generator=gen) * 2).to(device, dtype)
    terms = {"shared_out": wide[:, :hidden]}
    if gated:
        terms["shared_gate"] = wide[:, hidden + 2 : hidden + 3]
    return terms


def shared_expert_terms(
    num_tokens: int, hidden: int, shared_inter: int, gen, dtype, device, gated: bool = True
):
    """The shared expert given itself, as a MoE block passes it: {shared_gate_up [T, 2Is]
    and shared_gate [T, 1] (absent when not `gated`), both slices of one wider projection
    output (row stride 2Is + 4), shared_down [H, Is]}."""
    wide = torch.randn(num_tokens, 2 * shared_inter + 4, generator=gen) * 2
    down = torch.randn(hidden, shared_inter, generator=gen) / shared_inter**0.5
    wide, down = wide.to(device, dtype), down.to(device, dtype)
    terms = {"shared_gate_up": wide[:, : 2 * shared_inter], "shared_down": down}
    if gated:
        terms["shared_gate"] = wide[:, 2 * shared_inter + 1 : 2 * shared_inter + 2]
    return terms
