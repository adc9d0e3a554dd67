"""The one owner of the device: weights, cache tensors, batch metadata, kernels, sampling.

Under tensor parallelism every rank has a runner holding its shard of the weights and its heads'
caches; rank 0's `execute` broadcasts each step's `StepInput` and the other ranks run the same
forward from it in `run_worker_step` (deltaserve.distributed.worker). Only rank 0 samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from deltaserve.backends import Capabilities, select_all
from deltaserve.cache.planner import (
    CachePlan,
    allocate_caches,
    describe_capacity,
    plan_caches,
)
from deltaserve.cache.pools import POOL_KINDS
from deltaserve.config import EngineConfig
from deltaserve.distributed.parallel_state import (
    all_reduce_min_host,
    broadcast_object,
    tp_rank,
    tp_size,
)
from deltaserve.engine.async_step import PLACEHOLDER, AsyncStep, SampledIdBuffers
from deltaserve.engine.block_manager import cdiv
from deltaserve.engine.cuda_graph import DecodeGraphs
from deltaserve.engine.sampler import Sampler, SamplingBatch, compute_logprobs_topk, has_penalties
from deltaserve.engine.scheduler import ScheduledBatch
from deltaserve.engine.sequence import Sequence
from deltaserve.engine.stats import StepTimer
from deltaserve.engine.step_input import (
    BatchStager,
    StepInput,
    build_step_input,
    select_rows,
)
from deltaserve.forward_context import BatchMetadata, ForwardContext, Kernels
from deltaserve.loader.weights import build_model, load_weights
from deltaserve.logger import get_logger
from deltaserve.models.base import AttentionSpec, GDNSpec
from deltaserve.models.registry import get_model_class
from deltaserve.ops.gdn import GDNKernels
from deltaserve.ops.linear import TorchDecodeGemm, attach_decode_gemm

logger = get_logger(__name__)


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    rank: int
    top_logprobs: list[tuple[int, float]]


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens `start .. start + len(token_logprobs) - 1`."""

    start: int
    token_ids: list[int]
    token_logprobs: list[float]
    ranks: list[int]
    top_logprobs: list[list[tuple[int, float]]]


@dataclass
class _PromptLogprobsUse:
    """A logits group that scores prompt tokens `lo + 1 ..` of `seq` (targets given)."""

    seq: Sequence
    lo: int
    targets: list[int]


@dataclass
class RunnerOutput:
    sampled: dict[int, SampledToken] = field(default_factory=dict)  # seq_id -> token
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)


class ModelRunner:
    """Weights, caches and kernels of one rank; turns scheduled batches into forwards."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.device = mc.device
        self.stager = BatchStager(self.device)
        error: Exception | None = None
        plan = CachePlan()
        try:
            plan = self._build(config)
        except Exception as e:  # under TP, tell the other ranks before raising
            if tp_size() == 1:
                raise
            error = e
        units = self._agree([plan.units.get(name, 0) for name in POOL_KINDS], error)
        self.plan = plan.with_units(dict(zip(POOL_KINDS, units)))
        try:
            self.caches = allocate_caches(self.specs, self.plan, config)
        except Exception as e:
            if tp_size() == 1:
                raise
            error = e
        self._agree([], error)  # every rank has its caches (or all fail together)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(mc.seed))
        if tp_rank() == 0:
            logger.info("cache: %s", describe_capacity(self.plan, config))
        self.timer = StepTimer(False)  # the engine swaps in its own when stats are on
        self._sampled_ids = SampledIdBuffers(config.scheduler.max_num_seqs, self.device)
        self.graphs: DecodeGraphs | None = None
        reason = self._no_graph_reason()
        if reason is None:
            max_bs = self._max_graph_batch()
            max_blocks = cdiv(mc.max_model_len, config.cache.block_size)
            if self.kernels.attention is not None:
                self.kernels.attention.init_cuda_graph(max_bs, max_blocks, self.device)
            self.graphs = DecodeGraphs(
                self._forward_logits, self._plan_graph, max_bs, max_blocks, self.device
            )
            self.graphs.capture()
        elif tp_rank() == 0:
            logger.info("decode runs eagerly: %s", reason)

    def _build(self, config: EngineConfig) -> CachePlan:
        """Weights (this rank's shard), layer specs (this rank's heads), kernels, cache plan."""
        mc = config.model
        model_cls = get_model_class(mc.architecture)
        tie = bool(getattr(mc.hf_config, "tie_word_embeddings", False))
        self.model = build_model(model_cls, mc.text_config, tie, mc.dtype, mc.device)
        if mc.random_model is not None:
            from deltaserve.loader.random_model import init_random_weights

            # NOTE: under TP each rank fills its own shard: the model differs from the TP=1
            # one (fine for speed, not for comparing outputs)
            init_random_weights(self.model, mc.seed)
            logger.info("random weights for preset %s (seed %d)", mc.random_model, mc.seed)
        else:
            load_weights(self.model, mc.path)
        self.specs = self.model.layer_specs()
        self.has_attention = any(isinstance(s, AttentionSpec) for s in self.specs)
        self.has_gdn = any(isinstance(s, GDNSpec) for s in self.specs)

        caps = Capabilities.from_specs(
            self.specs, mc.device, mc.dtype, config.cache.state_dtype, config.cache.block_size
        )
        self.backend_decisions = select_all(caps, config.forced_backends)
        if tp_rank() == 0:
            for decision in self.backend_decisions.values():
                logger.info("backend %s", decision.describe())
        gdn = None
        if self.has_gdn:
            gdn = GDNKernels(
                self._load("conv1d"), self._load("gdn_prefill"), self._load("gdn_decode")
            )
        self.kernels = Kernels(
            attention=self._load("attention"), gdn=gdn, fused=self._load("fused")
        )
        gemm = self._load("decode_gemm")
        # the reference is F.linear itself: the layers keep their plain path
        attach_decode_gemm(self.model, None if isinstance(gemm, TorchDecodeGemm) else gemm)
        if self.kernels.attention is not None:
            attn_specs = list(dict.fromkeys(s for s in self.specs if isinstance(s, AttentionSpec)))
            self.kernels.attention.setup(attn_specs, config.cache.block_size, mc.dtype)
        return plan_caches(self.specs, config)

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
        if self.device.type != "cuda":
            return "no CUDA device"
        if self.config.enforce_eager:
            return "enforce_eager"
        if tp_size() > 1:
            # NOTE: capture would work with NCCL, but the workers would have to replay the same
            # graphs step by step; not wired up yet
            return "tensor parallelism (decode CUDA graphs are not captured under TP yet)"
        k = self.kernels
        for op, backend in (
            ("attention", k.attention),
            ("conv1d", k.gdn and k.gdn.conv),
            ("gdn_decode", k.gdn and k.gdn.decode),
        ):
            if backend is not None and not backend.supports_cuda_graph:
                return f"{op} backend {backend.name} cannot be captured in a CUDA graph"
        return None

    def _max_graph_batch(self) -> int:
        limit = self.config.scheduler.max_num_seqs
        if self.plan.num_slots:
            limit = min(limit, self.plan.num_slots - 1)
        return max(1, min(limit, 512))

    def _graph_fits(self, num_seqs: int) -> bool:
        """Whether an all-decode step of `num_seqs` sequences can replay a captured graph."""
        return self.graphs is not None and self.graphs.bucket(num_seqs) is not None

    def _plan(self, meta: BatchMetadata) -> None:
        if self.kernels.attention is not None:
            self.kernels.attention.plan(meta)

    def _plan_graph(self, meta: BatchMetadata, batch_size: int) -> None:
        if self.kernels.attention is not None:
            self.kernels.attention.plan_graph(meta, batch_size)

    def _forward_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata
    ) -> torch.Tensor:
        """Model forward and lm_head over every row (the body of a decode graph)."""
        ctx = ForwardContext(meta=meta, caches=self.caches, kernels=self.kernels)
        return self.model.compute_logits(self.model(input_ids, positions, ctx))

    def _load(self, op: str):
        decision = self.backend_decisions.get(op)
        return decision.chosen.load() if decision is not None else None

    @property
    def vocab_size(self) -> int:
        return self.model.model.embed_tokens.num_embeddings  # the global vocabulary

    # ---- one step ----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, banned: dict[int, list[int]]) -> RunnerOutput:
        """Run the model on the batch; sample for sequences whose last token was computed and
        collect prompt logprobs where asked. `banned` maps seq_id -> token ids to forbid."""
        items = batch.decodes_first()
        step = build_step_input(items, self.config.cache.block_size, self.has_attention)
        uses = self._plan_logits(items, step)
        input_ids, positions, meta = self.stager.tensors(step)
        timer = self.timer
        timer.mark("prepare")
        out = RunnerOutput()
        if (
            meta.num_decodes == meta.num_seqs
            and self._graph_fits(meta.num_seqs)
            and all(seq.prompt_logprobs is None for seq, _ in items)
        ):
            logits = self.graphs.replay(input_ids, positions, meta)  # [B, vocab], row b = seq b
            timer.mark("forward")
            self._sample(logits, [seq for seq, _ in items], banned, out)
            timer.mark("sample")
            return out

        broadcast_object(step)  # the other TP ranks run the same step (no-op without TP)
        hidden = self._forward(input_ids, positions, meta)
        timer.mark("forward")
        for use, logits in zip(uses, self._iter_logits(hidden, step), strict=True):
            if isinstance(use, _PromptLogprobsUse):
                self._prompt_logprobs(use, logits, out)
            else:
                self._sample(logits, use, banned, out)
        timer.mark("sample")  # prompt logprobs and the lm_head are billed to sampling
        return out

    @torch.inference_mode()
    def execute_async(
        self,
        items: list[tuple[Sequence, int]],
        banned: dict[int, list[int]],
        prev: AsyncStep | None,
    ) -> AsyncStep:
        """Launch a pure decode step (engine/async_step.py) without waiting for the GPU: the
        forward (its CUDA graph where one fits), sampling, and the copy of the sampled ids to
        the host. Tokens the host holds as placeholders come from `prev`'s ids on the device."""
        step = build_step_input(items, self.config.cache.block_size, self.has_attention)
        if step.num_decodes != len(items):
            raise ValueError("an overlapped step must be all decodes")
        prev_ids = None
        if prev is not None:
            rows = prev.row_of()
            step.prev_rows = [
                rows[seq.seq_id] if seq.token_ids[-1] == PLACEHOLDER else -1 for seq, _ in items
            ]
            prev_ids = prev.device_ids
        elif any(seq.token_ids[-1] == PLACEHOLDER for seq, _ in items):
            raise ValueError("a placeholder token without the step that samples it")
        input_ids, positions, meta = self.stager.tensors(step, prev_ids)
        timer = self.timer
        timer.mark("prepare")
        seqs = [seq for seq, _ in items]
        if self._graph_fits(len(seqs)):
            logits = self.graphs.replay(input_ids, positions, meta)  # [B, vocab]
        else:
            logits = self.model.compute_logits(self._forward(input_ids, positions, meta))
        timer.mark("forward")
        device_ids = self.sampler.sample_ids(logits, _sampling_batch(seqs, banned))  # [B]
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
        """A TP rank other than 0: the forward and lm_head calls of rank 0's step, for their
        collectives (rank 0 samples)."""
        input_ids, positions, meta = self.stager.tensors(step)
        hidden = self._forward(input_ids, positions, meta)
        for _ in self._iter_logits(hidden, step):
            pass

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata
    ) -> torch.Tensor:
        self._plan(meta)
        ctx = ForwardContext(meta=meta, caches=self.caches, kernels=self.kernels)
        return self.model(input_ids, positions, ctx)

    def _iter_logits(self, hidden: torch.Tensor, step: StepInput) -> Iterator[torch.Tensor]:
        """Logits of each group of `step.logits_rows`, one group at a time (bounded memory)."""
        for rows in step.logits_rows:
            yield self.model.compute_logits(select_rows(hidden, rows))

    def _plan_logits(
        self, items: list[tuple[Sequence, int]], step: StepInput
    ) -> list[_PromptLogprobsUse | list[Sequence]]:
        """Fill `step.logits_rows` and say what each group is for: prompt logprobs of one
        sequence, or (last) sampling the sequences whose last token is computed this step.

        Logits at position p score prompt token p + 1; positions already scored before a
        preemption are skipped."""
        uses: list[_PromptLogprobsUse | list[Sequence]] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for b, (seq, n) in enumerate(items):
            start, c = step.query_start_loc[b], seq.num_computed_tokens
            if seq.prompt_logprobs is not None:
                first = len(seq.prompt_logprobs) - 1  # position whose successor is unscored
                last = min(c + n, seq.num_prompt_tokens - 1)  # exclusive
                lo = max(first, c)
                if last > lo:
                    step.logits_rows.append(range(start + lo - c, start + last - c))
                    uses.append(_PromptLogprobsUse(seq, lo, seq.token_ids[lo + 1 : last + 1]))
            if c + n == seq.num_tokens:
                sample_rows.append(start + n - 1)
                sample_seqs.append(seq)
        if sample_seqs:
            step.logits_rows.append(sample_rows)
            uses.append(sample_seqs)
        return uses

    def _sample(
        self,
        logits: torch.Tensor,
        sample_seqs: list[Sequence],
        banned: dict[int, list[int]],
        out: RunnerOutput,
    ) -> None:
        """Sample row i of `logits` for `sample_seqs[i]`, into `out.sampled`."""
        res = self.sampler(logits, _sampling_batch(sample_seqs, banned))
        for i, seq in enumerate(sample_seqs):
            out.sampled[seq.seq_id] = SampledToken(
                res.token_ids[i], res.logprobs[i], res.ranks[i], res.top_logprobs[i]
            )

    def _prompt_logprobs(
        self, use: _PromptLogprobsUse, logits: torch.Tensor, out: RunnerOutput
    ) -> None:
        k = use.seq.params.prompt_logprobs
        if k == -1:
            k = self.vocab_size
        targets = use.targets
        lps, ranks, topk = compute_logprobs_topk(
            logits, torch.tensor(targets, device=logits.device), k
        )
        out.prompt_logprobs[use.seq.seq_id] = PromptLogprobs(use.lo + 1, targets, lps, ranks, topk)


def _sampling_batch(seqs: list[Sequence], banned: dict[int, list[int]]) -> SamplingBatch:
    """The sampler's view of `seqs` (row i = seqs[i])."""
    return SamplingBatch(
        params=[s.params for s in seqs],
        generators=[s.generator for s in seqs],
        # NOTE: only penalties read the token histories; copying every sequence's whole
        # history each step would cost O(B x context) on the host.
        prompt_token_ids=[s.prompt_token_ids if has_penalties(s.params) else [] for s in seqs],
        output_token_ids=[s.output_token_ids if has_penalties(s.params) else [] for s in seqs],
        banned_token_ids=[banned.get(s.seq_id, []) for s in seqs],
    )
