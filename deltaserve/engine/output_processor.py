"""What the engine does with a step's tokens: stop checks, detokenisation, logprobs and the
assembly of `RequestOutput`s. Plain Python over sequences; no device work."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deltaserve.engine.logits import PromptLogprobs, SampledToken
from deltaserve.engine.sequence import Sequence
from deltaserve.outputs import CompletionOutput, Logprob, RequestOutput
from deltaserve.sampling_params import SamplingParams


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


class OutputProcessor:
    """Appends sampled tokens to sequences and decides when they stop; builds outputs.

    `finish(seq)` is called once for a sequence that stops (the scheduler frees its caches)."""

    def __init__(
        self,
        tokenizer,
        eos_token_ids: set[int],
        max_model_len: int,
        finish: Callable[[Sequence], None],
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.finish = finish
        self._token_text: dict[int, str] = {}

    # ---- before a step -----------------------------------------------------------------
    def banned_for(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        """seq_id -> tokens to forbid, for the sequences still short of min_tokens (drafts do
        not count as output yet)."""
        return {
            seq.seq_id: self.banned(seq)
            for seq in seqs
            if seq.num_output_tokens - seq.num_draft_tokens < seq.params.min_tokens
        }

    def banned(self, seq: Sequence) -> list[int]:
        """Tokens that would end the sequence before min_tokens."""
        ids = set(seq.params.stop_token_ids or [])
        if not seq.params.ignore_eos:
            ids |= self.eos_token_ids
        return sorted(ids)

    # ---- after a step ------------------------------------------------------------------
    def append_tokens(self, seq: Sequence, tokens: list[SampledToken]) -> int:
        """Append a step's tokens one by one, stopping part-way when one ends the sequence;
        returns how many were appended."""
        for i, token in enumerate(tokens):
            self.append(seq, token)
            if seq.finish_reason is not None:
                return i + 1
        return len(tokens)

    def append(self, seq: Sequence, s: SampledToken) -> None:
        """Add one sampled token and decide whether the sequence is finished."""
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
            seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            if seq.detokenizer is not None:
                seq.detokenizer.flush()  # a trailing incomplete UTF-8 sequence, if any
            self.finish(seq)

    def add_prompt_logprobs(self, seq: Sequence, lp: PromptLogprobs) -> None:
        assert len(seq.prompt_logprobs) == lp.start, "prompt logprobs out of order"
        for i, tid in enumerate(lp.token_ids):
            seq.prompt_logprobs.append(
                self._logprob_entry(tid, lp.token_logprobs[i], lp.ranks[i], lp.top_logprobs[i])
            )

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

    # ---- outputs -----------------------------------------------------------------------
    def output(self, req: Request) -> RequestOutput:
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
