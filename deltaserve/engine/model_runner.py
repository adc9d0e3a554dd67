"""The model runner: turns scheduled batches into forwards of the model instance and sampled
tokens.

Roles, one file each: the model on the device (engine/model_instance.py: weights, caches,
graphs, forward), step preparation (engine/step_prep.py: host lists -> device tensors) and
logits / sampling (engine/logits.py: row planning, prompt logprobs, draft acceptance).

Under tensor parallelism every rank has a runner holding its shard of the weights and its heads'
caches; rank 0's `execute` broadcasts each step's `StepInput` and the other ranks run the same
forward from it in `run_worker_step` (deltaserve.distributed.worker). Only rank 0 samples.
"""

from __future__ import annotations

import time

import torch

from deltaserve import env
from deltaserve.cache.ops import apply_cache_ops
from deltaserve.cache.planner import CachePlan, describe_capacity
from deltaserve.cache.pools import POOL_KINDS
from deltaserve.config import EngineConfig
from deltaserve.distributed.parallel_state import (
    all_reduce_min_host,
    broadcast_object,
    broadcast_tensor,
    setup_symm_all_reduce,
    tp_rank,
    tp_size,
)
from deltaserve.engine.async_step import AsyncStep, SampledIdBuffers
from deltaserve.engine.block_manager import cdiv
from deltaserve.engine.logits import (
    LogitsProcessor,
    PromptLogprobsUse,
    RunnerOutput,
    SampleUse,
    iter_logits,
    plan_logits,
    sampling_batch,
)
from deltaserve.engine.model_instance import ModelInstance
from deltaserve.engine.sampler import Sampler
from deltaserve.engine.scheduler import ScheduledBatch
from deltaserve.engine.sequence import Sequence
from deltaserve.engine.spec_steps import after_verify, log_spec_graphs, verify_scratch
from deltaserve.engine.stats import StepTimer
from deltaserve.engine.step_prep import (
    BatchStager,
    StepInput,
    build_step_input,
    step_checkpoints,
)
from deltaserve.forward_context import BatchMetadata
from deltaserve.logger import get_logger
from deltaserve.multimodal.step import build_encoder_cache, step_image_embeds

logger = get_logger(__name__)


class ModelRunner:
    """One rank's model instance, step staging and sampling."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.device = mc.device
        self.stager = BatchStager(self.device)
        # seconds of each start-up phase, for the engine's ready line
        self.startup_s: dict[str, float] = {}
        self._phase_start = time.perf_counter()
        error: Exception | None = None
        plan = CachePlan()
        # speculative decoding: the proposer (a drafter is loaded here, before the caches are
        # planned, so its weights and its cache specs count in the memory budget)
        self.proposer = None
        try:
            self.instance = ModelInstance(config)
            if config.speculative is not None:
                from deltaserve.spec.proposer import build_proposer

                self.proposer = build_proposer(config.speculative, config)
                self.proposer.bind(self.instance)
            plan = self.instance.plan_caches(self._proposer_specs())
        except Exception as e:  # under TP, tell the other ranks before raising
            if tp_size() == 1:
                raise
            error = e
        self._end_phase("model")
        units = self._agree([plan.units.get(name, 0) for name in POOL_KINDS], error)
        self.plan = plan.with_units(dict(zip(POOL_KINDS, units)))
        try:
            self.instance.allocate(self.plan)
            if self._proposer_specs():
                self.proposer.allocate(self.plan, config)
        except Exception as e:
            if tp_size() == 1:
                raise
            error = e
        self._agree([], error)  # every rank has its caches (or all fail together)
        if tp_size() > 1:  # before any capture: the graphs hold the all-reduce kernels chosen
            how = setup_symm_all_reduce(mc.dtype, self.device, env.tp_all_reduce())
            logger.info("tensor-parallel rank %d: all-reduce: %s", tp_rank(), how)
        error = None
        try:
            self._finish_setup()
        except Exception as e:
            if tp_size() == 1:
                raise
            error = e
        # every rank captures the same buckets or none does (the ranks replay in lockstep)
        ok = error is None
        max_batch, all_can = self._agree(
            [self._max_graph_batch(), int(self._graph_reason is None)] if ok else [0, 0], error
        )
        if self._graph_reason is None and not all_can:
            self._graph_reason = "another tensor-parallel rank cannot capture decode graphs"
        self._end_phase("caches")
        try:
            self._capture_graphs(max_batch)
        except Exception as e:
            if tp_size() == 1:
                raise
            error = e
        # NOTE: the last start-up checkpoint: past it every rank is ready, the workers enter
        # their step loop and rank 0 owes them the stop message
        self._agree([], error)

    def _end_phase(self, name: str) -> None:
        """Record the seconds since the last phase ended as start-up phase `name`."""
        now = time.perf_counter()
        self.startup_s[name] = now - self._phase_start
        self._phase_start = now

    def _capture_graphs(self, max_batch: int) -> None:
        """Capture the decode graphs (of at most `max_batch` rows, agreed by every rank), or
        log why decode runs eagerly; under TP each rank says what it runs."""
        config, mc = self.config, self.config.model
        reason = self._graph_reason
        if reason is None:
            self.instance.capture_graphs(max_batch, self._graph_query_lens())
            if self.gdn_rollback is not None:  # the rollback of all GDN layers, per bucket
                self.gdn_rollback.capture_graphs(self.instance.graphs.buckets)
            if hasattr(self.proposer, "capture_graphs"):  # a drafter's own forward
                self.proposer.capture_graphs(
                    max_batch,
                    cdiv(mc.max_model_len, config.cache.block_size),
                    emulate=self.instance.graphs.emulate,
                )
            if config.speculative is not None:
                log_spec_graphs(self.instance.graphs, self.tap_layers)
            self._end_phase("decode graphs")
            why = self.instance.capture_piecewise(env.piecewise_graph_tokens())
            if why is not None and tp_rank() == 0:
                logger.info("eager steps run without piecewise CUDA graphs: %s", why)
            self._end_phase("piecewise graphs")
        graphs = self.instance.graphs
        if tp_size() > 1:
            if graphs is not None:
                emulated = ", emulated" if graphs.emulate else ""
                how = f"in CUDA graphs (batch buckets {graphs.buckets}{emulated})"
            else:
                how = f"eagerly ({reason})"
            logger.info(
                "tensor-parallel rank %d: decode runs %s, overlapped decode %s",
                tp_rank(),
                how,
                "on" if config.async_scheduling else "off",
            )
        elif reason is not None:
            logger.info("decode runs eagerly: %s", reason)

    def _finish_setup(self) -> None:
        """Sampling and speculative decoding's helpers (after the caches); whether decode can
        run in CUDA graphs here. No collectives."""
        config, mc = self.config, self.config.model
        self.logits = LogitsProcessor(
            Sampler(
                torch.Generator(device=self.device).manual_seed(mc.seed),
                self.instance.kernels.fused.argmax,
            ),
            self.instance.vocab_size,
        )
        if tp_rank() == 0:
            logger.info("cache: %s", describe_capacity(self.plan, config))
        self.encoder_cache = None  # image models: vision embeddings by content hash
        if self.instance.no_image_reason is None:
            self.encoder_cache = build_encoder_cache(config, self.instance.model)
        self.timer = StepTimer(False)  # the engine swaps in its own when stats are on
        self._sampled_ids = SampledIdBuffers(config.scheduler.max_num_seqs, self.device)
        self._peer_sampled_ids: torch.Tensor | None = None  # TP ranks > 0: rank 0's last ids
        # speculative decoding: target layers a proposer reads (every forward keeps their
        # outputs, graph replays included), GDN rollback after verify steps
        self.tap_layers: tuple[int, ...] = tuple(getattr(self.proposer, "tap_layer_ids", ()))
        self.instance.tap_layers = self.tap_layers
        self.gdn_rollback = None
        if config.speculative is not None:
            from deltaserve.spec.gdn_rollback import build_gdn_rollback

            self.gdn_rollback = build_gdn_rollback(
                self.instance, self.plan.units.get("slots", 0), config
            )
        self._graph_reason = self._no_graph_reason()

    def _proposer_specs(self) -> list:
        """The cache specs of the proposer's own layers (a drafter's KV), planned with the
        target's; none for proposers without layers."""
        layer_specs = getattr(self.proposer, "layer_specs", None)
        return list(layer_specs()) if layer_specs is not None else []

    # ---- what the engine and tools read ------------------------------------------------
    @property
    def model(self):
        return self.instance.model

    @property
    def specs(self):
        return self.instance.specs

    @property
    def caches(self):
        return self.instance.caches

    @property
    def graphs(self):
        return self.instance.graphs

    @property
    def backend_decisions(self):
        return self.instance.backend_decisions

    @property
    def vocab_size(self) -> int:
        return self.instance.vocab_size

    @property
    def sampler(self) -> Sampler:
        return self.logits.sampler

    @staticmethod
    def _agree(values: list[int], error: Exception | None) -> list[int]:
        """Under TP, a start-up checkpoint: the element-wise minimum of `values` over the ranks
        (cache blocks and slots: ids mean the same on every rank), and a failure on one rank
        fails them all instead of leaving the others waiting in a collective."""
        if tp_size() == 1:
            return values
        ok = error is None
        *agreed, all_ok = all_reduce_min_host([v if ok else 0 for v in values] + [int(ok)])
        if error is not None:
            raise error
        if not all_ok:
            raise RuntimeError(
                "another tensor-parallel rank failed to start (its error is in its log)"
            )
        return agreed

    def _no_graph_reason(self) -> str | None:
        return self.instance.no_graph_reason()

    def _graph_query_lens(self) -> tuple[int, ...]:
        """q = 1, and q = 1 + k for verify steps while speculating where the attention backend
        can run such rows in a graph (the GDN scratch of a verify graph is static)."""
        spec = self.config.speculative
        if spec is None:
            return (1,)
        # emulated graphs run eagerly, where every backend serves any q
        emulated = env.emulate_cuda_graphs()
        for kind, backend in self.instance.planned_backends().items():
            if spec.query_len not in backend.graph_query_lens and not emulated:
                logger.info(
                    "verify steps (q = %d) run eagerly: the %s backend %s captures q in %s",
                    spec.query_len,
                    "MLA" if kind == "mla" else kind,
                    backend.name,
                    list(backend.graph_query_lens),
                )
                return (1,)
        if self.gdn_rollback is not None:
            self.instance.graph_spec_verify = self.gdn_rollback.graph_scratch
        return (1, spec.query_len)

    def _max_graph_batch(self) -> int:
        limit = self.config.scheduler.max_num_seqs
        if self.plan.num_slots:
            limit = min(limit, self.plan.num_slots - 1)
        if self.gdn_rollback is not None:
            limit = min(limit, self.gdn_rollback.max_rows)
        return max(1, min(limit, 512))

    # ---- one step ----------------------------------------------------------------------
    def _prepare(self, batch: ScheduledBatch) -> tuple[list, StepInput]:
        """Apply the batch's cache operations and build its host-side step (decodes first)."""
        self.apply_cache_ops(batch.cache_ops)
        items = batch.decodes_first()
        step = self._step_input(items)
        step.cache_ops = list(batch.cache_ops)  # the other TP ranks apply them too
        step.checkpoints = step_checkpoints(items, batch.checkpoints)  # in-step snapshots
        return items, step

    def apply_cache_ops(self, ops: list) -> None:
        """Apply cache operations (copies between state slots and snapshots) to this rank's
        caches, in order, on the device's stream."""
        if ops:
            apply_cache_ops(ops, self.specs, self.caches, self.instance.kernels.fused)

    def _step_input(self, items: list[tuple[Sequence, int]]) -> StepInput:
        has_paged = "paged" in self.instance.pools
        return build_step_input(items, self.config.cache.block_size, has_paged)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, banned: dict[int, list[int]]) -> RunnerOutput:
        """Run the model on the batch; sample for sequences whose last token was computed (every
        position of a row with drafts, accepting drafts) and collect prompt logprobs where
        asked. `banned` maps seq_id -> token ids to forbid while short of min_tokens."""
        items, step = self._prepare(batch)
        uses = plan_logits(items, step)
        input_ids, positions, meta = self.stager.tensors(step)
        spec_verify = verify_scratch(self.gdn_rollback, items, step)
        mm_embeds = None
        if self.encoder_cache is not None:  # placeholder rows of this step, encoded if needed
            mm_embeds = step_image_embeds(items, step, self.instance, self.encoder_cache)
        timer = self.timer
        timer.mark("prepare")
        out = RunnerOutput()
        inst = self.instance
        if (
            (spec_verify is None or inst.graph_spec_verify is not None)
            and mm_embeds is None
            and positions.dim() == 1
            and meta.num_decodes == meta.num_seqs
            and inst.graph_fits(meta.num_seqs, meta.decode_query_len)
            and len(uses) == 1
            and isinstance(uses[0], SampleUse)
            and sum(uses[0].num_rows) == meta.num_decode_tokens  # every row sampled: no select
        ):
            # the other TP ranks replay the same bucket (no-op without TP)
            step.graph_bucket = inst.graph_bucket(meta.num_seqs, meta.decode_query_len)
            broadcast_object(step)
            logits = inst.replay(input_ids, positions, meta)  # [B * q, vocab], row order kept
            timer.mark("forward")
            self.logits.sample(logits, uses[0], banned, out)
            timer.mark("sample")
            if self.config.speculative is not None:
                # NOTE: a verify graph's rows are all draft rows, in batch order: the same
                # record rows and scratch slots as the eager `spec_verify` of this step
                after_verify(self, items, step, out, spec_verify is not None)
            return out

        broadcast_object(step)  # the other TP ranks run the same step (no-op without TP)
        hidden = inst.forward(
            input_ids, positions, meta, self.tap_layers, spec_verify, mm_embeds=mm_embeds
        )
        timer.mark("forward")
        for use, logits in zip(uses, iter_logits(inst, hidden, step), strict=True):
            if isinstance(use, PromptLogprobsUse):
                self.logits.prompt_logprobs(use, logits, out)
            else:
                self.logits.sample(logits, use, banned, out)
        timer.mark("sample")  # prompt logprobs and the lm_head are billed to sampling
        if self.config.speculative is not None:
            after_verify(self, items, step, out, spec_verify is not None)
        return out

    @torch.inference_mode()
    def execute_async(
        self,
        items: list[tuple[Sequence, int]],
        banned: dict[int, list[int]],
        prev: AsyncStep | None,
        cache_ops: list | None = None,
    ) -> AsyncStep:
        """Launch a pure decode step (engine/async_step.py) without waiting for the GPU: the
        forward (its CUDA graph where one fits), sampling, and the copy of the sampled ids to
        the host. Tokens pending on the host come from `prev`'s ids on the device. The batch's
        `cache_ops` are applied first, in stream order."""
        self.apply_cache_ops(cache_ops or [])
        step = self._step_input(items)
        if step.num_decodes != len(items) or step.decode_query_len != 1:
            raise ValueError("an overlapped step must be all one-token decodes")
        prev_ids = None
        if prev is not None:
            rows = prev.row_of()
            step.prev_rows = [
                rows[seq.seq_id] if seq.num_pending_tokens else -1 for seq, _ in items
            ]
            prev_ids = prev.device_ids
        elif any(seq.num_pending_tokens for seq, _ in items):
            raise ValueError("a pending token without the step that samples it")
        input_ids, positions, meta = self.stager.tensors(step, prev_ids)
        timer = self.timer
        timer.mark("prepare")
        seqs = [seq for seq, _ in items]
        inst = self.instance
        # the other TP ranks run the same step, taking its pending tokens from the sampled ids
        # rank 0 broadcasts on the device group after every overlapped step (below)
        step.graph_bucket = inst.graph_bucket(len(seqs))
        step.shares_sampled_ids = True
        broadcast_object(step)
        if step.graph_bucket is not None:
            logits = inst.replay(input_ids, positions, meta)  # [B, vocab]
        else:
            logits = inst.compute_logits(inst.forward(input_ids, positions, meta))
        timer.mark("forward")
        device_ids = self.sampler.sample_ids(logits, sampling_batch(seqs, banned))  # [B]
        broadcast_tensor(device_ids)  # stream-ordered: the host does not wait (no-op w/o TP)
        host_ids = self._sampled_ids.next(len(seqs))
        host_ids.copy_(device_ids, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        timer.mark("sample")
        return AsyncStep(seqs, device_ids, host_ids, event)

    @torch.inference_mode()
    def run_worker_step(self, step: StepInput) -> None:
        """A TP rank other than 0 runs rank 0's step (deltaserve/distributed/worker_step.py)."""
        from deltaserve.distributed.worker_step import run_worker_step

        run_worker_step(self, step)

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata
    ) -> torch.Tensor:
        """Eager forward of prepared tensors (tools and tests)."""
        return self.instance.forward(input_ids, positions, meta)
