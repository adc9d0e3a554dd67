"""Builds `BatchMetadata` on CPU for the kernel tests (what the model runner does on device)."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from deltaserve.forward_context import BatchMetadata


def meta_to(meta: BatchMetadata, device: torch.device) -> BatchMetadata:
    """A copy of `meta` with its device tensors on `device`."""
    fields = ("slot_mapping", "query_start_loc", "seq_lens", "context_lens", "block_tables")
    fields += ("state_slots", "has_initial_state")
    return dataclasses.replace(meta, **{f: getattr(meta, f).to(device) for f in fields})


def make_meta(
    q_lens: list[int],
    context_lens: list[int],
    num_decodes: int = 0,
    *,
    state_slots: list[int] | None = None,
    has_initial_state: list[bool] | None = None,
    block_tables: list[list[int]] | None = None,
    slot_mapping: list[int] | None = None,
    decode_query_len: int = 1,
) -> BatchMetadata:
    """Metadata for sequences with `q_lens[b]` new tokens on top of `context_lens[b]` cached ones.

    The first `num_decodes` sequences are decode rows of `decode_query_len` tokens each.
    Defaults: state slots 1..B (slot 0 is the null slot), has_initial_state = context_lens > 0,
    block tables of one block 0, slot mapping of -1 (skip) for every token.
    """
    assert len(q_lens) == len(context_lens)
    assert all(q == decode_query_len for q in q_lens[:num_decodes]), (
        "decode rows have exactly decode_query_len new tokens"
    )
    num_seqs = len(q_lens)
    query_start_loc = [0, *itertools.accumulate(q_lens)]
    seq_lens = [c + q for c, q in zip(context_lens, q_lens, strict=True)]
    if state_slots is None:
        state_slots = list(range(1, num_seqs + 1))
    if has_initial_state is None:
        has_initial_state = [c > 0 for c in context_lens]
    if block_tables is None:
        block_tables = [[0] for _ in range(num_seqs)]
    width = max([len(row) for row in block_tables] + [1])
    padded = [row + [0] * (width - len(row)) for row in block_tables]
    if slot_mapping is None:
        slot_mapping = [-1] * query_start_loc[-1]
    return BatchMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=torch.tensor(padded, dtype=torch.int32).reshape(num_seqs, width),
        state_slots=torch.tensor(state_slots, dtype=torch.int64),
        has_initial_state=torch.tensor(has_initial_state, dtype=torch.bool),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        context_lens_cpu=list(context_lens),
        state_slots_cpu=list(state_slots),
        num_decodes=num_decodes,
        decode_query_len=decode_query_len,
    )


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (inf if anything is not finite)."""
    actual, expected = actual.double(), expected.double()
    if not (torch.isfinite(actual).all() and torch.isfinite(expected).all()):
        return float("inf")
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def gdn_layer(kernels, x, a, b, weight, A_log, dt_bias, conv_pool, ssm_pool, meta, heads):
    """One GDN layer's kernel calls, as the model makes them: conv1d over x [T, conv_dim], then
    the delta rule on its [q | k | v] split. heads = (num_k_heads, num_v_heads, dk, dv)."""
    num_k_heads, num_v_heads, dk, dv = heads
    key_dim = num_k_heads * dk
    y = kernels.conv1d(x, weight, conv_pool, meta)
    qc, kc, vc = y.split([key_dim, key_dim, num_v_heads * dv], dim=1)
    return kernels.gated_delta_rule(
        qc.unflatten(1, (num_k_heads, dk)),
        kc.unflatten(1, (num_k_heads, dk)),
        vc.unflatten(1, (num_v_heads, dv)),
        a,
        b,
        A_log,
        dt_bias,
        ssm_pool,
        meta,
    )
