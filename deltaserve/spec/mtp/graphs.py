"""CUDA graphs of the MTP head's greedy chain: one graph per batch bucket, for a fixed number
of drafts k and a fixed block-table width (the context length the graphs serve).

The captured body is `MTPDrafter.chain(...)` (its tokens) over static buffers (last tokens,
the target's hidden states, positions, step-0 slots, block tables); a proposal of R rows
copies its inputs into the first R rows and replays the smallest bucket >= R. Padding rows
have position 0, slot -1 (step 0 writes nothing) and the null block: they attend only to their
own chain keys. Insertion of exact positions (`observe`) runs eagerly, outside the graphs.

With `emulate` (DELTASERVE_EMULATE_CUDA_GRAPHS=1) nothing is captured: a replay runs the body
eagerly on the static buffers of its bucket, on any device (the bookkeeping in CPU tests).
"""

from __future__ import annotations

import torch

from deltaserve.spec.dflash.graphs import batch_buckets
from deltaserve.spec.mtp.drafter import MTPDrafter, ragged_meta


class ChainGraphs:
    """Greedy chain graphs of `drafter` for up to `max_batch` rows of `num_drafts` drafts
    whose blocks fit `max_blocks`."""

    def __init__(
        self,
        drafter: MTPDrafter,
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
        weight = drafter.head.fc.weight
        device = weight.device
        if device.type != "cuda" and not emulate:
            raise ValueError(f"MTP chain CUDA graphs need a CUDA device, the head is on {device}")
        self.buckets = batch_buckets(max_batch)
        self.last = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.hidden = torch.zeros(max_batch, weight.shape[0], dtype=weight.dtype, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slots = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
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
        self,
        last_tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """Greedy drafts [R, k] of R rows (R <= max_batch, tables at most max_blocks wide)."""
        R, width = block_tables.shape
        b = self.bucket(R)
        if b is None or width > self.max_blocks:
            raise ValueError(
                f"{R} rows of {width} blocks do not fit the MTP chain graphs "
                f"({self.buckets[-1]} rows, {self.max_blocks} blocks)"
            )
        self.last[:R].copy_(last_tokens)
        self.hidden[:R].copy_(hidden)
        self.positions[:R].copy_(positions)
        self.positions[R:b].zero_()
        self.slots[:R].copy_(slots)
        self.slots[R:b].fill_(-1)
        self.tables[:R, :width].copy_(block_tables)
        self.tables[:R, width:].zero_()
        self.tables[R:b].zero_()
        self.replays[b] = self.replays.get(b, 0) + 1
        if self.emulate:
            with torch.inference_mode():
                return self._body(b)[:R]
        self.graphs[b].replay()
        return self.outputs[b][:R]
