"""A GDN prefill backend that splits a step's prefill rows by length: short rows through a
one-launch Triton kernel (the chunked one, deltaserve.ops.gdn.triton_chunked, or for rows of
at most CHUNKED_MIN_TOKENS the token-by-token one, deltaserve.ops.gdn.triton_prefill), long rows
through a chunked backend with more parallelism per row (fla's, for the `fla` backend).

Why: the chunked form's cost for short rows is its launches. fla-core's
`chunk_gated_delta_rule` makes 8 Triton launches through its autotuner / wrapper stack per layer
call, ~1.6 ms of host time for 16 rows of 171 tokens at 9B shapes (H200), while the device work
is small: a multi-turn chat step with prefix caching (a few hundred new tokens per row) is bound
by that host time. The token-by-token kernel is one plain launch but sequential in the tokens,
so it loses on long rows. This is a backend-internal split by row length, not a selection rule:
the chosen backend stays `fla`; rows of at most N new tokens go to the Triton kernel, the rest
to fla (N: DELTASERVE_GDN_SHORT_ROW_TOKENS for the `fla` backend, else the measured
SHORT_ROW_MAX_TOKENS; a step whose short rows hold more than SHORT_PART_MAX_TOKENS tokens goes
to fla whole).

A step may mix both: each part is one launch (plus, for the long part, gathers of its token rows
unless they are contiguous, and a scatter of its outputs back to their rows). The short part
runs on the step's own rows in place (the kernel takes each sequence's start and end rows). The
split of a step is worked out once, on its first layer, and reused by the step's other layers
(the same metadata object): one small host-to-device copy per step, no device syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.forward_context import PrefillMetadata
from deltaserve.host_copy import to_device_async
from deltaserve.ops.gdn import GDNPrefillBackend
from deltaserve.ops.gdn.triton_chunked import TritonChunkedGDNPrefill, gdn_chunked_rows
from deltaserve.ops.gdn.triton_prefill import gdn_prefill_rows, prefill_out

# NOTE: measured by `deltaserve bench kernels --only gdn_prefill` (one H200, 9B shapes, one
# layer call, docs/benchmarks.md): fla's call costs 1.6-1.9 ms of host time whatever its size
# against 0.17-0.41 ms on the device, while the token-by-token kernel issues in ~0.07 ms and runs
# 73 us (1 x 171 tokens), 850 us (16 x 171) and 421 us (1 x 1024): it wins every short shape
# measured, up to 1 x 1024. Its device time grows with the tokens (0.3-0.4 us each), so above a
# few thousand short tokens in one step fla's host cost is the smaller: a step whose short rows
# hold more than SHORT_PART_MAX_TOKENS tokens sends every row to fla.
SHORT_ROW_MAX_TOKENS = 1024
SHORT_PART_MAX_TOKENS = 4096
# NOTE: `bench kernels --only gdn_prefill`, one H100, commit 9013202 (docs/benchmarks.md): the
# chunked kernel took 285 us at 16 x 171 tokens (token-by-token 845, fla 468 + 1.65 ms of host),
# 59 / 73 us at 1 x 171 and 304 / 457 us at 1 x 1024, but 101 / 90 us at 16 x 16: the short part
# runs the chunked kernel when its longest row is longer than one 64-token chunk.
CHUNKED_MIN_TOKENS = 64
# the chunked kernel has been compiled and timed on the GPU at K = V = 128 only (the Qwen3.5 and
# Qwen3-Next shapes); wider heads keep the token-by-token kernel
CHUNKED_MAX_HEAD_DIM = 128


@dataclass
class RowSplit:
    """One step's prefill rows split by length (device tensors built once per step).

    `short` is (starts, ends, state_slots, has_initial_state) of the short sequences [Ps] each,
    rows relative to the step's prefill rows; `long_meta` the long sequences as a varlen batch
    of their own and `long_rows` where their tokens sit in the step's rows: a slice when they are
    contiguous, else an int64 index [Tl]. None for a part with no sequence.
    """

    short: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    long_meta: PrefillMetadata | None
    long_rows: slice | torch.Tensor | None
    short_max_tokens: int = 0  # the longest short row's new tokens


def split_rows(
    meta: PrefillMetadata, max_short_tokens: int, max_short_total: int = SHORT_PART_MAX_TOKENS
) -> RowSplit:
    """Split `meta`'s sequences into those of at most `max_short_tokens` tokens and the rest;
    every sequence is long when the short ones hold more than `max_short_total` tokens."""
    qsl = meta.query_start_loc_cpu
    lens = [e - s for s, e in zip(qsl, qsl[1:])]
    short = [i for i, n in enumerate(lens) if n <= max_short_tokens]
    if sum(lens[i] for i in short) > max_short_total:
        short = []
    short_set = set(short)
    long = [i for i in range(len(lens)) if i not in short_set]
    short_max = max((lens[i] for i in short), default=0)
    if not long:  # every row short: the step's own tensors, no copies
        qsl_dev = meta.query_start_loc  # [P + 1]
        full = (qsl_dev[:-1], qsl_dev[1:], meta.state_slots, meta.has_initial_state)
        return RowSplit(full, None, None, short_max)
    if not short:
        return RowSplit(None, meta, slice(0, qsl[-1]))

    long_cu = [0]
    for i in long:
        long_cu.append(long_cu[-1] + lens[i])
    contiguous = all(qsl[i + 1] == qsl[j] for i, j in zip(long, long[1:]))
    tokens: list[int] = []
    if not contiguous:
        for i in long:
            tokens.extend(range(qsl[i], qsl[i + 1]))
    # one host-to-device copy: [short seqs | long seqs | long cu_seqlens | long token rows]
    host = torch.tensor(short + long + long_cu + tokens, dtype=torch.int64)
    packed = to_device_async(host, meta.query_start_loc.device)
    ps, pl = len(short), len(long)
    short_idx, long_idx = packed[:ps], packed[ps : ps + pl]  # [Ps], [Pl]
    long_cu_dev = packed[ps + pl : ps + 2 * pl + 1]  # [Pl + 1]

    qsl_dev = meta.query_start_loc
    short_part = (
        qsl_dev[short_idx],
        qsl_dev[short_idx + 1],
        meta.state_slots[short_idx],
        meta.has_initial_state[short_idx],
    )
    long_meta = PrefillMetadata(
        token_offset=0,
        query_start_loc=long_cu_dev.to(meta.query_start_loc.dtype),
        seq_lens=meta.seq_lens[long_idx],
        context_lens=meta.context_lens[long_idx],
        state_slots=meta.state_slots[long_idx],
        has_initial_state=meta.has_initial_state[long_idx],
        query_start_loc_cpu=long_cu,
        context_lens_cpu=[meta.context_lens_cpu[i] for i in long],
        state_slots_cpu=[meta.state_slots_cpu[i] for i in long],
        max_query_len=max(lens[i] for i in long),
    )
    if contiguous:
        start = qsl[long[0]]
        rows: slice | torch.Tensor = slice(start, start + long_cu[-1])
    else:
        rows = packed[ps + 2 * pl + 1 :]  # [Tl]
    return RowSplit(short_part, long_meta, rows, short_max)


class ShortRowSplitPrefill(GDNPrefillBackend):
    """Short rows through a one-launch Triton kernel, long rows through `long_rows` (module
    docstring). Contract of `GDNPrefillBackend`: rows no sequence owns come back zero, slots
    outside the batch are untouched.

    Args:
        long_rows: the backend for rows of more than `max_short_tokens` tokens.
        max_short_tokens: the split point (0: every row goes to `long_rows`).
        max_short_total: a step whose short rows hold more tokens goes to `long_rows` whole.
        chunked_min_tokens: the short part runs the chunked kernel when its longest row has
            more new tokens than this, else the token-by-token kernel.
    """

    name = "split"

    def __init__(
        self,
        long_rows: GDNPrefillBackend,
        max_short_tokens: int = SHORT_ROW_MAX_TOKENS,
        max_short_total: int = SHORT_PART_MAX_TOKENS,
        chunked_min_tokens: int = CHUNKED_MIN_TOKENS,
    ) -> None:
        if max_short_tokens < 0:
            raise ValueError(f"max_short_tokens must be >= 0, got {max_short_tokens}")
        self.long_rows = long_rows
        self.chunked_min_tokens = chunked_min_tokens
        self.max_short_tokens = max_short_tokens
        self.max_short_total = max_short_total
        # the last two metadata objects' splits (a step with in-step snapshots alternates its
        # HEAD and TAIL sub-batches in every layer: ops/gdn/checkpoints.py)
        self._splits: list[tuple[PrefillMetadata, RowSplit]] = []

    def _split_of(self, meta: PrefillMetadata) -> RowSplit:
        """The split of `meta`, worked out on the step's first layer and kept for the others."""
        for seen, split in self._splits:
            if seen is meta:
                return split
        split = split_rows(meta, self.max_short_tokens, self.max_short_total)
        self._splits = [*self._splits[-1:], (meta, split)]
        return split

    def takes_checkpoints(self, meta: PrefillMetadata) -> bool:
        """In-step snapshots are stored by the Triton kernel when every row is short."""
        return meta.num_seqs > 0 and self._split_of(meta).long_meta is None

    def forward(
        self,
        q: torch.Tensor,  # [Tp, HK, K]
        k: torch.Tensor,  # [Tp, HK, K]
        v: torch.Tensor,  # [Tp, HV, V]
        a: torch.Tensor,  # [Tp, HV]
        b: torch.Tensor,  # [Tp, HV]
        A_log: torch.Tensor,  # [HV]
        dt_bias: torch.Tensor,  # [HV]
        ssm_state: torch.Tensor,  # [num_slots, HV, V, K]
        meta: PrefillMetadata,
    ) -> torch.Tensor:  # [Tp, HV, V] in v's dtype
        if meta.num_seqs == 0 or meta.query_start_loc_cpu[-1] == 0:
            return torch.zeros_like(v)
        split = self._split_of(meta)
        if split.short is None:  # every row long: the chunked backend alone, as it is
            return self.long_rows.forward(q, k, v, a, b, A_log, dt_bias, ssm_state, meta)

        out = prefill_out(v, meta)  # [Tp, HV, V]
        if split.long_meta is None:  # every row short: the kernel takes the checkpoints
            checkpoints = meta.checkpoint_tensors()
        elif meta.checkpoint_heads_cpu:
            raise RuntimeError("checkpoints over long rows: the GDN face splits such steps")
        else:
            checkpoints = None
        args = (q, k, v, a, b, A_log, dt_bias, ssm_state, *split.short, out)
        chunked = max(k.shape[-1], v.shape[-1]) <= CHUNKED_MAX_HEAD_DIM
        if chunked and split.short_max_tokens > self.chunked_min_tokens:
            gdn_chunked_rows(*args, *(checkpoints or (None, None)))
        else:
            gdn_prefill_rows(*args, checkpoints=checkpoints)
        if split.long_meta is None:
            return out
        rows = split.long_rows
        if isinstance(rows, slice):
            part = (q[rows], k[rows], v[rows], a[rows], b[rows])
        else:
            part = tuple(t.index_select(0, rows) for t in (q, k, v, a, b))
        long_out = self.long_rows.forward(*part, A_log, dt_bias, ssm_state, split.long_meta)
        if isinstance(rows, slice):
            out[rows] = long_out  # [Tl, HV, V]
        else:
            out.index_copy_(0, rows, long_out.to(out.dtype))
        return out


class TritonRowsGDNPrefill(ShortRowSplitPrefill):
    """The `triton` backend: every row, whatever its length, through the one-launch Triton
    kernels in place (the chunked kernel when the step's longest row exceeds
    `chunked_min_tokens`, else the token-by-token one); no row is long. For when fla-core is
    not installed: at 1 x 8192 tokens (one H100, 9013202) the chunked kernel took 2.5 ms a
    layer against 5.3 ms token by token (fla: 0.85 ms on the device, 1.1 ms of host)."""

    name = "triton"

    def __init__(self, chunked_min_tokens: int = CHUNKED_MIN_TOKENS) -> None:
        never = 1 << 62  # no row is long, no step's short part too large
        super().__init__(TritonChunkedGDNPrefill(), never, never, chunked_min_tokens)
