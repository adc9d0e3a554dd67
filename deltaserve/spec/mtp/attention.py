"""Attention of an MTP draft chain: each step is one query per row over the row's cached MTP
context plus the chain's own keys so far (not cached).

A chain for a row whose target has computed positions 0 .. n - 1 runs at positions
n - 1, n, ..., n + k - 2. Its step 0 (position n - 1) is exact (the accepted token t_n and
the target's h_{n - 1}): its K / V are also written into the MTP cache at n - 1 (`write_slots`).
Steps j >= 1 read drafted tokens, so their K / V stay local: the target may not even hold a
block for those positions yet, and after verification the accepted positions are recomputed
from the target's hidden states (MTPProposer.observe).

Query j of a row sees the cached context 0 .. ctx_len - 1 (ctx_len = n - 1) and chain keys
0 .. j: everything, causally, since it is the newest position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.forward_context import BatchMetadata
from deltaserve.ops.attention import AttentionBackend
from deltaserve.ops.attention.kv_writer import write_kv
from deltaserve.spec.draft_kv import gather_context


class ChainAttention(AttentionBackend):
    """The attention backend of one MTP draft chain (one instance per chain; the MTP head has
    one attention layer). Device tensors only: no host sync."""

    name = "mtp_chain"

    def __init__(
        self,
        block_tables: torch.Tensor,
        ctx_lens: torch.Tensor,
        write_slots: torch.Tensor | None = None,
    ) -> None:
        """block_tables [R, nb] int, ctx_lens [R] int (cached positions per row), write_slots
        [R] int64: where the first step's K / V go (None: nowhere)."""
        self.block_tables = block_tables
        self.ctx_lens = ctx_lens
        self.write_slots = write_slots
        self.keys: list[torch.Tensor] = []  # per step [R, Hkv, D]
        self.values: list[torch.Tensor] = []

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: BatchMetadata,
        scale: float,
        causal: bool = True,
    ) -> torch.Tensor:
        """q [R, Hq, D], k / v [R, Hkv, D] of this chain step -> [R, Hq, D] (`meta` unused)."""
        if self.write_slots is not None:  # step 0: exact, cached
            write_kv(k, v, k_cache, v_cache, self.write_slots)
            self.write_slots = None
        self.keys.append(k)
        self.values.append(v)
        R, Hq, D = q.shape
        Hkv = k.shape[1]
        ck, cv = gather_context(k_cache, v_cache, self.block_tables, self.ctx_lens)
        S, J = ck.shape[1], len(self.keys)
        keys = torch.cat([ck, torch.stack(self.keys, 1).to(ck.dtype)], dim=1)  # [R, S + J, Hkv, D]
        values = torch.cat([cv, torch.stack(self.values, 1).to(cv.dtype)], dim=1)
        group = Hq // Hkv
        keys = keys.repeat_interleave(group, dim=2).transpose(1, 2)  # [R, Hq, S + J, D]
        values = values.repeat_interleave(group, dim=2).transpose(1, 2)
        ctx_ok = torch.arange(S, device=q.device)[None, :] < self.ctx_lens.long()[:, None]
        vis = torch.cat([ctx_ok, ctx_ok.new_ones(R, J)], dim=1)[:, None, None, :]  # [R,1,1,S+J]
        query = q.reshape(R, Hq, 1, D).to(keys.dtype)
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=vis, scale=scale)
        return o.reshape(R, Hq, D).to(q.dtype)  # [R, Hq, 1, D] -> [R, Hq, D]
