"""What the drafters' CUDA graphs share (DFlash's block forward, spec/dflash/graphs.py; MTP's
chain, spec/mtp/graphs.py): one graph per batch bucket over static input buffers of
`max_batch` rows and a fixed block-table width, captured largest first into one memory pool; a
call of R rows copies its inputs into the first R rows (padding rows reset by the subclass) and
replays the smallest bucket >= R.

With `emulate` (DELTASERVE_EMULATE_CUDA_GRAPHS=1) nothing is captured: a replay runs the body
eagerly on the static buffers of its bucket, on any device (the bookkeeping in CPU tests).
"""

from __future__ import annotations

import torch

from deltaserve.distributed.parallel_state import new_cuda_graph


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to max_batch (and max_batch itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 8))
    if max_batch not in sizes:
        sizes.append(max_batch)
    return sorted(set(sizes))


class BucketGraphs:
    """Graphs of `_body(b)` (the drafts [b, k] of the first b rows of the static buffers) per
    batch bucket. Subclasses allocate their buffers, define `_body` and, in their `replay`,
    copy the inputs in, check them with `_bucket_for` and return `_run(b, R)`."""

    what = "drafter"  # named in errors

    def __init__(
        self, device: torch.device, max_batch: int, num_drafts: int, max_blocks: int, emulate: bool
    ) -> None:
        if device.type != "cuda" and not emulate:
            raise ValueError(f"{self.what} CUDA graphs need a CUDA device, it is on {device}")
        self.num_drafts = num_drafts
        self.max_blocks = max_blocks
        self.emulate = emulate
        self.replays: dict[int, int] = {}  # bucket -> replays so far
        self.buckets = batch_buckets(max_batch)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _body(self, b: int) -> torch.Tensor:
        raise NotImplementedError

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
                graph = new_cuda_graph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[b] = self._body(b)
                pool = graph.pool() if pool is None else pool
                self.graphs[b] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def _bucket_for(self, rows: int, width: int) -> int:
        """The bucket of `rows` rows with block tables `width` wide, or a ValueError."""
        b = self.bucket(rows)
        if b is None or width > self.max_blocks:
            raise ValueError(
                f"{rows} rows of {width} blocks do not fit the {self.what} graphs "
                f"({self.buckets[-1]} rows, {self.max_blocks} blocks)"
            )
        return b

    def _run(self, b: int, rows: int) -> torch.Tensor:
        """Replay bucket `b` (its inputs in place) and return the drafts of the first `rows`."""
        self.replays[b] = self.replays.get(b, 0) + 1
        if self.emulate:
            with torch.inference_mode():
                return self._body(b)[:rows]
        self.graphs[b].replay()
        return self.outputs[b][:rows]
