"""Exact GDN state rollback after a speculative verify step ("replay from a saved state").

A verify row feeds 1 + k tokens through every GDN layer, which leaves the sequence's conv and
SSM state after all of them. When only the first n = 1 + a tokens are accepted, both must be
the states after those n tokens alone. The scheme (docs/architecture.md, "Speculative
decoding", says why it was chosen):

1. during the verify forward, each GDN layer first (`GDNVerifyScratch.record`)
   - copies each draft row's conv and SSM state to a scratch slot of the state pool (the
     pre-verify state; scratch slots are reserved in the "slots" pool, one per sequence the
     engine can run, cache/pools.py), and
   - records the row's per-token inputs: the conv input (pre-conv [q | k | v]) and the raw gate
     inputs b, a ([1 + k, conv_dim + 2 HV] per row and layer, model dtype);
2. after acceptance, for the rows that rejected drafts only (`GDNRollback.rollback`):
   - conv state = the last W - 1 of [pre-verify conv state | the n accepted inputs];
   - the conv output, gates and L2-normalised keys of the n tokens are recomputed from the
     records (the same math as the forward), and the SSM state is replayed from the scratch
     slot over the n tokens into the sequence's slot (`gdn_replay` op family: torch reference,
     Triton kernel).

Memory: one extra state per sequence (not per draft position) plus (1 + k) x (conv_dim + 2 HV)
values per row and layer of records. Rows whose drafts were all accepted cost only the copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.distributed.parallel_state import new_cuda_graph
from deltaserve.forward_context import LayerCache
from deltaserve.host_copy import pinned, to_device_async
from deltaserve.ops.gdn.reference import gdn_gates, l2norm
from deltaserve.ops.gdn.replay import GDNReplayBackend


@dataclass
class GDNVerifyScratch:
    """What the GDN layers of one verify step save (set as `ForwardContext.spec_verify`).

    save_src / save_dst: [R] int64 the draft rows' state slots and their scratch slots.
    token_rows: [M] int64 the step's token rows that belong to draft rows; record_rows: [M] the
    flat record row of each ((draft row r, token t) -> r * Q + t)."""

    save_src: torch.Tensor
    save_dst: torch.Tensor
    token_rows: torch.Tensor
    record_rows: torch.Tensor
    records: dict[int, torch.Tensor]  # layer -> [max_rows * Q, conv_dim + 2 HV]
    fused: bool = False  # one Triton launch per layer (ops/gdn/triton_record.py)

    def record(
        self,
        layer_idx: int,
        mixed_qkv: torch.Tensor,  # [T, conv_dim] the conv input
        b: torch.Tensor,  # [T, HV]
        a: torch.Tensor,  # [T, HV]
        cache: LayerCache,
    ) -> None:
        """Save the pre-verify states and the draft rows' inputs of one GDN layer (called
        before the layer's conv)."""
        if self.fused:
            from deltaserve.ops.gdn.triton_record import gdn_record_fused

            gdn_record_fused(
                cache["conv_state"], cache["ssm_state"], self.save_src, self.save_dst,
                mixed_qkv, b, a, self.token_rows, self.record_rows, self.records[layer_idx],
            )  # fmt: skip
            return
        for name in ("conv_state", "ssm_state"):
            pool = cache[name]
            pool.index_copy_(0, self.save_dst, pool.index_select(0, self.save_src))
        rec = self.records[layer_idx]
        rows = self.token_rows
        inputs = torch.cat([mixed_qkv[rows], b[rows], a[rows]], dim=-1)  # [M, conv_dim + 2 HV]
        rec.index_copy_(0, self.record_rows, inputs.to(rec.dtype))


@dataclass(frozen=True)
class RollbackRow:
    """A draft row that rejected drafts: record row r (its scratch slot), the tokens kept
    (1 + accepted) and the sequence's own slot."""

    record_row: int
    num_kept: int
    slot: int


class GDNRollback:
    """Records and rollback of every GDN layer of one model (see the module docstring)."""

    def __init__(
        self,
        layers: list,  # GatedDeltaNet modules
        caches: list[LayerCache],
        scratch_slots: range,
        query_len: int,
        dtype: torch.dtype,
        device: torch.device,
        replay: GDNReplayBackend,
    ) -> None:
        self.layers = layers
        self.caches = caches
        self.scratch_slots = scratch_slots
        self.query_len = query_len  # Q = 1 + k: record rows per draft row
        self.max_rows = len(scratch_slots)
        self.device = device
        self.replay = replay
        # the Triton backend also saves the verify scratch and rolls back in fused kernels
        self.fused = replay.supports_fused_rollback
        self.records: dict[int, torch.Tensor] = {}
        # the rollback rows of a step: record row, kept, scratch slot, the sequence's slot
        self.index = torch.zeros(4, self.max_rows, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # rows -> the captured rollback
        for layer in layers:
            s = layer.spec
            width = s.conv_dim + 2 * s.num_v_heads
            self.records[layer.layer_idx] = torch.zeros(
                self.max_rows * query_len, width, dtype=dtype, device=device
            )

    def scratch(self, draft_rows: list[tuple[int, int, int]]) -> GDNVerifyScratch:
        """The step's scratch for `draft_rows`: (first token row in the step, tokens of the row,
        the sequence's state slot), one per row with drafts, in order; record row r is the r-th."""
        if len(draft_rows) > self.max_rows:
            raise RuntimeError(
                f"{len(draft_rows)} draft rows, but only {self.max_rows} GDN scratch slots"
            )
        token_rows, record_rows = [], []
        for r, (start, n, _slot) in enumerate(draft_rows):
            if n > self.query_len:
                raise ValueError(f"a draft row of {n} tokens; at most {self.query_len}")
            token_rows.extend(range(start, start + n))
            record_rows.extend(range(r * self.query_len, r * self.query_len + n))
        src = [slot for _, _, slot in draft_rows]
        dst = list(self.scratch_slots[: len(draft_rows)])

        def dev(x: list[int]) -> torch.Tensor:
            return to_device_async(torch.tensor(x, dtype=torch.int64), self.device)

        return GDNVerifyScratch(
            dev(src), dev(dst), dev(token_rows), dev(record_rows), self.records, self.fused
        )

    def graph_scratch(self, meta) -> GDNVerifyScratch:
        """The scratch of a verify graph: `meta` is the graph's static metadata, every row a
        draft row of exactly `query_len` tokens, so row b's record rows are b * Q .. and its
        scratch slot the b-th (the layout `scratch` gives an eager step of the same rows);
        the sources are the static state-slot buffer itself (padding rows copy slot 0)."""
        bs, q = meta.num_decodes, meta.decode_query_len
        if q != self.query_len or bs > self.max_rows:
            raise ValueError(f"a verify graph of {bs} rows of {q} tokens; scratch for "
                             f"{self.max_rows} rows of {self.query_len}")  # fmt: skip
        start = self.scratch_slots.start
        dst = torch.arange(start, start + bs, dtype=torch.int64, device=self.device)
        rows = torch.arange(bs * q, dtype=torch.int64, device=self.device)
        return GDNVerifyScratch(meta.state_slots[:bs], dst, rows, rows, self.records, self.fused)

    @torch.no_grad()
    def rollback(self, rows: list[RollbackRow]) -> None:
        """Set every GDN layer's conv and SSM state of each row's sequence to the state after
        its kept tokens, from the scratch slot and the records of the last verify step.

        The rows' indices reach the device in one copy per step, into the static buffer
        `index` [4, max_rows] (record row, kept, scratch slot, the sequence's slot); with the
        fused backend the rollback of all layers then replays the CUDA graph of the smallest
        captured bucket that holds the rows (padding rows: kept 0, skipped), else it runs
        eagerly, in one fused launch pair per layer or the torch reference."""
        if not rows:
            return
        R = len(rows)
        bucket = next((b for b in sorted(self.graphs) if b >= R), None)
        n = bucket or R
        # padding rows: kept 0, slot 0; pinned, so the copy below does not wait for the GPU
        host = pinned(torch.zeros(4, n, dtype=torch.int64), self.device)
        host[:, :R] = torch.tensor(
            [
                (row.record_row, row.num_kept, self.scratch_slots[row.record_row], row.slot)
                for row in rows
            ],
            dtype=torch.int64,
        ).T
        self.index[:, :n].copy_(host, non_blocking=True)
        if bucket is not None:
            self.graphs[bucket].replay()
        elif self.replay.supports_fused_rollback:
            self._rollback_fused(n)
        else:
            self._rollback_torch(n)

    def _rollback_fused(self, n: int) -> None:
        """Every layer's fused rollback over the first n rows of `index` (kept 0: skipped)."""
        record_rows, kept, src, dst = self.index[:, :n]
        for layer in self.layers:
            s = layer.spec
            cache = self.caches[layer.layer_idx]
            self.replay.rollback_layer(
                self.records[layer.layer_idx],
                layer.conv1d.weight.view(s.conv_dim, s.conv_kernel),
                layer.A_log,
                layer.dt_bias,
                record_rows,
                kept,
                src,
                dst,
                cache["conv_state"],
                cache["ssm_state"],
                self.query_len,
                s.num_k_heads,
            )

    def _rollback_torch(self, n: int) -> None:
        """Every layer's torch rollback over the first n rows of `index` (all with kept > 0)."""
        record_rows, kept, src, dst = self.index[:, :n]
        for layer in self.layers:
            rec = self.records[layer.layer_idx].view(self.max_rows, self.query_len, -1)
            rec = rec[record_rows]  # [n, Q, D]
            rollback_layer(layer, self.caches[layer.layer_idx], rec, kept, src, dst, self.replay)

    @torch.no_grad()
    def capture_graphs(self, buckets: list[int]) -> None:
        """Capture the fused rollback of all layers for `buckets` rows each (those within
        max_rows); a no-op without the fused backend or a CUDA device. Warm-up and capture run
        with kept 0 in every row, so they write no state."""
        if not self.replay.supports_fused_rollback or self.device.type != "cuda":
            return
        self.index.zero_()
        sizes = sorted({min(b, self.max_rows) for b in buckets}, reverse=True)
        for b in sizes:
            self._rollback_fused(b)  # compile outside the capture
        torch.cuda.synchronize(self.device)
        pool = None
        for b in sizes:
            graph = new_cuda_graph()
            with torch.cuda.graph(graph, pool=pool):
                self._rollback_fused(b)
            pool = graph.pool()
            self.graphs[b] = graph


def rollback_layer(
    layer,  # GatedDeltaNet
    cache: LayerCache,
    rec: torch.Tensor,  # [R, Q, conv_dim + 2 HV]: conv input, b, a per token
    kept: torch.Tensor,  # [R] int64, 1 .. Q
    src: torch.Tensor,  # [R] int64 scratch slots (pre-verify states)
    dst: torch.Tensor,  # [R] int64 the sequences' slots
    replay: GDNReplayBackend,
) -> None:
    """One GDN layer's rollback: conv state by re-selection, SSM state by replay."""
    s = layer.spec
    C, HV, W = s.conv_dim, s.num_v_heads, s.conv_kernel
    R, Q, _ = rec.shape
    x, b, a = rec.split([C, HV, HV], dim=-1)  # [R, Q, C], [R, Q, HV] x2
    conv_state, ssm_state = cache["conv_state"], cache["ssm_state"]
    old = conv_state[src].float().transpose(1, 2)  # [R, C, W-1] -> [R, W-1, C]
    xpad = torch.cat([old, x.float()], dim=1)  # [R, W - 1 + Q, C]
    # the new conv state: xpad[r, n_r .. n_r + W - 2] (the last W - 1 inputs of the kept ones)
    idx = kept[:, None] + torch.arange(W - 1, device=kept.device)  # [R, W - 1]
    new_conv = xpad.gather(1, idx[..., None].expand(R, W - 1, C))  # [R, W - 1, C]
    conv_state.index_copy_(0, dst, new_conv.transpose(1, 2).to(conv_state.dtype))
    # the conv outputs of all Q positions (those past n_r are never used), as the forward does
    weight = layer.conv1d.weight.view(C, W).float()
    windows = xpad.unfold(1, W, 1)  # [R, Q, C, W]: windows[r, t, c, j] = xpad[r, t + j, c]
    out = torch.nn.functional.silu((windows * weight).sum(dim=-1)).to(x.dtype)  # [R, Q, C]
    kd = s.num_k_heads * s.head_k_dim
    k = out[..., kd : 2 * kd].unflatten(-1, (s.num_k_heads, s.head_k_dim))  # [R, Q, HK, K]
    v = out[..., 2 * kd :].unflatten(-1, (HV, s.head_v_dim))  # [R, Q, HV, V]
    k = l2norm(k).repeat_interleave(HV // s.num_k_heads, dim=2).contiguous()  # [R, Q, HV, K]
    g, beta = gdn_gates(a, b, layer.A_log, layer.dt_bias)  # [R, Q, HV] each
    replay.forward(k, v.contiguous(), g.contiguous(), beta.contiguous(), kept, src, dst, ssm_state)


def build_gdn_rollback(instance, num_slots: int, config) -> GDNRollback | None:
    """The rollback of `instance`'s GDN layers (None when it has none), over the scratch slots
    of its "slots" pool of `num_slots` (cache/pools.py)."""
    from deltaserve.cache.pools import scratch_slots
    from deltaserve.layers.gdn import GatedDeltaNet

    layers = [m for m in instance.model.modules() if isinstance(m, GatedDeltaNet)]
    if not layers:
        return None
    spec = config.speculative
    return GDNRollback(
        layers,
        instance.caches,
        scratch_slots(num_slots, config),
        spec.query_len,
        config.model.dtype,
        instance.device,
        instance.backends["gdn_replay"],
    )
