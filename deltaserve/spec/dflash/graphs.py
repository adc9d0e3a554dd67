"""CUDA graphs of the drafter's greedy block forward: one graph per batch bucket, for a fixed
number of drafts k and a fixed block-table width (the context length the graphs serve).

The captured body is `DFlashDrafter.draft_logits(...).argmax(-1)` over static buffers
(last tokens, context lengths, block tables); a step of R rows copies its inputs into the first
R rows and replays the smallest bucket >= R. Padding rows have context length 0 and block table
0 (the null block), so they attend only to their own block and touch no cache (the block
forward writes nothing). Context insertion runs eagerly, outside the graphs.
The capture, buckets and replay are spec/bucket_graphs.py's.
"""

from __future__ import annotations

import torch

from deltaserve.spec.bucket_graphs import BucketGraphs
from deltaserve.spec.dflash.drafter import DFlashDrafter


class DrafterGraphs(BucketGraphs):
    """Greedy block-forward graphs of `drafter` for up to `max_batch` rows of `num_drafts`
    drafts whose context fits `max_blocks` KV blocks."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        max_batch: int,
        num_drafts: int,
        max_blocks: int,
        emulate: bool = False,
    ) -> None:
        device = drafter.model.fc.weight.device
        super().__init__(device, max_batch, num_drafts, max_blocks, emulate)
        self.drafter = drafter
        self.last = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.ctx_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)

    def _body(self, b: int) -> torch.Tensor:
        logits = self.drafter.draft_logits(
            self.last[:b], self.ctx_lens[:b], self.tables[:b], self.num_drafts
        )
        return logits.argmax(dim=-1)  # [b, k]

    def replay(
        self, last_tokens: torch.Tensor, ctx_lens: torch.Tensor, block_tables: torch.Tensor
    ) -> torch.Tensor:
        """Greedy drafts [R, k] of R rows (R <= max_batch, tables at most max_blocks wide)."""
        R, width = block_tables.shape
        b = self._bucket_for(R, width)
        self.last[:R].copy_(last_tokens)
        self.ctx_lens[:R].copy_(ctx_lens)
        self.ctx_lens[R:b].zero_()
        self.tables[:R, :width].copy_(block_tables)
        self.tables[:R, width:].zero_()
        self.tables[R:b].zero_()
        return self._run(b, R)
