"""CUDA graphs of the drafter's greedy block forward: one graph per batch bucket, for a fixed
number of drafts k and a fixed block-table width (the context length the graphs serve).

The captured body is `DFlashDrafter.draft_logits(...).argmax(-1)` over static buffers
(last tokens, context lengths, block tables); a step of R rows copies its inputs into the first
R rows and replays the smallest bucket >= R. Padding rows have context length 0 and block table
0 (the null block), so they attend only to their own block and touch no cache (the block
forward writes nothing). Context insertion runs eagerly, outside the graphs.

With `emulate` (DELTASERVE_EMULATE_CUDA_GRAPHS=1) nothing is captured: a replay runs the body
eagerly on the static buffers of its bucket, on any device (the bookkeeping in CPU tests).
"""

from __future__ import annotations

import torch

from deltaserve.spec.dflash.drafter import DFlashDrafter


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to max_batch (and max_batch itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 8))
    if max_batch not in sizes:
        sizes.append(max_batch)
    return sorted(set(sizes))


class DrafterGraphs:
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
        self.drafter = drafter
        self.num_drafts = num_drafts
        self.max_blocks = max_blocks
        self.emulate = emulate
        self.replays: dict[int, int] = {}  # bucket -> replays so far
        device = drafter.model.fc.weight.device
        if device.type != "cuda" and not emulate:
            raise ValueError(f"drafter CUDA graphs need a CUDA device, the drafter is on {device}")
        self.buckets = batch_buckets(max_batch)
        self.last = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.ctx_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _body(self, b: int) -> torch.Tensor:
        logits = self.drafter.draft_logits(
            self.last[:b], self.ctx_lens[:b], self.tables[:b], self.num_drafts
        )
        return logits.argmax(dim=-1)  # [b, k]

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first (a no-op when emulated)."""
        if self.emulate:
            return
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):  # largest first: smaller ones reuse its pool
                for _ in range(2):  # warm up (lazy inits, autotuning) outside the capture
                    self._body(b)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[b] = self._body(b)
                pool = graph.pool() if pool is None else pool
                self.graphs[b] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def replay(
        self, last_tokens: torch.Tensor, ctx_lens: torch.Tensor, block_tables: torch.Tensor
    ) -> torch.Tensor:
        """Greedy drafts [R, k] of R rows (R <= max_batch, tables at most max_blocks wide)."""
        R, width = block_tables.shape
        b = self.bucket(R)
        if b is None or width > self.max_blocks:
            raise ValueError(
                f"{R} rows of {width} blocks do not fit the drafter graphs "
                f"({self.buckets[-1]} rows, {self.max_blocks} blocks)"
            )
        self.last[:R].copy_(last_tokens)
        self.ctx_lens[:R].copy_(ctx_lens)
        self.ctx_lens[R:b].zero_()
        self.tables[:R, :width].copy_(block_tables)
        self.tables[:R, width:].zero_()
        self.tables[R:b].zero_()
        self.replays[b] = self.replays.get(b, 0) + 1
        if self.emulate:
            with torch.inference_mode():
                return self._body(b)[:R]
        self.graphs[b].replay()
        return self.outputs[b][:R]
