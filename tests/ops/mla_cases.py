"""Random paged-latent MLA cases for the MLA kernel tests (CPU interpreter and GPU)."""

from __future__ import annotations

import dataclasses
import math

import torch
from kernel_helpers import kernel_device
from meta_helpers import make_meta, meta_to

from deltaserve.forward_context import BatchMetadata
from deltaserve.ops.mla.reference import paged_mla


@dataclasses.dataclass
class MLACase:
    q_lat: torch.Tensor  # [T, H, R]
    q_pe: torch.Tensor  # [T, H, P]
    c_kv: torch.Tensor  # [T, R] this step's latents
    k_pe: torch.Tensor  # [T, P]
    cache: torch.Tensor  # [num_blocks, page, R + P]; unwritten slots NaN
    meta: BatchMetadata


def make_mla_case(
    seqs: list[tuple[int, int]],
    num_decodes: int,
    num_heads: int,
    r: int,
    p: int,
    page: int,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    device: torch.device | None = None,
    table_width: int | None = None,
    decode_query_len: int = 1,
    spare_blocks: int = 3,
) -> MLACase:
    """A paged latent cache (blocks in shuffled order, unwritten slots NaN) holding each
    sequence's `context_len` cached latents, plus the step's queries, latents and metadata.
    `seqs` lists (context_len, q_len) per sequence."""
    device = device or kernel_device()
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [math.ceil((c + q) / page) for c, q in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen, device=device).tolist()
    cache = torch.full((num_blocks, page, r + p), float("nan"), dtype=dtype, device=device)
    flat = cache.view(-1, r + p)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device).to(dtype)

    tables, slot_mapping = [], []
    for (context_len, q_len), n in zip(seqs, blocks_per_seq, strict=True):
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        pos = torch.arange(context_len + q_len, device=device)
        slots = torch.tensor(table, device=device, dtype=torch.long)[pos // page] * page
        slots = slots + pos % page  # [S]
        flat[slots[:context_len]] = randn(context_len, r + p)
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
    t = sum(q for _, q in seqs)
    return MLACase(
        q_lat=randn(t, num_heads, r),
        q_pe=randn(t, num_heads, p),
        c_kv=randn(t, r),
        k_pe=randn(t, p),
        cache=cache,
        meta=meta_to(meta, device),
    )


def reference(case: MLACase, scale: float, cache: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference in float32 over the (already written) cache; [T, H, R] float32."""
    return paged_mla(
        case.q_lat.float(),
        case.q_pe.float(),
        (case.cache if cache is None else cache).float(),
        case.meta.query_start_loc_cpu,
        case.meta.seq_lens_cpu,
        case.meta.block_tables,
        scale,
    )
