"""The engine loop: add / abort requests; step() = schedule -> run -> sample -> detokenize."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from deltaserve.config import EngineConfig
from deltaserve.engine.async_step import PLACEHOLDER, AsyncStep, can_overlap
from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.model_runner import ModelRunner, SampledToken
from deltaserve.engine.scheduler import build_scheduler
from deltaserve.engine.sequence import Sequence
from deltaserve.engine.stats import RuntimeStats
from deltaserve.loader.tokenizer import eos_token_ids, load_tokenizer
from deltaserve.logger import get_logger
from deltaserve.outputs import CompletionOutput, Logprob, RequestOutput
from deltaserve.sampling_params import SamplingParams

logger = get_logger(__name__)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.tokenizer = load_tokenizer(mc.tokenizer) if mc.tokenizer else None
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
        prefix = self.scheduler.prefix_cache is not None
        self.requests: dict[str, Request] = {}
        sync = torch.cuda.synchronize if config.model.device.type == "cuda" else None
        self.stats = RuntimeStats(sync)
        self.runner.timer = self.stats.timer
        self._token_text: dict[int, str] = {}
        self._in_flight: AsyncStep | None = None  # overlapped decode (engine/async_step.py)
        logger.info(
            "engine ready: prefix caching %s, up to %d sequences at once, overlapped decode %s",
            "on" if prefix else "off",
            self.scheduler.max_running,
            "on" if config.async_scheduling else "off",
        )

    @property
    def async_scheduling(self) -> bool:
        """Whether pure decode steps overlap the host's work with the GPU's."""
        return self.config.async_scheduling

    # ---- requests ----------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids), validated; ValueError names what is wrong."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass {'prompt_token_ids': [...]}")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            return self.tokenize_prompt(prompt["prompt"])
        else:
            raise ValueError(
                f"a prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt)}"
            )
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})"
            )
        max_len = self.config.model.max_model_len
        if len(ids) >= max_len:
            raise ValueError(
                f"the prompt ({len(ids)} tokens) is longer than the model allows: prompt plus "
                f"at least one generated token must fit max_model_len={max_len}"
            )
        return text, ids

    def add_request(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams | None = None,
    ) -> None:
        """Queue a request; ValueError (and nothing queued) if it is invalid."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params)}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
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
            for seq in req.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)
                    if seq.token_ids[-1] == PLACEHOLDER:  # sampled by the step in flight
                        seq.token_ids.pop()

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
        banned = self._banned_for(batch)
        timer.mark("schedule")
        launched = self.runner.execute_async(batch.items, banned, self._in_flight)
        outputs = self._finish_in_flight() if self._in_flight is not None else []
        # the batch's sequences that are still running: their new token is on the device
        for seq, _n in batch.items:
            if not seq.is_finished:
                seq.append_token(PLACEHOLDER)
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
            assert seq.token_ids[-1] == PLACEHOLDER, "overlapped step out of order"
            seq.token_ids.pop()
            self._append(seq, SampledToken(token_id, 0.0, 0, []))
            req = self.requests[seq.request_id]
            touched[req.request_id] = req
        return self._outputs(touched)

    def _sync_step(self) -> list[RequestOutput]:
        timer = self.stats.timer
        timer.start()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        banned = self._banned_for(batch)
        num_decodes = sum(1 for seq, n in batch.items if batch.is_decode(seq, n))
        timer.mark("schedule")
        out = self.runner.execute(batch, banned)  # marks prepare / forward / sample
        self.scheduler.advance(batch)

        touched: dict[str, Request] = {}
        gen_tokens = 0
        for seq, _n in batch.items:
            req = self.requests[seq.request_id]
            lp = out.prompt_logprobs.get(seq.seq_id)
            if lp is not None:
                self._add_prompt_logprobs(seq, lp)
            sampled = out.sampled.get(seq.seq_id)
            if sampled is not None:
                gen_tokens += 1
                self._append(seq, sampled)
                touched[req.request_id] = req
        timer.mark("update")
        self.stats.record(
            num_decodes,
            len(batch.items) - num_decodes,
            batch.num_tokens - num_decodes,
            gen_tokens,
            self.cache_usage(),
            (len(self.scheduler.running), len(self.scheduler.waiting)),
        )
        return self._outputs(touched)

    def _outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        """The outputs of the requests a step advanced; finished ones leave the engine."""
        outputs = []
        for req in touched.values():
            outputs.append(self._output(req))
            if req.finished:
                del self.requests[req.request_id]
        return outputs

    def _banned_for(self, batch) -> dict[int, list[int]]:
        """seq_id -> tokens to forbid, for the batch's sequences still short of min_tokens."""
        return {
            seq.seq_id: self._banned(seq)
            for seq, _n in batch.items
            if seq.num_output_tokens < seq.params.min_tokens
        }

    def _banned(self, seq: Sequence) -> list[int]:
        """Tokens that would end the sequence before min_tokens."""
        ids = set(seq.params.stop_token_ids or [])
        if not seq.params.ignore_eos:
            ids |= self.eos_token_ids
        return sorted(ids)

    def _decoded(self, token_id: int) -> str | None:
        """The text of one token, for logprob entries (memoised: whole-vocabulary prompt
        logprobs would otherwise decode every token id at every position)."""
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprob_entry(self, token_id: int, logprob: float, rank: int, top) -> dict[int, Logprob]:
        entry = {token_id: Logprob(logprob, rank, self._decoded(token_id))}
        for r, (tid, tlp) in enumerate(top, start=1):
            if tid not in entry:
                entry[tid] = Logprob(tlp, r, self._decoded(tid))
        return entry

    def _add_prompt_logprobs(self, seq: Sequence, lp) -> None:
        assert len(seq.prompt_logprobs) == lp.start, "prompt logprobs out of order"
        for i, tid in enumerate(lp.token_ids):
            seq.prompt_logprobs.append(
                self._logprob_entry(tid, lp.token_logprobs[i], lp.ranks[i], lp.top_logprobs[i])
            )

    def _append(self, seq: Sequence, s: SampledToken) -> None:
        """Add the sampled token and decide whether the sequence is finished."""
        p = seq.params
        seq.append_token(s.token_id)
        seq.cumulative_logprob += s.logprob
        if seq.logprobs is not None:
            seq.logprobs.append(self._logprob_entry(s.token_id, s.logprob, s.rank, s.top_logprobs))
        can_stop = seq.num_output_tokens >= p.min_tokens
        stop_token = can_stop and (
            (not p.ignore_eos and s.token_id in self.eos_token_ids)
            or s.token_id in (p.stop_token_ids or [])
        )
        if stop_token:
            seq.finish_reason = "stop"
            seq.stop_reason = s.token_id if s.token_id in (p.stop_token_ids or []) else None
        if seq.detokenizer is not None and (not stop_token or p.include_stop_str_in_output):
            seq.detokenizer.add_tokens([s.token_id])
            if not stop_token and can_stop and p.stop:
                hit = seq.detokenizer.check_stop(p.stop, p.include_stop_str_in_output)
                if hit is not None:
                    seq.finish_reason, seq.stop_reason = "stop", hit
        if seq.finish_reason is None and (
            seq.num_output_tokens >= p.max_tokens
            or seq.num_tokens >= self.config.model.max_model_len
        ):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            if seq.detokenizer is not None:
                seq.detokenizer.flush()  # a trailing incomplete UTF-8 sequence, if any
            self.scheduler.finish(seq)

    def _output(self, req: Request) -> RequestOutput:
        completions = []
        for seq in req.seqs:
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detokenizer.output_text if seq.detokenizer is not None else "",
                    token_ids=seq.output_token_ids,
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    logprobs=seq.logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=req.finished,
            prompt_logprobs=req.seqs[0].prompt_logprobs,
            num_cached_tokens=req.seqs[0].num_cached_tokens,
        )
