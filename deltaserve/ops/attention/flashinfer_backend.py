"""FlashInfer paged attention over deltaserve's paged KV cache (flashinfer-python 0.7.2).

Caches are separate K and V tensors [num_blocks, block_size, Hkv, D], FlashInfer's "NHD" pages.
A step's decode rows (the first `meta.num_decodes` sequences) of one token each run through
`BatchDecodeWithPagedKVCacheWrapper`, the prefill chunks through
`BatchPrefillWithPagedKVCacheWrapper` (causal or not), each writing its slice of one output.
Decode rows of q > 1 tokens (speculative verification) join the prefill wrapper, which places
query i of a row at `context_len + i` under the causal mask; they run eagerly (no CUDA graph).
New K/V go through the shared `kv_writer.write_kv` (slot -1: skip the token).

FlashInfer splits the work in two: `plan()` (host-side scheduling from the page table, outside
any CUDA graph) and `run()` (kernels only). One plan serves every attention layer of a step, so
plans are keyed on the step's `BatchMetadata` object and on the layer's shape (`PlanKey`); the
shape is learned from the first forward or given up front with `configure()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import flashinfer
import torch

from deltaserve.backend_checks import FLASHINFER_CUDA_CORE_GROUPS
from deltaserve.forward_context import BatchMetadata
from deltaserve.host_copy import pinned, to_device_async
from deltaserve.ops.attention import AttentionBackend
from deltaserve.ops.attention.kv_writer import write_kv

WORKSPACE_BYTES = 256 << 20  # FlashInfer's float workspace (split-KV partials), shared by all


@dataclass(frozen=True)
class PlanKey:
    """What a FlashInfer plan depends on besides the batch layout: one per attention shape."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    scale: float  # FlashInfer bakes the softmax scale into the plan


@dataclass
class PageTable:
    """FlashInfer's CSR view of the KV pages of a run of sequences."""

    qo_indptr: torch.Tensor  # [n + 1] int32, host: query rows, from 0
    kv_indptr: torch.Tensor  # [n + 1] int32, host: pages of each sequence in kv_indices
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32, device: block ids, in order
    last_page_len: torch.Tensor  # [n] int32, host: tokens in each sequence's last page (1..page)


def build_page_table(
    meta: BatchMetadata, lo: int, hi: int, page_size: int, pad_to: int | None = None
) -> PageTable:
    """The page table of sequences `lo .. hi - 1` of `meta`, from its host lists and a gather
    of `meta.block_tables` on the device (no host sync).

    With `pad_to`, rows are appended up to `pad_to` sequences, each one query on one token of
    the null block 0 (how CUDA-graph padding rows look).
    """
    seq_lens = meta.seq_lens_cpu[lo:hi]
    qsl = meta.query_start_loc_cpu[lo : hi + 1]
    n = hi - lo
    n_pad = 0 if pad_to is None else pad_to - n
    if n_pad < 0:
        raise ValueError(f"{n} sequences do not fit a padded batch of {pad_to}")
    pages = torch.tensor([-(-s // page_size) for s in seq_lens], dtype=torch.int64)  # [n]
    width = meta.block_tables.shape[1]
    if n and int(pages.max()) > width:
        raise ValueError(f"a sequence needs {int(pages.max())} blocks; block table has {width}")
    kv_indptr = torch.zeros(n + n_pad + 1, dtype=torch.int64)
    kv_indptr[1 : n + 1] = pages.cumsum(0)
    kv_indptr[n + 1 :] = kv_indptr[n] + torch.arange(1, n_pad + 1)
    last = torch.tensor(seq_lens, dtype=torch.int64) - (pages - 1).clamp(min=0) * page_size
    last_page_len = torch.cat([last, torch.ones(n_pad, dtype=torch.int64)])  # [n + n_pad]
    # flat positions in block_tables of every used page, sequence by sequence
    total = int(kv_indptr[n])
    rows = torch.repeat_interleave(torch.arange(lo, hi), pages)  # [total]
    cols = torch.arange(total) - torch.repeat_interleave(kv_indptr[:n], pages)  # [total]
    flat = rows * width + cols  # [total] host
    flat = to_device_async(flat, meta.block_tables.device)
    kv_indices = meta.block_tables.reshape(-1)[flat].to(torch.int32)  # [total]
    if n_pad:
        pad = torch.zeros(n_pad, dtype=torch.int32, device=kv_indices.device)  # null block 0
        kv_indices = torch.cat([kv_indices, pad])
    qo = torch.tensor(qsl, dtype=torch.int64) - qsl[0]
    qo_indptr = torch.cat([qo, qo[-1] + torch.arange(1, n_pad + 1)])
    # pinned: FlashInfer's plan copies them to the device with non_blocking=True
    qo, kv, last = (
        pinned(t.to(torch.int32), meta.block_tables.device)
        for t in (qo_indptr, kv_indptr, last_page_len)
    )
    return PageTable(qo, kv, kv_indices, last)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def decode_wrapper_rows(meta: BatchMetadata) -> int:
    """The leading sequences (and token rows: one each) the decode wrapper serves: the decode
    rows when they carry one token, else none (q > 1 rows go to the prefill wrapper)."""
    return meta.num_decodes if meta.decode_query_len == 1 else 0


@dataclass
class _Step:
    """What has been planned for one step (one BatchMetadata object)."""

    meta: BatchMetadata
    graph_batch: int | None = None  # padded batch size when planned for a CUDA graph
    tables: dict[int, tuple[PageTable | None, PageTable | None]] = field(default_factory=dict)
    planned: set[tuple[PlanKey, str]] = field(default_factory=set)


@dataclass
class _GraphBuffers:
    """Fixed-address page-table buffers that captured decode graphs read (shared by all sizes:
    every replay is preceded by its own plan)."""

    kv_indptr: torch.Tensor  # [max_batch_size + 1] int32
    kv_indices: torch.Tensor  # [max_batch_size * max_blocks_per_seq] int32
    last_page_len: torch.Tensor  # [max_batch_size] int32
    max_batch_size: int


class FlashInferAttentionBackend(AttentionBackend):
    """Paged prefill + decode through FlashInfer's wrappers; plans once per step.

    Per step: `plan(meta)` (the model runner, before the forward, outside capture) builds the page
    tables and plans the wrappers for every shape seen so far; `forward` writes the new K/V and
    only calls `run()`. A shape first met in `forward` (or the non-causal variant) is planned
    there, on the first layer that needs it, which is fine outside graph capture.

    Decode uses tensor cores (FlashInfer's prefill kernels with one query per request) by
    default: on our H200 they beat the CUDA-core decode kernel at every size measured (B=64,
    L=4096, 16q/4kv, D=256: 251 vs 404 us in `deltaserve bench kernels`; 326 vs 416 us in an
    earlier H200 run of FlashInfer's own benchmark).
    `use_tensor_cores=False` takes the CUDA-core kernel where it is compiled for the GQA group
    (`FLASHINFER_CUDA_CORE_GROUPS`), tensor cores elsewhere.

    CUDA graphs (all-decode steps). What the model runner calls, in order:

    1. Once, after allocating the caches: `configure(num_q_heads, num_kv_heads, head_dim,
       page_size, dtype, scale)` for the model's attention shape (or run one eager step first),
       then `init_cuda_graph(max_batch_size, max_blocks_per_seq, device)`, where
       `max_blocks_per_seq` is the block-table width of the static metadata.
    2. Capture, per padded batch size `bs`: build the static metadata (all decodes; padded rows
       have seq_len 1, block-table row of zeros (the null block 0), slot_mapping -1 or 0, state
       slot 0; `num_seqs` may be `bs` or only the real rows, which are then padded here), call
       `plan_graph(meta, bs)` outside capture, optionally run the forward once eagerly (warm-up),
       then capture the forward (q, k, v of `bs` rows): it only calls `run()` on the graph
       wrapper of size `bs` (and writes K/V with device ops).
    3. Each replay: update the static metadata (device tensors in place, host lists
       `seq_lens_cpu` / `query_start_loc_cpu` to the new step), call `plan_graph(meta, bs)`
       outside capture, then replay. `plan(meta)` does the same when `meta.num_seqs` is a
       captured size and the step is all decodes, so a runner that calls `plan(meta)` with a
       metadata that already holds the padded rows needs no other call.
    """

    name = "flashinfer"
    supports_cuda_graph = True
    graph_query_lens = (1,)  # q > 1 decode rows take the (eager) prefill wrapper

    def __init__(
        self,
        use_tensor_cores: bool = True,
        prefill_backend: str = "auto",
        workspace_bytes: int = WORKSPACE_BYTES,
    ) -> None:
        self.use_tensor_cores = use_tensor_cores
        self.prefill_backend = prefill_backend  # "auto": fa3 on Hopper, fa2 elsewhere
        self.workspace_bytes = workspace_bytes
        self._workspace: torch.Tensor | None = None
        self._keys: list[PlanKey] = []  # shapes seen; plan() plans each of them
        self._decode: dict[PlanKey, Any] = {}
        self._prefill: dict[tuple[PlanKey, bool], Any] = {}
        self._graph_wrappers: dict[tuple[PlanKey, int], Any] = {}
        self._graph: _GraphBuffers | None = None
        self._step: _Step | None = None

    # ---- set-up --------------------------------------------------------------------------
    def setup(self, specs: list, block_size: int, dtype: torch.dtype) -> None:
        """Declare every attention shape of the model (see `configure`)."""
        for s in specs:
            self.configure(s.num_heads, s.num_kv_heads, s.head_dim, block_size, dtype)

    def configure(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        scale: float | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> PlanKey:
        """Declare an attention shape up front, so `plan()` / `plan_graph()` can plan it before
        its first forward (required before the first `plan_graph`)."""
        scale = head_dim**-0.5 if scale is None else scale
        key = PlanKey(
            num_q_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype or dtype, float(scale)
        )
        if key not in self._keys:
            self._keys.append(key)
        return key

    def init_cuda_graph(
        self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device | str
    ) -> None:
        """Allocate the fixed page-table buffers the captured decode graphs read."""
        device = torch.device(device)
        self._graph = _GraphBuffers(
            kv_indptr=torch.zeros(max_batch_size + 1, dtype=torch.int32, device=device),
            kv_indices=torch.zeros(
                max_batch_size * max_blocks_per_seq, dtype=torch.int32, device=device
            ),
            last_page_len=torch.ones(max_batch_size, dtype=torch.int32, device=device),
            max_batch_size=max_batch_size,
        )
        self._graph_wrappers.clear()

    def _workspace_on(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None:  # FlashInfer wants it zeroed before its first use
            self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
        return self._workspace

    def _decode_tensor_cores(self, key: PlanKey) -> bool:
        group = key.num_qo_heads // key.num_kv_heads
        return self.use_tensor_cores or group not in FLASHINFER_CUDA_CORE_GROUPS

    # ---- planning ------------------------------------------------------------------------
    def plan(self, meta: BatchMetadata) -> None:
        """Plan this step for every known shape (outside graph capture)."""
        graph_batch = None
        if self._graph is not None and meta.num_prefills == 0 and meta.decode_query_len == 1:
            if any((key, meta.num_seqs) in self._graph_wrappers for key in self._keys):
                graph_batch = meta.num_seqs
        self._step = _Step(meta, graph_batch)
        nd = decode_wrapper_rows(meta)
        for key in self._keys:
            if graph_batch is not None:
                self._graph_wrapper(key, self._step)
                continue
            if nd:
                self._decode_wrapper(key, self._step)
            if meta.num_seqs > nd:
                self._prefill_wrapper(key, self._step, causal=True)

    def plan_graph(self, meta: BatchMetadata, batch_size: int) -> None:
        """Plan the CUDA-graph decode wrapper of padded size `batch_size` for this all-decode
        step (before its capture and before each replay, outside capture)."""
        if self._graph is None:
            raise RuntimeError("call init_cuda_graph() before plan_graph()")
        if not self._keys:
            raise RuntimeError("no attention shape known yet: call configure() first")
        if meta.num_prefills:
            raise ValueError("CUDA-graph steps must be all decodes")
        if meta.decode_query_len not in self.graph_query_lens:
            raise ValueError(
                f"FlashInfer graphs run decode rows of q in {self.graph_query_lens}, "
                f"not {meta.decode_query_len}"
            )
        if batch_size > self._graph.max_batch_size:
            raise ValueError(f"batch {batch_size} > max_batch_size {self._graph.max_batch_size}")
        self._step = _Step(meta, batch_size)
        for key in self._keys:
            self._graph_wrapper(key, self._step)

    def _tables(self, step: _Step, page_size: int) -> tuple[PageTable | None, PageTable | None]:
        """(decode, prefill) page tables of the step, built once per page size."""
        if page_size not in step.tables:
            meta, nd = step.meta, decode_wrapper_rows(step.meta)
            if step.graph_batch is not None:
                dec = build_page_table(meta, 0, meta.num_seqs, page_size, step.graph_batch)
                step.tables[page_size] = (dec, None)
            else:
                dec = build_page_table(meta, 0, nd, page_size) if nd else None
                has_pre = meta.num_seqs > nd
                pre = build_page_table(meta, nd, meta.num_seqs, page_size) if has_pre else None
                step.tables[page_size] = (dec, pre)
        return step.tables[page_size]

    @staticmethod
    def _must_plan(step: _Step, key: PlanKey, kind: str) -> bool:
        """True when `kind` still needs its plan this step (never inside graph capture)."""
        if (key, kind) in step.planned:
            return False
        if _capturing():
            raise RuntimeError(
                f"FlashInfer {kind} plan missing inside CUDA-graph capture: call "
                "plan_graph(meta, batch_size) (after configure()) before capturing"
            )
        return True

    def _plan_decode(self, wrapper: Any, key: PlanKey, table: PageTable) -> None:
        wrapper.plan(
            table.kv_indptr,
            table.kv_indices,
            table.last_page_len,
            key.num_qo_heads,
            key.num_kv_heads,
            key.head_dim,
            key.page_size,
            q_data_type=key.q_dtype,
            kv_data_type=key.kv_dtype,
            sm_scale=key.scale,
        )

    def _decode_wrapper(self, key: PlanKey, step: _Step) -> Any:
        wrapper = self._decode.get(key)
        if self._must_plan(step, key, "decode"):
            device = step.meta.block_tables.device
            if wrapper is None:
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace_on(device),
                    "NHD",
                    use_tensor_cores=self._decode_tensor_cores(key),
                    backend="fa2",
                )
                self._decode[key] = wrapper
            self._plan_decode(wrapper, key, self._tables(step, key.page_size)[0])
            step.planned.add((key, "decode"))
        return wrapper

    def _graph_wrapper(self, key: PlanKey, step: _Step) -> Any:
        bs = step.graph_batch
        wrapper = self._graph_wrappers.get((key, bs))
        if self._must_plan(step, key, "graph"):
            g = self._graph
            if wrapper is None:
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace_on(g.kv_indices.device),
                    "NHD",
                    use_cuda_graph=True,
                    use_tensor_cores=self._decode_tensor_cores(key),
                    paged_kv_indptr_buffer=g.kv_indptr[: bs + 1],
                    paged_kv_indices_buffer=g.kv_indices,
                    paged_kv_last_page_len_buffer=g.last_page_len[:bs],
                    backend="fa2",
                )
                self._graph_wrappers[(key, bs)] = wrapper
            self._plan_decode(wrapper, key, self._tables(step, key.page_size)[0])
            step.planned.add((key, "graph"))
        return wrapper

    def _prefill_wrapper(self, key: PlanKey, step: _Step, causal: bool) -> Any:
        wrapper = self._prefill.get((key, causal))
        kind = "prefill-causal" if causal else "prefill"
        if self._must_plan(step, key, kind):
            device = step.meta.block_tables.device
            if wrapper is None:
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    self._workspace_on(device), "NHD", backend=self.prefill_backend
                )
                self._prefill[(key, causal)] = wrapper
            table = self._tables(step, key.page_size)[1]
            wrapper.plan(
                table.qo_indptr,
                table.kv_indptr,
                table.kv_indices,
                table.last_page_len,
                key.num_qo_heads,
                key.num_kv_heads,
                key.head_dim,
                key.page_size,
                causal=causal,
                sm_scale=key.scale,
                q_data_type=key.q_dtype,
                kv_data_type=key.kv_dtype,
            )
            step.planned.add((key, kind))
        return wrapper

    # ---- the forward ---------------------------------------------------------------------
    def _step_for(self, meta: BatchMetadata) -> _Step:
        if self._step is None or self._step.meta is not meta:
            if _capturing():
                raise RuntimeError(
                    "FlashInfer: this batch was not planned before CUDA-graph capture; call "
                    "plan_graph(meta, batch_size) with the same metadata object first"
                )
            self.plan(meta)
        return self._step

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, page, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, page, Hkv, D]
        meta: BatchMetadata,
        scale: float,
        causal: bool = True,
    ) -> torch.Tensor:  # [T, Hq, D] in q's dtype
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.shape[0] == 0:
            return out
        if q.stride(-1) != 1:
            q = q.contiguous()
        hq, d = q.shape[1:]
        page, hkv = k_cache.shape[1:3]
        key = PlanKey(hq, hkv, d, page, q.dtype, k_cache.dtype, float(scale))
        step = self._step_for(meta)
        if key not in self._keys:
            self._keys.append(key)
        kv = (k_cache, v_cache)
        if step.graph_batch is not None:  # causal or not is the same for one query per row
            self._graph_wrapper(key, step).run(q, kv, out=out)
            return out
        # sequences 0 .. nd - 1 (one token row each) to the decode wrapper, the rest to prefill
        nd, total = decode_wrapper_rows(meta), meta.query_start_loc_cpu[-1]
        if nd:
            self._decode_wrapper(key, step).run(q[:nd], kv, out=out[:nd])
        if meta.num_seqs > nd:
            wrapper = self._prefill_wrapper(key, step, causal)
            wrapper.run(q[nd:total], kv, out=out[nd:total])
        if total < q.shape[0]:  # rows no sequence owns
            out[total:].zero_()
        return out
