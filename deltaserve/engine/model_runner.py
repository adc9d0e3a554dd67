"""The one owner of the device: weights, cache tensors, batch metadata, kernels, sampling."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaserve.backends import Capabilities, select_all
from deltaserve.config import EngineConfig
from deltaserve.engine.block_manager import cdiv
from deltaserve.engine.cache_alloc import allocate_caches, describe_capacity, plan_caches
from deltaserve.engine.cuda_graph import DecodeGraphs
from deltaserve.engine.host_tables import batch_block_table
from deltaserve.engine.sampler import Sampler, SamplingBatch, compute_logprobs_topk, has_penalties
from deltaserve.engine.scheduler import ScheduledBatch
from deltaserve.engine.sequence import Sequence
from deltaserve.engine.stats import StepTimer
from deltaserve.forward_context import BatchMetadata, ForwardContext, Kernels
from deltaserve.loader.weights import build_model, load_weights
from deltaserve.logger import get_logger
from deltaserve.models.base import AttentionSpec, GDNSpec
from deltaserve.models.registry import get_model_class
from deltaserve.ops.gdn import GDNKernels

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
class RunnerOutput:
    sampled: dict[int, SampledToken] = field(default_factory=dict)  # seq_id -> token
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.device = mc.device
        model_cls = get_model_class(mc.architecture)
        tie = bool(getattr(mc.hf_config, "tie_word_embeddings", False))
        self.model = build_model(model_cls, mc.text_config, tie, mc.dtype, mc.device)
        if mc.random_model is not None:
            from deltaserve.loader.random_model import init_random_weights

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
        if self.kernels.attention is not None:
            attn_specs = list(dict.fromkeys(s for s in self.specs if isinstance(s, AttentionSpec)))
            self.kernels.attention.setup(attn_specs, config.cache.block_size, mc.dtype)
        self.plan = plan_caches(self.specs, config)
        self.caches = allocate_caches(self.specs, self.plan, config)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(mc.seed))
        logger.info("cache: %s", describe_capacity(self.plan, config))
        self.timer = StepTimer(False)  # the engine swaps in its own when stats are on
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
        else:
            logger.info("decode runs eagerly: %s", reason)

    def _no_graph_reason(self) -> str | None:
        if self.device.type != "cuda":
            return "no CUDA device"
        if self.config.enforce_eager:
            return "enforce_eager"
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
        return self.model.model.embed_tokens.num_embeddings

    # ---- batch preparation -------------------------------------------------------------
    def _prepare(
        self, items: list[tuple[Sequence, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, BatchMetadata]:
        bs = self.config.cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        qsl = [0]
        seq_lens, ctx_lens, state_slots = [], [], []
        for seq, n in items:
            c = seq.num_computed_tokens
            ids.extend(seq.token_ids[c : c + n])
            positions.extend(range(c, c + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(c + n)
            ctx_lens.append(c)
            state_slots.append(seq.state_slot)
        B, T = len(items), len(ids)
        if self.has_attention:
            table = batch_block_table([seq for seq, _ in items])  # [B, W] int64, host
            pos = torch.tensor(positions, dtype=torch.int64)  # [T]
            row = torch.repeat_interleave(torch.arange(B), torch.tensor([n for _, n in items]))
            slots = table[row, pos // bs] * bs + pos % bs  # [T]
        else:
            table = torch.zeros(B, 0, dtype=torch.int64)
            slots = torch.zeros(0, dtype=torch.int64)
        width = table.shape[1]
        # One host buffer, one host-to-device copy; the fields are views of it (int64 on the
        # host, narrowed to int32 on the device where the kernels want int32).
        small = ids + positions + state_slots + qsl + seq_lens + ctx_lens
        sizes = [T, T, B, B + 1, B, B, slots.numel(), B * width]
        host = self._host_buffer(sum(sizes))
        n_small = len(small)
        host[:n_small] = torch.tensor(small, dtype=torch.int64)
        host[n_small : n_small + slots.numel()] = slots
        host[n_small + slots.numel() : sum(sizes)] = table.reshape(-1)
        dev = host[: sum(sizes)].to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()
        ids_t, pos_t, state_t, qsl_t, sl_t, ctx_t, slot_t, bt_t = torch.split(dev, sizes)
        ctx_i32 = ctx_t.to(torch.int32)
        meta = BatchMetadata(
            slot_mapping=slot_t,
            query_start_loc=qsl_t.to(torch.int32),
            seq_lens=sl_t.to(torch.int32),
            context_lens=ctx_i32,
            block_tables=bt_t.to(torch.int32).view(B, width),
            state_slots=state_t,
            has_initial_state=ctx_i32 > 0,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            context_lens_cpu=ctx_lens,
            state_slots_cpu=state_slots,
            num_decodes=sum(1 for seq, n in items if ScheduledBatch.is_decode(seq, n)),
        )
        return ids_t, pos_t, meta

    def _host_buffer(self, n: int) -> torch.Tensor:
        """A reusable int64 staging buffer (pinned on CUDA). Before it is refilled, the previous
        step's asynchronous copy out of it must have finished (a step that samples nothing
        never syncs the device)."""
        staged = getattr(self, "_staged", None)
        if staged is not None:
            staged.synchronize()
        buf = getattr(self, "_staging", None)
        if buf is None or buf.numel() < n:
            size = max(n, 2 * (buf.numel() if buf is not None else 4096))
            pin = self.device.type == "cuda"
            buf = self._staging = torch.empty(size, dtype=torch.int64, pin_memory=pin)
        return buf

    # ---- one step ----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, banned: dict[int, list[int]]) -> RunnerOutput:
        """Run the model on the batch; sample for sequences whose last token was computed and
        collect prompt logprobs where asked. `banned` maps seq_id -> token ids to forbid."""
        items = batch.decodes_first()
        input_ids, positions, meta = self._prepare(items)
        timer = self.timer
        timer.mark("prepare")
        out = RunnerOutput()
        graphs = self.graphs
        if (
            graphs is not None
            and meta.num_decodes == meta.num_seqs
            and graphs.bucket(meta.num_seqs) is not None
            and all(seq.prompt_logprobs is None for seq, _ in items)
        ):
            logits = graphs.replay(input_ids, positions, meta)  # [B, vocab], row b = seq b
            timer.mark("forward")
            self._sample(logits, [seq for seq, _ in items], banned, out)
            timer.mark("sample")
            return out

        self._plan(meta)
        ctx = ForwardContext(meta=meta, caches=self.caches, kernels=self.kernels)
        hidden = self.model(input_ids, positions, ctx)
        timer.mark("forward")

        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for b, (seq, n) in enumerate(items):
            start, c = meta.query_start_loc_cpu[b], seq.num_computed_tokens
            if seq.prompt_logprobs is not None:
                self._prompt_logprobs(seq, hidden[start : start + n], c, out)
            if c + n == seq.num_tokens:
                sample_rows.append(start + n - 1)
                sample_seqs.append(seq)
        if sample_seqs:
            logits = self.model.compute_logits(hidden[sample_rows])
            self._sample(logits, sample_seqs, banned, out)
        timer.mark("sample")  # prompt logprobs and the lm_head are billed to sampling
        return out

    def _sample(
        self,
        logits: torch.Tensor,
        sample_seqs: list[Sequence],
        banned: dict[int, list[int]],
        out: RunnerOutput,
    ) -> None:
        """Sample row i of `logits` for `sample_seqs[i]`, into `out.sampled`."""
        pen = lambda s: has_penalties(s.params)  # noqa: E731
        sb = SamplingBatch(
            params=[s.params for s in sample_seqs],
            generators=[s.generator for s in sample_seqs],
            # NOTE: only penalties read the token histories; copying every sequence's whole
            # history each step would cost O(B x context) on the host.
            prompt_token_ids=[s.prompt_token_ids if pen(s) else [] for s in sample_seqs],
            output_token_ids=[s.output_token_ids if pen(s) else [] for s in sample_seqs],
            banned_token_ids=[banned.get(s.seq_id, []) for s in sample_seqs],
        )
        res = self.sampler(logits, sb)
        for i, seq in enumerate(sample_seqs):
            out.sampled[seq.seq_id] = SampledToken(
                res.token_ids[i], res.logprobs[i], res.ranks[i], res.top_logprobs[i]
            )

    def _prompt_logprobs(
        self, seq: Sequence, hidden: torch.Tensor, c: int, out: RunnerOutput
    ) -> None:
        """Logits at position p score prompt token p + 1; positions already scored before a
        preemption are skipped."""
        first = len(seq.prompt_logprobs) - 1  # position whose successor is not yet scored
        last = min(c + hidden.shape[0], seq.num_prompt_tokens - 1)  # exclusive
        if last <= max(first, c):
            return
        lo = max(first, c)
        targets = seq.token_ids[lo + 1 : last + 1]
        logits = self.model.compute_logits(hidden[lo - c : last - c])
        k = seq.params.prompt_logprobs
        if k == -1:
            k = self.vocab_size
        lps, ranks, topk = compute_logprobs_topk(
            logits, torch.tensor(targets, device=logits.device), k
        )
        out.prompt_logprobs[seq.seq_id] = PromptLogprobs(lo + 1, targets, lps, ranks, topk)
