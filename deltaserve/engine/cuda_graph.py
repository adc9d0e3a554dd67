"""CUDA graphs for all-decode steps: one graph per batch-size bucket over static buffers.

A decode step of B sequences runs the graph of the smallest bucket >= B. The runner copies the
step's inputs and metadata into the first B rows of the static buffers; the remaining rows are
padding: token 0 at position 0, written to the null KV block 0, reading one key from it, on the
null state slot 0. Padding rows compute garbage that nobody reads, in places nobody else uses.

Prefill and mixed steps run eagerly. The graph holds the model forward and the lm_head; sampling
runs outside it, on the first B rows of the logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltaserve.forward_context import BatchMetadata
from deltaserve.logger import get_logger

logger = get_logger(__name__)


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, 16 to 128, 32 to 256, 64 beyond; the last one is
    `max_batch_size` itself."""
    sizes = [1, 2, 4, 8]
    size = 8
    while size < max_batch_size:
        size += 8 if size < 64 else 16 if size < 128 else 32 if size < 256 else 64
        sizes.append(size)
    sizes = [s for s in sizes if s < max_batch_size]
    return [*sizes, max_batch_size]


class DecodeGraphs:
    """Static buffers and captured graphs for decode batches of up to `max_batch_size` rows.

    `forward(input_ids, positions, meta) -> logits` is the eager step (model + lm_head); it is
    run once per bucket to warm up (Triton compiles there) and then captured. `plan(meta, bs)`
    is the attention backend's `plan_graph`, called outside capture before the capture and
    before every replay.
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, BatchMetadata], torch.Tensor],
        plan: Callable[[BatchMetadata, int], None],
        max_batch_size: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.plan = plan
        self.buckets = batch_size_buckets(max_batch_size)
        n, dev = max_batch_size, device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.state_slots = torch.zeros(n, dtype=torch.int64, device=dev)
        self.has_initial_state = torch.ones(n, dtype=torch.bool, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def bucket(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def _meta(self, bs: int, host: BatchMetadata | None = None) -> BatchMetadata:
        """The static metadata of bucket `bs`. Host lists come from `host` (the real step,
        padded) when given; graph-captured kernels never read them, planners may."""
        pad = bs if host is None else bs - host.num_seqs
        seq_lens = ([] if host is None else host.seq_lens_cpu) + [1] * pad
        ctx = ([] if host is None else host.context_lens_cpu) + [0] * pad
        slots = ([] if host is None else host.state_slots_cpu) + [0] * pad
        return BatchMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs],
            state_slots=self.state_slots[:bs],
            has_initial_state=self.has_initial_state[:bs],
            query_start_loc_cpu=list(range(bs + 1)),
            seq_lens_cpu=seq_lens,
            context_lens_cpu=ctx,
            state_slots_cpu=slots,
            num_decodes=bs,
            max_query_len=1,
            max_seq_len=max(seq_lens),
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first (smaller ones reuse its memory)."""
        for bs in sorted(self.buckets, reverse=True):
            meta = self._meta(bs)
            self.plan(meta, bs)
            self.forward(self.input_ids[:bs], self.positions[:bs], meta)  # warm-up / compile
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.forward(self.input_ids[:bs], self.positions[:bs], meta)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            self.logits[bs] = logits
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.buckets)

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata
    ) -> torch.Tensor:
        """Run the all-decode step `meta` (B rows) in its bucket's graph; returns [B, vocab]."""
        n = meta.num_seqs
        bs = self.bucket(n)
        assert bs is not None and meta.num_decodes == n
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.context_lens[:n].copy_(meta.context_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.state_slots[:n].copy_(meta.state_slots)
        if bs > n:  # padding rows: null block, one key, null slot
            self.slot_mapping[n:bs].zero_()
            self.seq_lens[n:bs].fill_(1)
            self.context_lens[n:bs].zero_()
            self.block_tables[n:bs, :1].zero_()
            self.state_slots[n:bs].zero_()
        self.plan(self._meta(bs, meta), bs)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
