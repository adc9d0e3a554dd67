"""One model on the device: its weights, layer specs, kernels, cache tensors and CUDA graphs.

The target model is one instance; a speculative drafter will be a second one, with its own
weights, caches and graphs, driven by the same runner. An instance knows nothing of sequences
or sampling: it runs forwards over prepared tensors (engine/step_prep.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from deltaserve import env
from deltaserve.backends import Capabilities, graph_blocker, load_backends, select_all
from deltaserve.cache.planner import CachePlan, allocate_caches, plan_caches
from deltaserve.config import EngineConfig
from deltaserve.distributed.parallel_state import tp_rank, tp_size
from deltaserve.engine.block_manager import cdiv
from deltaserve.engine.cuda_graph import DecodeGraphs
from deltaserve.engine.piecewise_graphs import PiecewiseGraphs, bucket_sizes, unsupported_reason
from deltaserve.engine.row_buckets import padded_rows
from deltaserve.forward_context import BatchMetadata, ForwardContext, Kernels, LayerCache
from deltaserve.loader.weights import build_model, load_weights
from deltaserve.logger import get_logger
from deltaserve.models.registry import get_model_class
from deltaserve.ops.compile_log import install_compile_log
from deltaserve.ops.gdn import GDNKernels
from deltaserve.ops.linear import TorchDecodeGemm, attach_decode_gemm
from deltaserve.spec.proposer import FINAL_HIDDEN_TAP

logger = get_logger(__name__)


def set_blas_library(device: torch.device) -> str | None:
    """Apply DELTASERVE_BLAS_LIBRARY (cuBLASLt unless told otherwise) on a CUDA device
    (process-wide, torch's `preferred_blas_library`), logged once; returns the library set, or
    None (`default`: PyTorch's own choice, or not a CUDA device)."""
    from deltaserve import env

    choice = env.blas_library()
    if choice == "default" or device.type != "cuda":
        return None
    torch.backends.cuda.preferred_blas_library(choice)
    if tp_rank() == 0:
        logger.info("CUDA matmuls through %s (DELTASERVE_BLAS_LIBRARY)", choice)
    return choice


class ModelInstance:
    """Weights (this rank's shard), specs, kernels; then caches (`allocate`) and decode graphs
    (`capture_graphs`). Construction loads the weights and chooses the backends."""

    def __init__(self, config: EngineConfig) -> None:
        install_compile_log()  # with DELTASERVE_LOG_COMPILES=1: every Triton compile from here on
        self.config = config
        mc = config.model
        self.device = mc.device
        set_blas_library(mc.device)
        model_cls = get_model_class(mc.architecture)
        tie = bool(getattr(mc.hf_config, "tie_word_embeddings", False))
        from deltaserve.multimodal.limits import no_image_reason

        # why images are refused (None: the vision tower is built and loaded)
        self.no_image_reason = no_image_reason(config)
        extra = {}
        if getattr(model_cls, "supports_images", False) and self.no_image_reason is None:
            extra["vision_config"] = mc.hf_config.vision_config
        elif self.no_image_reason is None:
            self.no_image_reason = f"{mc.architecture} has no vision tower in deltaserve"
        elif getattr(model_cls, "supports_images", False) and tp_rank() == 0:
            logger.info("image input off: %s", self.no_image_reason)
        spec = config.speculative
        if spec is not None and spec.method == "mtp":  # the checkpoint's own MTP head
            from deltaserve.spec.mtp.checks import check_mtp_target

            check_mtp_target(model_cls, mc.architecture, mc.path, mc.random_model is not None)
            extra["with_mtp"] = True
        self.model = build_model(model_cls, mc.text_config, tie, mc.dtype, mc.device, **extra)
        stack = getattr(self.model, "model", None)
        if tp_size() > 1 and hasattr(stack, "leave_sums_to_norms"):
            # each block's all-reduce moves into the norm after it (fused there where the
            # symmetric-memory kernel is installed: parallel_state.all_reduce_rms_norm)
            stack.leave_sums_to_norms()
        if mc.random_model is not None:
            from deltaserve.loader.random_model import init_random_weights

            # NOTE: under TP each rank fills its own shard: the model differs from the TP=1
            # one (fine for speed, not for comparing outputs)
            init_random_weights(self.model, mc.seed)
            logger.info("random weights for preset %s (seed %d)", mc.random_model, mc.seed)
        else:
            load_weights(self.model, mc.path)
        self.specs = self.model.layer_specs()
        self.pools = {s.pool for s in self.specs}  # pool kinds this model's caches use

        caps = Capabilities.from_specs(
            self.model.capability_specs(),
            mc.device,
            mc.dtype,
            config.cache.state_dtype,
            config.cache.block_size,
        )
        self.backend_decisions = select_all(caps, dict(config.backends))
        if tp_rank() == 0:
            for decision in self.backend_decisions.values():
                logger.info("backend %s", decision.describe())
            if mc.device.type == "cuda":  # (Triton: a lazy import)
                from deltaserve.ops import pdl

                logger.info("%s", pdl.describe(mc.device))
        self.backends = load_backends(self.backend_decisions)
        gdn = None
        if all(op in self.backends for op in ("conv1d", "gdn_prefill", "gdn_decode")):
            b = self.backends
            gdn = GDNKernels(b["conv1d"], b["gdn_prefill"], b["gdn_decode"])
        self.kernels = Kernels(
            attention=self.backends.get("attention"),
            gdn=gdn,
            fused=self.backends["fused"],
            moe=self.backends.get("moe"),
            mla=self.backends.get("mla"),
        )
        gemm = self.backends["decode_gemm"]
        # the reference is F.linear itself: the layers keep their plain path
        attach_decode_gemm(self.model, None if isinstance(gemm, TorchDecodeGemm) else gemm)
        for kind, backend in self.planned_backends().items():
            kind_specs = list(dict.fromkeys(s for s in self.specs if s.layer_kind == kind))
            backend.setup(kind_specs, config.cache.block_size, mc.dtype)
        self.caches: list[LayerCache] = []
        self.graphs: DecodeGraphs | None = None
        # speculative decoding: meta -> the GDN scratch of a verify graph (q > 1), or None
        self.graph_spec_verify: Any = None
        # decoder layers whose outputs every forward keeps (a drafter's taps; FINAL_HIDDEN_TAP:
        # the final-normed hidden state, the lm_head's input), and the static buffer
        # [max graph tokens, n_taps, hidden] that decode graphs write them into
        self.tap_layers: tuple[int, ...] = ()
        self.graph_taps: torch.Tensor | None = None
        self.last_hidden_states: dict[int, torch.Tensor] = {}
        # eager forwards over token rows rounded up to a bucket (engine/row_buckets.py)
        buckets = env.row_buckets()
        self.row_buckets = buckets == "on" or (buckets == "auto" and self.device.type == "cuda")
        self.num_eager_forwards = 0  # `forward` calls (the bench counts collectives per forward)
        # short eager steps' dense part from CUDA graphs (engine/piecewise_graphs.py)
        self.piecewise: PiecewiseGraphs | None = None

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size  # the global vocabulary

    def plan_caches(self, extra_specs: list | None = None) -> CachePlan:
        """How many units each cache pool gets within the memory budget (weights loaded), with
        `extra_specs` (a drafter's layers) sharing the pools."""
        return plan_caches(list(self.specs) + list(extra_specs or []), self.config)

    def allocate(self, plan: CachePlan) -> None:
        self.caches = allocate_caches(self.specs, plan, self.config)

    # ---- CUDA graphs -------------------------------------------------------------------
    def no_graph_reason(self) -> str | None:
        """Why decode steps cannot run in CUDA graphs, or None."""
        if self.config.enforce_eager:
            return "enforce_eager"
        if env.emulate_cuda_graphs():  # eager "graphs" on any device: no capture to block
            return None
        if self.device.type != "cuda":
            return "no CUDA device"
        return graph_blocker(self.backends)

    def capture_graphs(self, max_batch_size: int, query_lens: tuple[int, ...] = (1,)) -> None:
        """Capture decode graphs of up to `max_batch_size` rows of q tokens, q in `query_lens`;
        with `tap_layers` set, every graph also writes those layers' outputs into `graph_taps`
        (a replay's `last_hidden_states`, as after an eager forward)."""
        mc = self.config.model
        max_blocks = cdiv(mc.max_model_len, self.config.cache.block_size)
        if self.tap_layers:
            tokens = max_batch_size * max(query_lens)
            hidden = int(mc.text_config.hidden_size)
            self.graph_taps = torch.zeros(
                tokens, len(self.tap_layers), hidden, dtype=mc.dtype, device=self.device
            )
        for backend in self.planned_backends().values():
            backend.init_cuda_graph(max_batch_size, max_blocks, self.device)
        self.graphs = DecodeGraphs(
            self.forward_logits,
            self._plan_graph,
            max_batch_size,
            max_blocks,
            self.device,
            query_lens,
            emulate=env.emulate_cuda_graphs(),
            # NOTE: under TP the NCCL watchdog thread may query earlier work's events while
            # this thread captures: only this thread's calls are checked during capture
            capture_error_mode="thread_local" if tp_size() > 1 else "global",
        )
        self.graphs.capture()

    def capture_piecewise(self, max_tokens: int) -> str | None:
        """Capture the piecewise graphs of eager steps of up to `max_tokens` tokens (after the
        decode graphs: only where those are captured; no bucket past the one that holds the
        step token budget); returns why not, or None."""
        sizes = bucket_sizes(max_tokens, self.config.scheduler.max_num_batched_tokens)
        emulate = env.emulate_cuda_graphs()
        reason = unsupported_reason(self.model, self.kernels, emulate)
        if reason is None and not sizes:
            reason = "DELTASERVE_PIECEWISE_GRAPH_TOKENS=0"
        if reason is not None:
            return reason
        self.piecewise = PiecewiseGraphs(
            self.model, self.kernels, sizes, self.device, emulate=emulate, taps=self.tap_layers
        )
        self.piecewise.capture()
        return None

    def graph_fits(self, num_seqs: int, q: int = 1) -> bool:
        """Whether an all-decode step of `num_seqs` rows of q tokens can replay a graph."""
        return self.graphs is not None and self.graphs.bucket(num_seqs, q) is not None

    def graph_bucket(self, num_seqs: int, q: int = 1) -> int | None:
        """The bucket an all-decode step of `num_seqs` rows of q tokens replays, or None."""
        return None if self.graphs is None else self.graphs.bucket(num_seqs, q)

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata
    ) -> torch.Tensor:
        """The all-decode step in its graph: logits of every token row [B * q, vocab]; the
        tapped layers' outputs of those rows are in `last_hidden_states` afterwards (views of
        the static `graph_taps`, valid until the next replay)."""
        assert self.graphs is not None
        logits = self.graphs.replay(input_ids, positions, meta)
        self.last_hidden_states = {}
        if self.graph_taps is not None:
            t = meta.num_seqs * meta.decode_query_len
            taps = self.graph_taps[:t]  # [t, n_taps, hidden]
            self.last_hidden_states = {i: taps[:, j] for j, i in enumerate(self.tap_layers)}
        return logits

    def planned_backends(self) -> dict[str, Any]:
        """The backends with start-up setup, per-step plans and CUDA-graph hooks (`setup`,
        `plan`, `plan_graph`, `init_cuda_graph`, `graph_query_lens`) by the layer kind they serve:
        paged attention ("attention") and MLA ("mla"), those the model has."""
        pairs = (("attention", self.kernels.attention), ("mla", self.kernels.mla))
        return {kind: b for kind, b in pairs if b is not None}

    def _plan_graph(self, meta: BatchMetadata, batch_size: int) -> None:
        for backend in self.planned_backends().values():
            backend.plan_graph(meta, batch_size)

    # ---- forwards ----------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: BatchMetadata,
        hidden_layers: tuple[int, ...] = (),
        spec_verify: Any = None,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Eager forward: final hidden states [T, hidden] (the states of `hidden_layers` are in
        `self.last_hidden_states` afterwards). `spec_verify`: a verify step's GDN scratch
        (deltaserve.spec.gdn_rollback). A step that fits a piecewise bucket runs from the
        piecewise graphs (engine/piecewise_graphs.py): then the results are views of static
        buffers, valid until the next forward."""
        self.num_eager_forwards += 1
        for backend in self.planned_backends().values():
            backend.plan(meta)
        T = input_ids.shape[0]
        pw = self.piecewise
        pieces = None  # the piecewise bucket the step runs in, or None (eager)
        if (
            pw is not None
            and all(i == FINAL_HIDDEN_TAP or i in pw.tap_index for i in hidden_layers)
            and spec_verify is None
            and mm_embeds is None
            and positions.dim() == 1
        ):
            pieces = pw.bucket(T)
        rows = pieces or (padded_rows(T) if self.row_buckets else T)
        ctx = ForwardContext(
            meta=meta,
            caches=self.caches,
            kernels=self.kernels,
            hidden_layers=hidden_layers,
            spec_verify=spec_verify,
            mm_embeds=mm_embeds,
            num_tokens=T if rows != T else None,
        )
        if pieces is not None:
            hidden = pw.run(input_ids, positions, ctx)
            self.last_hidden_states = pw.tapped(T)
        else:
            if rows != T:  # padding rows: token id 0 at position 0 (engine/row_buckets.py)
                input_ids = F.pad(input_ids, (0, rows - T))
                positions = F.pad(positions, (0, rows - T))  # [rows] or [3, rows] (M-RoPE)
            hidden = self.model(input_ids, positions, ctx)[:T]
            self.last_hidden_states = {i: h[:T] for i, h in ctx.hidden_states.items()}
        if FINAL_HIDDEN_TAP in hidden_layers:
            self.last_hidden_states[FINAL_HIDDEN_TAP] = hidden
        return hidden

    def forward_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata
    ) -> torch.Tensor:
        """Model forward and lm_head over every row (the body of a decode graph; verify
        graphs, q > 1, carry the GDN scratch of `graph_spec_verify`; the outputs of
        `tap_layers` go to the static `graph_taps`)."""
        spec = None
        if self.graph_spec_verify is not None and meta.decode_query_len > 1:
            spec = self.graph_spec_verify(meta)
        ctx = ForwardContext(
            meta=meta,
            caches=self.caches,
            kernels=self.kernels,
            hidden_layers=self.tap_layers,
            spec_verify=spec,
        )
        hidden = self.model(input_ids, positions, ctx)
        logits = self.model.compute_logits(hidden)
        if self.graph_taps is not None:
            ctx.hidden_states[FINAL_HIDDEN_TAP] = hidden  # the lm_head's input, kept too
            taps = self.graph_taps[: input_ids.shape[0]]  # [T, n_taps, hidden]
            for j, i in enumerate(self.tap_layers):
                taps[:, j].copy_(ctx.hidden_states[i])
        return logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def encode_images(self, pixel_values: torch.Tensor, grids: list) -> list[torch.Tensor]:
        """The vision tower over several images' patches (host float32, concatenated) -> each
        image's embeddings [num_tokens, hidden] on the device, in the model dtype."""
        mc = self.config.model
        pixels = pixel_values.to(mc.device, mc.dtype, non_blocking=True)
        return self.model.encode_images(pixels, grids)
