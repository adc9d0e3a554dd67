"""The engine loop: add / abort requests; step() = schedule -> run -> process outputs.

Roles elsewhere: scheduling (engine/scheduler.py), the device (engine/model_runner.py) and what
happens to sampled tokens (engine/output_processor.py: stop checks, detokenisation, logprobs,
outputs)."""

from __future__ import annotations

import time
import weakref

import torch

from deltaserve.config import EngineConfig
from deltaserve.engine.async_step import AsyncStep, can_overlap
from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.logits import SampledToken
from deltaserve.engine.model_runner import ModelRunner
from deltaserve.engine.output_processor import OutputProcessor, Request
from deltaserve.engine.prompts import (
    ProcessedPrompt,
    PromptProcessor,
    build_image_processor,
    load_engine_tokenizer,
)
from deltaserve.engine.scheduler import ScheduledBatch, build_scheduler
from deltaserve.engine.sequence import Sequence
from deltaserve.engine.stats import EngineCounters, RuntimeStats, process_uptime
from deltaserve.engine.warmup import warm_up
from deltaserve.loader.tokenizer import eos_token_ids
from deltaserve.logger import get_logger
from deltaserve.outputs import RequestOutput
from deltaserve.sampling_params import SamplingParams

logger = get_logger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # start-up before the runner's phases: the process's imports and the HF config (None
        # where the process's start time is unknown), then the tokenizer
        self.startup_before_s: dict[str, float] = {}
        up = process_uptime()
        if up is not None:
            self.startup_before_s["before the engine"] = up
        t0 = time.perf_counter()
        self.tokenizer = load_engine_tokenizer(config)
        self.startup_before_s["tokenizer"] = time.perf_counter() - t0
        self._tp_workers = None
        if config.tensor_parallel_size > 1:
            from deltaserve.distributed.worker import TPWorkers, rank_config

            # this process becomes rank 0 (cuda:0 on GPUs); the finalizer stops the workers when
            # the engine is garbage collected or the program exits
            self.config = config = rank_config(config, 0)
            self._tp_workers = TPWorkers(config)
            self._finalizer = weakref.finalize(self, self._tp_workers.shutdown)
        try:
            self.runner = ModelRunner(config)
            if self._tp_workers is not None:
                self._tp_workers.loop_running = True
            self._init_scheduling(config)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; the engine cannot step after)."""
        if self._tp_workers is not None:
            self._finalizer()

    def _init_scheduling(self, config: EngineConfig) -> None:
        """Block manager, state pool and scheduler sized by the runner's cache plan (rank 0
        only: block and slot ids are decided here for every tensor-parallel rank)."""
        mc = config.model
        self.eos_token_ids = eos_token_ids(mc.path, mc.text_config, self.tokenizer)
        self.vocab_size = self.runner.vocab_size

        self.scheduler = build_scheduler(config, self.runner.plan, self.runner.specs)
        self.image_processor = None  # image models: prompt + images -> ids + record
        if self.runner.encoder_cache is not None:
            from deltaserve.multimodal.budget import encoder_budget_tokens

            self.image_processor = build_image_processor(config)
            self.scheduler.encoder_budget = encoder_budget_tokens(config)
        self.prompts = PromptProcessor(
            self.tokenizer,
            self.vocab_size,
            mc.max_model_len,
            self.image_processor,
            self.runner.instance.no_image_reason,
        )
        prefix = self.scheduler.prefix_cache is not None
        self.requests: dict[str, Request] = {}
        sync = torch.cuda.synchronize if config.model.device.type == "cuda" else None
        self.stats = RuntimeStats(sync)
        self.counters = EngineCounters()
        self.runner.timer = self.stats.timer
        self.output = OutputProcessor(
            self.tokenizer, self.eos_token_ids, mc.max_model_len, self.scheduler.finish
        )
        self._in_flight: AsyncStep | None = None  # overlapped decode (engine/async_step.py)
        self.spec = None  # speculative decoding (deltaserve/spec/decoding.py)
        if config.speculative is not None:
            from deltaserve.spec.decoding import SpecDecoder

            self.spec = SpecDecoder(config, self.runner, self.scheduler)
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in self.startup_phases.items())
        up = process_uptime()
        if up is not None:  # imports, config and tokenizer included
            phases += f"; process up {up:.1f} s"
        logger.info(
            "engine ready: prefix caching %s, up to %d sequences at once, overlapped decode %s "
            "(start-up: %s)",
            "on" if prefix else "off",
            self.scheduler.max_running,
            "on" if config.async_scheduling else "off",
            phases,
        )
        warm_up(self)  # the prefill path's kernels compile now, not in the first requests

    @property
    def startup_phases(self) -> dict[str, float]:
        """Seconds per start-up phase, in order: before the engine and the tokenizer, then the
        runner's (the ready line's figures)."""
        return {**self.startup_before_s, **self.runner.startup_s}

    @property
    def async_scheduling(self) -> bool:
        """Whether pure decode steps overlap the host's work with the GPU's."""
        return self.config.async_scheduling

    # ---- requests ----------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids), validated; ValueError names what is wrong. A
        prompt with `multi_modal_data` gives its ids with the image placeholders expanded."""
        text, ids, _ = self.process_prompt(prompt)
        return text, ids

    def process_prompt(self, prompt: str | dict | ProcessedPrompt) -> ProcessedPrompt:
        """(text, token ids, images' record or None), validated (engine/prompts.py): vLLM's
        prompt shapes, with `{"multi_modal_data": {"image": PIL image or list}}` beside "prompt"
        or "prompt_token_ids" (one `<|image_pad|>` placeholder per image, expanded here)."""
        return self.prompts.process(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | dict | ProcessedPrompt,
        params: SamplingParams | None = None,
    ) -> None:
        """Queue a request; ValueError (and nothing queued) if it is invalid."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params)}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, record = self.process_prompt(prompt)
        room = self.config.model.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if params.max_tokens is None or params.max_tokens > room:
            params = params.clone()
            params.max_tokens = max(1, min(max_tokens, room))
        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.runner.device).manual_seed(params.seed + i)
            detok = None
            if self.tokenizer is not None and params.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                )
            seqs.append(Sequence(request_id, i, ids, params, text, gen, detok))
            seqs[-1].mm = record
        if record is not None:  # its images stay in the encoder cache while it runs
            self.runner.encoder_cache.pin([it.content_hash for it in record.items])
        self.requests[request_id] = Request(request_id, text, ids, params, seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests now and free their blocks and state slots (unknown ids are ignored)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            self._unpin_images(req)
            for seq in req.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)
                    seq.num_pending_tokens = 0  # sampled by the step in flight: dropped

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def num_running_and_waiting(self) -> tuple[int, int]:
        """(running, waiting) sequences in the scheduler."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def cache_usage(self) -> dict[str, int]:
        bm, sp = self.scheduler.block_manager, self.scheduler.state_pool
        return {
            "kv_blocks_used": bm.num_used_blocks if bm else 0,
            "kv_blocks_total": bm.capacity if bm else 0,
            "state_slots_used": sp.num_used if sp else 0,
            "state_slots_total": sp.capacity if sp else 0,
        }

    def prefix_cache_stats(self) -> dict[str, int]:
        """Prefix-cache counters (zeros when it is off): admissions that queried it, hits,
        their prompt and hit tokens, and the recurrent-state snapshots held / taken / evicted
        (hybrid models), with the prompt tokens the engine computed."""
        cache = self.scheduler.prefix_cache
        stats = getattr(cache, "stats", None)
        snaps = self.scheduler.pool("snapshots")
        return {
            "prefix_cache_queries": stats.queries if stats else 0,
            "prefix_cache_hits": stats.hits if stats else 0,
            "prefix_cache_query_tokens": stats.query_tokens if stats else 0,
            "prefix_cache_hit_tokens": stats.hit_tokens if stats else 0,
            "prefix_snapshots_held": snaps.num_held if snaps else 0,
            "prefix_snapshots_total": snaps.capacity if snaps else 0,
            "prefix_snapshots_taken": snaps.num_taken if snaps else 0,
            "prefix_snapshots_evicted": snaps.num_evicted if snaps else 0,
            "prompt_tokens_computed": self.counters.prompt_tokens_computed,
        }

    # ---- one step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that made progress (finished ones last
        time they appear: they are dropped from the engine).

        With overlapped decode on, a pure decode step returns the outputs of the step before
        it (engine/async_step.py); a step that cannot overlap first returns those of the step
        in flight, and runs on the next call."""
        if self.async_scheduling and self._can_overlap():
            return self._overlapped_step()
        if self._in_flight is not None:
            return self._finish_in_flight()
        return self._sync_step()

    def _can_overlap(self) -> bool:
        sched = self.scheduler
        if sched.waiting or not sched.running:
            return False
        max_len = self.config.model.max_model_len
        return all(can_overlap(seq, max_len) for seq in sched.running)

    def _overlapped_step(self) -> list[RequestOutput]:
        timer = self.stats.timer
        timer.start()
        batch = self.scheduler.schedule()
        if not batch:
            return self._finish_in_flight() if self._in_flight is not None else []
        banned = self.output.banned_for([seq for seq, _ in batch.items])
        self.counters.count_step(batch.items)
        timer.mark("schedule")
        if batch.checkpoints:  # NOTE: overlapped steps are all decodes: never checkpointed
            raise RuntimeError("an overlapped step cannot take in-step state snapshots")
        launched = self.runner.execute_async(batch.items, banned, self._in_flight, batch.cache_ops)
        outputs = self._finish_in_flight() if self._in_flight is not None else []
        # the batch's sequences that are still running: their new token is on the device
        for seq, _n in batch.items:
            if not seq.is_finished:
                seq.num_pending_tokens += 1
        self.scheduler.advance(batch)  # skips the sequences the previous step finished
        if not all(seq.is_finished for seq in launched.seqs):
            self._in_flight = launched
        # else every row is dropped: nothing to read back (later GPU work is stream-ordered)
        timer.mark("update")
        self.stats.record(
            len(batch.items),
            0,
            0,
            len(batch.items),  # tokens sampled on the device by the launched step
            self.cache_usage(),
            (len(self.scheduler.running), len(self.scheduler.waiting)),
            self.prefix_cache_stats,
        )
        return outputs

    def _finish_in_flight(self) -> list[RequestOutput]:
        """Read the step in flight's sampled ids, put them in place of the placeholders, and
        return the outputs of the requests it advanced."""
        step, self._in_flight = self._in_flight, None
        assert step is not None
        touched: dict[str, Request] = {}
        for seq, token_id in zip(step.seqs, step.token_ids(), strict=True):
            if seq.is_finished:  # finished or aborted meanwhile: the row is dropped
                continue
            assert seq.num_pending_tokens == 1, "overlapped step out of order"
            seq.num_pending_tokens = 0
            self.output.append(seq, SampledToken(token_id, 0.0, 0, []))
            req = self.requests[seq.request_id]
            touched[req.request_id] = req
        return self._outputs(touched)

    def _sync_step(self) -> list[RequestOutput]:
        timer = self.stats.timer
        timer.start()
        if self.spec is not None:
            self.spec.propose(self.scheduler)
        batch = self.scheduler.schedule()
        if self.spec is not None:
            self.spec.after_schedule(batch)
        if not batch:
            return []
        banned = self.output.banned_for([seq for seq, _ in batch.items])
        num_decodes = sum(1 for seq, n in batch.items if ScheduledBatch.is_decode(seq, n))
        self.counters.count_step(batch.items)
        timer.mark("schedule")
        out = self.runner.execute(batch, banned)  # marks prepare / forward / sample
        # rolls back rejected drafts: the accepted ones stay computed
        self.scheduler.advance(batch, out.num_rejected)
        if self.spec is not None:
            self.spec.after_step(batch, out)

        touched: dict[str, Request] = {}
        gen_tokens = 0
        for seq, _n in batch.items:
            req = self.requests[seq.request_id]
            lp = out.prompt_logprobs.get(seq.seq_id)
            if lp is not None:
                self.output.add_prompt_logprobs(seq, lp)
            tokens = out.sampled.get(seq.seq_id)
            if tokens:
                accepted = len(tokens) - 1  # drafts kept in token_ids: appended again, checked
                if accepted:
                    del seq.token_ids[-accepted:]
                gen_tokens += self.output.append_tokens(seq, tokens)
                touched[req.request_id] = req
        timer.mark("update")
        self.stats.record(
            num_decodes,
            len(batch.items) - num_decodes,
            batch.num_tokens - num_decodes,
            gen_tokens,
            self.cache_usage(),
            (len(self.scheduler.running), len(self.scheduler.waiting)),
            self.prefix_cache_stats,
        )
        if self.spec is not None and self.stats.enabled and self.stats.window_steps == 0:
            logger.info("step %d: %s", self.stats.steps, self.spec.stats.describe())
        return self._outputs(touched)

    def _outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        """The outputs of the requests a step advanced; finished ones leave the engine."""
        outputs = []
        for req in touched.values():
            outputs.append(self.output.output(req))
            if req.finished:
                del self.requests[req.request_id]
                self._unpin_images(req)
        return outputs

    def _unpin_images(self, req: Request) -> None:
        record = req.seqs[0].mm if req.seqs else None
        if record is not None:
            self.runner.encoder_cache.unpin([it.content_hash for it in record.items])
