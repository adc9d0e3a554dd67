"""CUDA graphs for all-decode steps: one graph per (batch-size bucket, q) over static buffers.

Every row of an all-decode step carries the same number q of new tokens (q = 1: plain decode;
1 + k: verifying k drafts). A step of B rows runs the graph of (the smallest bucket >= B, q).
The runner copies the step's inputs and metadata into the first B rows (B * q tokens) of the
static buffers; the remaining rows are padding: whatever tokens the buffers hold, written to the
null KV block 0, reading from it, on the null state slot 0. Padding rows compute garbage that nobody
reads, in places nobody else uses.

Prefill and mixed steps run eagerly (short ones from piecewise graphs:
engine/piecewise_graphs.py). The graph holds the model forward and the lm_head; sampling runs
outside it, on the first B rows of the logits.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from deltaserve.distributed.parallel_state import new_cuda_graph
from deltaserve.forward_context import BatchMetadata
from deltaserve.logger import get_logger

logger = get_logger(__name__)


def capture(
    fn: Callable[[], Any],
    stream: torch.cuda.Stream,
    pool: Any = None,
    capture_error_mode: str = "global",
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture `fn()` into a new graph on `stream` (which must already wait for the work the
    capture reads), in memory pool `pool` (None: a new private pool, `graph.pool()` after);
    returns (graph, fn's result). The caller synchronises once before its captures and runs
    them under `no_gc()`: unlike `torch.cuda.graph`, nothing here runs gc.collect() or empties
    the allocator's cache, which would cost each of a start-up's hundreds of captures that
    time."""
    graph = new_cuda_graph()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
        try:
            result = fn()
        finally:
            graph.capture_end()
    return graph, result


@contextmanager
def no_gc() -> Iterator[None]:
    """Python's cyclic GC collected once, then held off while graphs capture.

    NOTE: a collection during a capture may free another engine's CUDA graphs or events (a
    process that built engines before, as the GPU tests do), and destroying those is illegal
    while a stream captures: the capture fails. `torch.cuda.graph` collects before each
    capture; collecting once and pausing the collector keeps that guarantee for hundreds of
    captures at the cost of one collection."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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
    """Static buffers and captured graphs for all-decode steps of up to `max_batch_size` rows of
    q tokens each, for every q in `query_lens`.

    `forward(input_ids, positions, meta) -> logits` is the eager step (model + lm_head over
    every token row); it is run once per graph to warm up (Triton compiles there) and then
    captured. `plan(meta, bs)` is the attention backend's `plan_graph`, called outside capture
    before the capture and before every replay.

    Under tensor parallelism every rank builds the same buckets (from agreed sizes), captures
    them in the same order with the collectives inside (`capture_error_mode="thread_local"`:
    the NCCL watchdog thread may query events of earlier work during a capture) and replays
    the bucket rank 0 names for each step. With `emulate` nothing is captured: a replay runs
    `forward` eagerly on the static buffers of its bucket (graph bookkeeping tests on CPU).
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, BatchMetadata], torch.Tensor],
        plan: Callable[[BatchMetadata, int], None],
        max_batch_size: int,
        max_blocks_per_seq: int,
        device: torch.device,
        query_lens: tuple[int, ...] = (1,),
        emulate: bool = False,
        capture_error_mode: str = "global",
    ) -> None:
        self.forward = forward
        self.emulate = emulate
        self.capture_error_mode = capture_error_mode
        self.replays: dict[tuple[int, int], int] = {}  # (bucket, q) -> replays so far
        self.plan = plan
        self.buckets = batch_size_buckets(max_batch_size)
        self.query_lens = tuple(sorted(set(query_lens)))
        n, dev = max_batch_size, device
        t = n * max(self.query_lens)  # token rows
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(t, dtype=torch.int64, device=dev)
        self.query_start_loc = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.state_slots = torch.zeros(n, dtype=torch.int64, device=dev)
        self.has_initial_state = torch.ones(n, dtype=torch.bool, device=dev)
        # (bucket, q) -> graph (None when emulated)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None

    def bucket(self, batch_size: int, q: int = 1) -> int | None:
        """The batch-size bucket a step of `batch_size` rows of q tokens replays, or None."""
        if q not in self.query_lens:
            return None
        return next((b for b in self.buckets if b >= batch_size), None)

    def static_meta(self, bs: int, q: int, host: BatchMetadata | None = None) -> BatchMetadata:
        """The static metadata of graph (bs, q). Host lists come from `host` (the real step,
        padded) when given; graph-captured kernels never read them, planners may."""
        pad = bs if host is None else bs - host.num_seqs
        seq_lens = ([] if host is None else host.seq_lens_cpu) + [q] * pad
        ctx = ([] if host is None else host.context_lens_cpu) + [0] * pad
        slots = ([] if host is None else host.state_slots_cpu) + [0] * pad
        return BatchMetadata(
            slot_mapping=self.slot_mapping[: bs * q],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs],
            state_slots=self.state_slots[:bs],
            has_initial_state=self.has_initial_state[:bs],
            query_start_loc_cpu=list(range(0, bs * q + 1, q)),
            seq_lens_cpu=seq_lens,
            context_lens_cpu=ctx,
            state_slots_cpu=slots,
            num_decodes=bs,
            decode_query_len=q,
            max_query_len=q,
            max_seq_len=max(seq_lens),
        )

    def _set_query_start(self, bs: int, q: int) -> None:
        # the static query offsets of graph (bs, q): 0, q, 2q, ...
        self.query_start_loc[: bs + 1].copy_(
            torch.arange(0, bs * q + 1, q, dtype=torch.int32, device=self.query_start_loc.device)
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every (bucket, q), largest first (smaller ones reuse its
        memory)."""
        keys = sorted(
            ((bs, q) for bs in self.buckets for q in self.query_lens),
            key=lambda k: k[0] * k[1],
            reverse=True,
        )
        if self.emulate:
            self.graphs = dict.fromkeys(keys)
            logger.info(
                "emulated (eager) decode graphs for batch sizes %s, query lengths %s",
                self.buckets,
                list(self.query_lens),
            )
            return
        stream = torch.cuda.Stream()
        with no_gc():
            self._capture(keys, stream)
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for decode batch sizes %s, query lengths %s",
            self.buckets,
            list(self.query_lens),
        )

    def _capture(self, keys: list[tuple[int, int]], stream: torch.cuda.Stream) -> None:
        for bs, q in keys:
            meta = self.static_meta(bs, q)
            self._set_query_start(bs, q)
            self.seq_lens[:bs].fill_(q)
            self.plan(meta, bs)
            t = bs * q
            self.forward(self.input_ids[:t], self.positions[:t], meta)  # warm-up / compile
            torch.cuda.synchronize()
            graph, logits = capture(
                partial(self.forward, self.input_ids[:t], self.positions[:t], meta),
                stream,
                self.pool,
                self.capture_error_mode,
            )
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[(bs, q)] = graph
            self.logits[(bs, q)] = logits

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata) -> int:
        """Copy the all-decode step `meta` (B rows of q tokens) into the static buffers, padding
        rows set to the null block / slot; returns its bucket."""
        n, q = meta.num_seqs, meta.decode_query_len
        bs = self.bucket(n, q)
        assert bs is not None and meta.num_decodes == n
        t, width = n * q, meta.block_tables.shape[1]
        if len(self.query_lens) > 1:
            self._set_query_start(bs, q)
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.context_lens[:n].copy_(meta.context_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.state_slots[:n].copy_(meta.state_slots)
        if bs > n:  # padding rows: null block, q keys from it, null slot
            self.slot_mapping[t : bs * q].zero_()
            self.seq_lens[n:bs].fill_(q)
            self.context_lens[n:bs].zero_()
            self.block_tables[n:bs, :1].zero_()
            self.state_slots[n:bs].zero_()
        return bs

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata
    ) -> torch.Tensor:
        """Run the all-decode step `meta` (B rows of q tokens) in its graph; returns the logits
        of its B * q token rows [B * q, vocab]."""
        bs = self.stage(input_ids, positions, meta)
        q = meta.decode_query_len
        static = self.static_meta(bs, q, meta)
        self.plan(static, bs)
        self.replays[(bs, q)] = self.replays.get((bs, q), 0) + 1
        graph = self.graphs[(bs, q)]
        if graph is None:  # emulated: the captured step, run eagerly on the static buffers
            t = bs * q
            return self.forward(self.input_ids[:t], self.positions[:t], static)[: meta.num_seqs * q]
        graph.replay()
        return self.logits[(bs, q)][: meta.num_seqs * q]
