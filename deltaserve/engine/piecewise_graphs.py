"""Piecewise CUDA graphs for short eager steps: the dense part of the forward from graphs, the
mixers' batch-layout kernels eagerly between them.

A step with prefill rows cannot replay a decode graph: its kernels' grids and arguments follow
the batch layout. For a short step that is expensive on the host: a chat turn's prefill of a
few hundred tokens on the 9B issues ~330 launches (129 cuBLAS GEMMs, ~200 Triton kernels), about
20-30 ms of Python for 8-9 ms of GPU work (docs/benchmarks.md, "Multi-turn chat").

Most of those launches do not read the batch layout: norms, projections, activations, rotary,
gates, routed experts. Each mixer (attention, GDN, MLA) exposes three pieces (`pre`, `core`,
`post`): `pre` and `post` work row by row, `core` runs the kernels that read the batch layout
or touch the caches.
A forward of T tokens here runs over `R = bucket(T)` rows as L + 1 graphs per bucket:

    graph 0      embeddings, layer 0's input norm and mixer `pre`
    core 0       eager, over the first T rows
    graph i      layer i-1's mixer `post` and FFN, layer i's input norm and mixer `pre`
    core i       eager
    graph L      layer L-1's mixer `post` and FFN, the final norm

Between the pieces the values pass through static buffers outside the graphs' memory pool: the
token ids and positions, the residual stream, each mixer's `pre` outputs (one set per mixer kind,
shared by its layers: layer i's are read by its core and its `post` before layer i+1's `pre`
writes them), each mixer's core output (its first T rows written by a copy after the core) and
the final hidden states. Everything else a graph allocates is its own scratch, so every bucket
and segment shares one memory pool. The padded rows carry stale but finite values (earlier
steps' tokens, zeros at first); every op in the graphs is row-wise, so they never reach the real
rows, and the caller reads the first T rows.

The host then issues L + 1 graph replays and the cores' few launches instead of every launch.
A drafter's tapped layers (speculative decoding) are written into a static buffer by the
pieces. Steps that need more than the dense path (a speculative verify step's GDN scratch,
image embeddings, M-RoPE positions) and steps over the largest bucket run eagerly;
`unsupported_reason` says why a model takes no graphs at all (tensor parallelism, a mixer
without pieces, a feed-forward block whose backend cannot be captured).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch
from torch import nn

from deltaserve.distributed.parallel_state import tp_size
from deltaserve.engine.cuda_graph import capture, no_gc
from deltaserve.forward_context import ForwardContext, Kernels
from deltaserve.layers.decoder import DecoderLayer, DecoderStack
from deltaserve.layers.mlp import GatedMLP
from deltaserve.logger import get_logger

logger = get_logger(__name__)

# NOTE: below ~256 rows a step's GEMMs stream their weights whatever the row count, so coarse
# buckets cost little GPU time there; above, padding costs matmul time and steps approach
# being GPU-bound, so the buckets are finer. Each bucket is L + 1 graphs (33 for the 9B).
BUCKETS = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


def bucket_sizes(max_tokens: int, budget: int | None = None) -> tuple[int, ...]:
    """The buckets of steps of at most `max_tokens` tokens (none for 0), and with a step token
    `budget`, none past the first that holds it."""
    sizes = [b for b in BUCKETS if b <= max_tokens]
    if budget is not None:
        fits = [i for i, b in enumerate(sizes) if b >= budget]
        sizes = sizes[: fits[0] + 1] if fits else sizes
    return tuple(sizes)


def unsupported_reason(model: nn.Module, kernels: Kernels, emulate: bool = False) -> str | None:
    """Why `model` cannot run its eager steps piecewise, or None. It needs a DecoderStack of
    DecoderLayers whose mixers have the pre / core / post pieces, and feed-forward blocks that
    are gated MLPs or whose kernel family (`kernel_family`: a routed-expert block's "moe") is
    served by a backend that captures into CUDA graphs (routing never read on the host; not
    asked when `emulate`: nothing is captured)."""
    if tp_size() > 1:
        return "tensor parallelism (each rank would replay its own pieces)"
    stack = getattr(model, "model", None)
    if not isinstance(stack, DecoderStack):
        return f"{type(model).__name__} has no DecoderStack"
    for i, layer in enumerate(stack.layers):
        if not isinstance(layer, DecoderLayer):
            return f"layer {i} is a {type(layer).__name__}"
        if not all(hasattr(layer.mixer, a) for a in ("pre", "core", "post", "core_out_shape")):
            return f"layer {i}'s mixer {type(layer.mixer).__name__} has no pre / core / post"
        if isinstance(layer.mlp, GatedMLP) or emulate:
            continue
        family = getattr(layer.mlp, "kernel_family", None)
        backend = None if family is None else getattr(kernels, family, None)
        if backend is None or not getattr(backend, "supports_cuda_graph", False):
            name = getattr(backend, "name", None)
            why = f"the {family} backend {name}" if name else "its kernels"
            block = type(layer.mlp).__name__
            return f"layer {i}'s feed-forward block {block}: {why} cannot be captured"
    return None


class PiecewiseGraphs:
    """The pieces' graphs per bucket of token rows, their static buffers and their replay
    (module docstring). With `emulate`, nothing is captured: each "replay" runs its piece
    eagerly on the static buffers (the bookkeeping, padding and buffer hand-offs tested on
    CPU)."""

    def __init__(
        self,
        model: nn.Module,
        kernels: Kernels,
        sizes: tuple[int, ...],
        device: torch.device,
        emulate: bool = False,
        taps: tuple[int, ...] = (),
    ) -> None:
        if not sizes:
            raise ValueError("piecewise graphs need at least one bucket")
        self.stack: DecoderStack = model.model
        self.layers: list[DecoderLayer] = list(self.stack.layers)
        self.kernels = kernels
        self.sizes = tuple(sorted(sizes))
        self.emulate = emulate
        self.device = device
        rows = self.sizes[-1]
        embed = self.stack.embed_tokens.weight  # [vocab, hidden]
        dtype, hidden = embed.dtype, embed.shape[1]
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.residual = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.hidden = torch.zeros(rows, hidden, dtype=dtype, device=device)
        # decoder layers whose outputs every forward keeps (a drafter's taps; negative ids,
        # the final hidden state, are `hidden` itself), in a static [rows, n_taps, hidden]
        self.tap_index = {layer: j for j, layer in enumerate(t for t in taps if t >= 0)}
        self.taps = torch.zeros(rows, len(self.tap_index), hidden, dtype=dtype, device=device)
        # core outputs and `pre` outputs, one buffer set per shape, shared by layers
        self.core_bufs: dict[tuple, torch.Tensor] = {}
        self.core_key = []
        for layer in self.layers:
            key = (tuple(layer.mixer.core_out_shape()), dtype)
            if key not in self.core_bufs:
                self.core_bufs[key] = torch.zeros(rows, *key[0], dtype=dtype, device=device)
            self.core_key.append(key)
        self.part_bufs: dict[tuple, list[torch.Tensor | None]] = {}
        self.part_key: list[tuple | None] = [None] * len(self.layers)  # set by the first piece
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.replays: dict[int, int] = {}  # bucket -> forwards run in it
        self.pool: Any = None
        self._ctx: ForwardContext | None = None  # the pieces' context of the emulated forward

    def bucket(self, num_tokens: int) -> int | None:
        """The bucket a step of `num_tokens` tokens runs in, or None (eager)."""
        return next((b for b in self.sizes if b >= num_tokens), None)

    # ---- the pieces ---------------------------------------------------------------------
    def _piece_ctx(self) -> ForwardContext:
        """The context of the graphed pieces: kernels and a memo (rotary cos / sin of the
        static positions, computed by the first attention `pre` of a forward); no batch layout
        and no caches: a piece that reads either fails."""
        return ForwardContext(meta=None, caches=[], kernels=self.kernels)  # type: ignore[arg-type]

    def _parts(self, i: int, rows: int) -> tuple[torch.Tensor | None, ...]:
        """Layer i's `pre` outputs in their static buffers, first `rows` rows."""
        bufs = self.part_bufs[self.part_key[i]]
        return tuple(None if b is None else b[:rows] for b in bufs)

    def _stash(self, i: int, parts: tuple[torch.Tensor | None, ...], rows: int) -> None:
        """Copy layer i's `pre` outputs into the static buffers of their shapes."""
        key = tuple(None if p is None else (tuple(p.shape[1:]), p.dtype) for p in parts)
        if key not in self.part_bufs:
            n = self.sizes[-1]
            self.part_bufs[key] = [
                None if k is None else torch.empty(n, *k[0], dtype=k[1], device=self.device)
                for k in key
            ]
        if self.part_key[i] is None:
            self.part_key[i] = key
        elif self.part_key[i] != key:
            raise RuntimeError(f"layer {i}'s pre outputs changed shape: {key}")
        for p, buf in zip(parts, self.part_bufs[key]):
            if p is not None:
                buf[:rows].copy_(p)

    def _piece(self, i: int, rows: int, ctx: ForwardContext) -> None:
        """Graph i of a bucket of `rows` rows (module docstring), on the static buffers."""
        residual: torch.Tensor | None
        if i == 0:
            x, residual = self.stack.embed_tokens(self.input_ids[:rows]), None
        else:
            prev = self.layers[i - 1]
            o = self.core_bufs[self.core_key[i - 1]][:rows]
            h = prev.mixer.post(o, self._parts(i - 1, rows), ctx)
            x, residual = prev.ffn_output(h, self.residual[:rows], ctx)
            tap = self.tap_index.get(i - 1)
            if tap is not None:  # layer i-1's output: its FFN output plus the stream
                torch.add(x, residual, out=self.taps[:rows, tap])
        if i == len(self.layers):
            norm = self.stack.norm
            ctx.kernels.fused.rms_norm(
                x, norm.weight, norm.eps, norm.zero_centered, residual, out=self.hidden[:rows]
            )
            return
        layer = self.layers[i]
        h, residual = layer.mixer_input(x, residual, ctx)
        stream = self.residual[:rows]
        if residual.data_ptr() != stream.data_ptr():  # the first layer's: the embeddings
            stream.copy_(residual)
        self._stash(i, layer.mixer.pre(self.positions[:rows], h, ctx), rows)

    # ---- capture and replay -------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Run every piece of every bucket once (Triton compiles, cuBLAS picks its GEMM
        algorithms, the static buffers take their shapes), then capture them, largest bucket
        first, all in one memory pool."""
        start = time.perf_counter()
        if self.emulate:
            self.graphs = {rows: [] for rows in self.sizes}
            return
        reserved = torch.cuda.memory_reserved(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        for rows in reversed(self.sizes):
            ctx = self._piece_ctx()
            for i in range(len(self.layers) + 1):
                self._piece(i, rows, ctx)
        torch.cuda.synchronize(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with no_gc():
            for rows in reversed(self.sizes):
                ctx = self._piece_ctx()  # its memo lives while the bucket's pieces capture
                graphs = []
                for i in range(len(self.layers) + 1):
                    graph, _ = capture(partial(self._piece, i, rows, ctx), stream, self.pool)
                    graphs.append(graph)
                self.graphs[rows] = graphs
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # a graph's first launch uploads it to the device: do it now, not in a request's step
        # (harmless: the pieces write only the static buffers and their own scratch)
        for graphs in self.graphs.values():
            for graph in graphs:
                graph.replay()
        torch.cuda.synchronize(self.device)
        held = (torch.cuda.memory_reserved(self.device) - reserved) / 2**20
        logger.info(
            "captured piecewise CUDA graphs for eager steps of up to %d tokens: buckets %s, %d "
            "graphs each, in %.1f s (%.0f MiB more reserved)",
            self.sizes[-1],
            list(self.sizes),
            len(self.layers) + 1,
            time.perf_counter() - start,
            held,
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """The forward of a step of T tokens (input_ids, positions [T]) in its bucket's graphs,
        the mixers' cores run eagerly under `ctx` (the step's layout; `ctx.num_tokens` = T
        when the bucket has more rows): the final hidden states [T, hidden], a view of a
        static buffer valid until the next `run`."""
        T = input_ids.shape[0]
        rows = self.bucket(T)
        if rows is None or positions.dim() != 1:
            raise ValueError(f"a step of {T} tokens, positions {tuple(positions.shape)}: eager")
        self.input_ids[:T].copy_(input_ids)
        self.positions[:T].copy_(positions)
        self._ctx = self._piece_ctx() if self.emulate else None  # graphs carry their own
        self._replay(rows, 0)
        for i, layer in enumerate(self.layers):
            o = layer.mixer.core(self._parts(i, rows), ctx)  # [T, ...]
            self.core_bufs[self.core_key[i]][: o.shape[0]].copy_(o)
            self._replay(rows, i + 1)
        self._ctx = None
        self.replays[rows] = self.replays.get(rows, 0) + 1
        return self.hidden[:T]

    def tapped(self, num_tokens: int) -> dict[int, torch.Tensor]:
        """The tapped layers' outputs of the last `run`'s tokens: {layer: [T, hidden]} views of
        the static buffer, valid until the next `run`."""
        return {layer: self.taps[:num_tokens, j] for layer, j in self.tap_index.items()}

    def _replay(self, rows: int, i: int) -> None:
        if self.emulate:
            assert self._ctx is not None
            self._piece(i, rows, self._ctx)
        else:
            self.graphs[rows][i].replay()
