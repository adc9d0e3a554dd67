"""CUDA graphs of the MTP head's greedy chain: one graph per batch bucket, for a fixed number
of drafts k and a fixed block-table width (the context length the graphs serve).

The captured body is `MTPDrafter.chain(...)` (its tokens) over static buffers (last tokens,
the target's hidden states, positions, step-0 slots, block tables); a proposal of R rows
copies its inputs into the first R rows and replays the smallest bucket >= R. Padding rows
have position 0, slot -1 (step 0 writes nothing) and the null block: they attend only to their
own chain keys. Insertion of exact positions (`observe`) runs eagerly, outside the graphs.
The capture, buckets and replay are spec/bucket_graphs.py's.
"""

from __future__ import annotations

import torch

from deltaserve.spec.bucket_graphs import BucketGraphs
from deltaserve.spec.mtp.drafter import MTPDrafter, ragged_meta


class ChainGraphs(BucketGraphs):
    """Greedy chain graphs of `drafter` for up to `max_batch` rows of `num_drafts` drafts
    whose blocks fit `max_blocks`."""

    what = "MTP chain"

    def __init__(
        self,
        drafter: MTPDrafter,
        max_batch: int,
        num_drafts: int,
        max_blocks: int,
        emulate: bool = False,
    ) -> None:
        weight = drafter.head.fc.weight
        device = weight.device
        super().__init__(device, max_batch, num_drafts, max_blocks, emulate)
        self.drafter = drafter
        self.last = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.hidden = torch.zeros(max_batch, weight.shape[0], dtype=weight.dtype, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slots = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        # the layout the layers see (host lists of a bucket's rows; the chain ignores them)
        self.metas = {
            b: ragged_meta([1] * b, [0] * b, self.slots[:b], self.tables[:b]) for b in self.buckets
        }

    def _body(self, b: int) -> torch.Tensor:
        tokens, _ = self.drafter.chain(
            self.last[:b],
            self.hidden[:b],
            self.positions[:b],
            self.slots[:b],
            self.tables[:b],
            self.num_drafts,
            self.metas[b],
        )
        return tokens  # [b, k]

    def replay(
        self,
        last_tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """Greedy drafts [R, k] of R rows (R <= max_batch, tables at most max_blocks wide)."""
        R, width = block_tables.shape
        b = self._bucket_for(R, width)
        self.last[:R].copy_(last_tokens)
        self.hidden[:R].copy_(hidden)
        self.positions[:R].copy_(positions)
        self.positions[R:b].zero_()
        self.slots[:R].copy_(slots)
        self.slots[R:b].fill_(-1)
        self.tables[:R, :width].copy_(block_tables)
        self.tables[:R, width:].zero_()
        self.tables[R:b].zero_()
        return self._run(b, R)
