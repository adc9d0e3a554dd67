"""Logits and sampling for one step: which hidden rows need logits, prompt logprobs, sampling,
and the acceptance of draft tokens.

Row planning: a sequence whose scheduled tokens reach its end samples at its last row; a row
with k drafts samples at each of its 1 + k positions. Prompt logprobs score prompt tokens from
the logits of the positions before them. Each group of rows is one lm_head call, so memory stays
bounded however many prompt positions are scored.

Acceptance of drafts (for deterministic drafts: prompt lookup, greedy drafters):
    row inputs [x, d_1 .. d_k] give targets t_0 .. t_k, t_i sampled from p(. | x, d_1 .. d_i).
    Accept d_{i+1} while t_i == d_{i+1}; the first mismatch t_i replaces d_{i+1} and ends the
    row; if all k match, t_k is a bonus token. Output: t_0 .. t_a (a = drafts accepted).
A draft accepted with probability p(d) and, when rejected, a sample from p restricted to tokens
!= d is exactly a sample from p: the output has the target's distribution (greedy: the same
tokens as decoding without drafts).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from deltaserve.engine.sampler import Sampler, SamplingBatch, compute_logprobs_topk, has_penalties
from deltaserve.engine.sequence import Sequence
from deltaserve.engine.step_prep import StepInput, select_rows


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
    """What a step produced, per sequence (by seq_id)."""

    # the new tokens in order: one, or 1 + accepted drafts for a row with drafts
    sampled: dict[int, list[SampledToken]] = field(default_factory=dict)
    # rows with drafts: how many of them were rejected (Scheduler.advance rolls them back)
    num_rejected: dict[int, int] = field(default_factory=dict)
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    # speculative decoding: what the step computed and kept, for the proposer
    # (deltaserve.spec.proposer.TargetStep)
    target_step: Any = None


@dataclass
class PromptLogprobsUse:
    """A logits group that scores prompt tokens `lo + 1 ..` of `seq` (targets given)."""

    seq: Sequence
    lo: int
    targets: list[int]


@dataclass
class SampleUse:
    """A logits group that samples: `num_rows[i]` consecutive rows for `seqs[i]` (1 + its
    drafts)."""

    seqs: list[Sequence]
    num_rows: list[int]


def plan_logits(
    items: list[tuple[Sequence, int]], step: StepInput
) -> list[PromptLogprobsUse | SampleUse]:
    """Fill `step.logits_rows` and say what each group is for: prompt logprobs of one
    sequence, or (last) sampling the sequences whose last token is computed this step.

    Logits at position p score prompt token p + 1; positions already scored before a
    preemption are skipped."""
    uses: list[PromptLogprobsUse | SampleUse] = []
    sample_rows: list[int] = []
    sample = SampleUse([], [])
    for b, (seq, n) in enumerate(items):
        start, c = step.query_start_loc[b], seq.num_computed_tokens
        if seq.prompt_logprobs is not None:
            first = len(seq.prompt_logprobs) - 1  # position whose successor is unscored
            last = min(c + n, seq.num_prompt_tokens - 1)  # exclusive
            lo = max(first, c)
            if last > lo:
                step.logits_rows.append(range(start + lo - c, start + last - c))
                uses.append(PromptLogprobsUse(seq, lo, seq.token_ids[lo + 1 : last + 1]))
        if c + n == seq.num_tokens:
            k = min(seq.num_draft_tokens, n - 1)  # drafts scheduled in this row
            sample_rows.extend(range(start + n - 1 - k, start + n))
            sample.seqs.append(seq)
            sample.num_rows.append(1 + k)
    if sample.seqs:
        step.logits_rows.append(sample_rows)
        uses.append(sample)
    return uses


def iter_logits(model, hidden: torch.Tensor, step: StepInput) -> Iterator[torch.Tensor]:
    """Logits of each group of `step.logits_rows`, one group at a time (bounded memory)."""
    for rows in step.logits_rows:
        yield model.compute_logits(select_rows(hidden, rows))


def sampling_batch(
    seqs: list[Sequence], banned: dict[int, list[int]], num_rows: list[int] | None = None
) -> SamplingBatch:
    """The sampler's view of `seqs`: `num_rows[i]` rows for seqs[i] (default one). Row j of a
    sequence with drafts samples the token after its j-th draft: its history holds the drafts
    before it, and min_tokens bans apply while the output is still short there."""
    params, gens, prompts, outputs, bans = [], [], [], [], []
    for i, s in enumerate(seqs):
        rows = 1 if num_rows is None else num_rows[i]
        base = s.num_output_tokens - (rows - 1)  # output tokens before the row's first target
        penalties = has_penalties(s.params)
        for j in range(rows):
            params.append(s.params)
            gens.append(s.generator)
            # NOTE: only penalties read the token histories; copying every sequence's whole
            # history each step would cost O(B x context) on the host.
            prompts.append(s.prompt_token_ids if penalties else [])
            out = s.output_token_ids
            outputs.append(out[: len(out) - (rows - 1 - j)] if penalties else [])
            ban = banned.get(s.seq_id, [])
            bans.append(ban if base + j < s.params.min_tokens else [])
    return SamplingBatch(
        params=params,
        generators=gens,
        prompt_token_ids=prompts,
        output_token_ids=outputs,
        banned_token_ids=bans,
    )


class LogitsProcessor:
    """Samples and scores the logits groups of a step into a `RunnerOutput`."""

    def __init__(self, sampler: Sampler, vocab_size: int) -> None:
        self.sampler = sampler
        self.vocab_size = vocab_size

    def sample(
        self,
        logits: torch.Tensor,
        use: SampleUse,
        banned: dict[int, list[int]],
        out: RunnerOutput,
    ) -> None:
        """Sample every row of `logits` (the rows of `use`, in order) and accept drafts."""
        res = self.sampler(logits, sampling_batch(use.seqs, banned, use.num_rows))
        row = 0
        for seq, rows in zip(use.seqs, use.num_rows, strict=True):
            tokens = []
            drafts = seq.token_ids[len(seq.token_ids) - (rows - 1) :] if rows > 1 else []
            if rows > 1 and seq.draft_probs is not None and not seq.params.is_greedy:
                tokens = self._rejection_sample(logits[row : row + rows], seq, drafts, banned)
                out.sampled[seq.seq_id] = tokens
                out.num_rejected[seq.seq_id] = rows - len(tokens)
                row += rows
                continue
            for j in range(rows):
                i = row + j
                tokens.append(
                    SampledToken(
                        res.token_ids[i], res.logprobs[i], res.ranks[i], res.top_logprobs[i]
                    )
                )
                if j < rows - 1 and res.token_ids[i] != drafts[j]:
                    break  # draft j rejected: this token replaces it
            out.sampled[seq.seq_id] = tokens
            if rows > 1:
                out.num_rejected[seq.seq_id] = rows - len(tokens)
            row += rows

    def _rejection_sample(
        self, logits: torch.Tensor, seq: Sequence, drafts: list[int], banned: dict[int, list[int]]
    ) -> list[SampledToken]:
        """A sampled row whose drafts came with their draft distributions q: speculative
        sampling against the target's p (deltaserve/spec/acceptance.py)."""
        from deltaserve.spec.acceptance import rejection_sample

        rows = len(drafts) + 1
        p = self.sampler.probs(logits, sampling_batch([seq], banned, [rows]))  # [rows, V]
        q = seq.draft_probs[: len(drafts)].to(p.device)
        gen = seq.generator if seq.generator is not None else self.sampler.default_generator
        ids = rejection_sample(p, q, drafts, gen)
        n = len(ids)
        k = seq.params.logprobs
        if k is None:
            return [SampledToken(t, 0.0, 0, []) for t in ids]
        lps, ranks, tops = compute_logprobs_topk(logits[:n], torch.tensor(ids), k)
        return [SampledToken(*x) for x in zip(ids, lps, ranks, tops, strict=True)]

    def prompt_logprobs(
        self, use: PromptLogprobsUse, logits: torch.Tensor, out: RunnerOutput
    ) -> None:
        k = use.seq.params.prompt_logprobs
        if k == -1:
            k = self.vocab_size
        targets = use.targets
        lps, ranks, topk = compute_logprobs_topk(
            logits, torch.tensor(targets, device=logits.device), k
        )
        out.prompt_logprobs[use.seq.seq_id] = PromptLogprobs(use.lo + 1, targets, lps, ranks, topk)
