"""Batched next-token sampling: bans, penalties, greedy / temperature / top-k / top-p / min-p,
per-request seeds, and logprobs of the raw model distribution.

Order of processing (as in vLLM):
  1. banned tokens -> -inf (e.g. EOS and stop ids while the output is shorter than min_tokens);
  2. repetition penalty over prompt + output tokens (positive logits divided, negative
     multiplied), then frequency and presence penalties over output tokens only;
  3. greedy rows: argmax; random rows: / temperature, top-k, top-p, min-p, then an exponential
     race drawn from the row's own generator.
Logprobs, ranks and top logprobs are always those of the raw logits (vLLM's "raw_logprobs").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deltaserve.host_copy import to_device_async
from deltaserve.ops.fused.reference import argmax as reference_argmax
from deltaserve.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """One row per sequence being sampled this step, aligned with the rows of the logits."""

    params: list[SamplingParams]
    # Per-request generator (seeded requests) or None -> the sampler's default generator.
    # NOTE: a generator must live on the logits' device.
    generators: list[torch.Generator | None]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    # Tokens that must not be sampled this step (the engine fills this, e.g. for min_tokens).
    banned_token_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.params)


@dataclass
class SamplerOutput:
    """The sampled token of each row and its logprob / rank / top logprobs (raw distribution)."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # 1 = most likely
    # Per row, the params.logprobs most likely tokens as (token_id, logprob), descending;
    # [] where params.logprobs is None or 0.
    top_logprobs: list[list[tuple[int, float]]]


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without a host sync (deltaserve.host_copy)."""
    return to_device_async(torch.tensor(values, dtype=dtype), device)


def apply_banned_tokens(logits: torch.Tensor, banned_token_ids: Sequence[Sequence[int]]) -> None:
    """Set logits[i, t] = -inf for every t in banned_token_ids[i], in place."""
    rows = [i for i, ids in enumerate(banned_token_ids) for _ in ids]
    if not rows:
        return
    cols = [t for ids in banned_token_ids for t in ids]
    row_idx = to_device(rows, torch.long, logits.device)
    col_idx = to_device(cols, torch.long, logits.device)
    logits[row_idx, col_idx] = float("-inf")


def _token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[R, V] float32 counts of each token id per row."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    # Pad with an extra column `vocab_size` that is dropped afterwards.
    padded = [list(ids) + [vocab_size] * (max_len - len(ids)) for ids in token_ids]
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    if max_len > 0:
        index = to_device(padded, torch.long, device)  # [R, max_len]
        counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalties: Sequence[float],
    frequency_penalties: Sequence[float],
    presence_penalties: Sequence[float],
) -> torch.Tensor:
    """Penalise logits [R, V] in place and return them.

    Repetition penalty p over every token seen in prompt or output: logit / p if logit > 0,
    else logit * p. Then over output tokens only, with c = the token's count in the output:
    logit -= frequency * c + presence * (c > 0).
    """
    vocab_size = logits.shape[-1]
    device = logits.device
    output_counts = _token_counts(output_token_ids, vocab_size, device)
    if any(p != 1.0 for p in repetition_penalties):
        prompt_counts = _token_counts(prompt_token_ids, vocab_size, device)
        seen = (prompt_counts + output_counts) > 0
        rep = to_device(repetition_penalties, logits.dtype, device).unsqueeze(1)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalised, logits))
    if any(f != 0.0 for f in frequency_penalties) or any(p != 0.0 for p in presence_penalties):
        freq = to_device(frequency_penalties, logits.dtype, device).unsqueeze(1)
        pres = to_device(presence_penalties, logits.dtype, device).unsqueeze(1)
        logits -= freq * output_counts + pres * (output_counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
) -> torch.Tensor:
    """Mask logits [R, V] (already divided by temperature) to -inf outside each row's filters.

    top_k <= 0 disables top-k; top-k keeps exactly k tokens (ties broken by lower token id).
    top-p keeps the smallest prefix of the sorted distribution whose mass reaches top_p (at
    least one token). min-p then drops tokens with prob < min_p * (max prob). Returns a new
    tensor.
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    use_top_k = any(0 < k < vocab_size for k in top_k)
    use_top_p = any(p < 1.0 for p in top_p)
    if use_top_k or use_top_p:
        # Stable sort: among equal logits the lower token id comes first (deterministic).
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)
        if use_top_k:
            k = to_device(
                [k if 0 < k < vocab_size else vocab_size for k in top_k], torch.long, device
            ).unsqueeze(1)  # [R, 1]
            positions = torch.arange(vocab_size, device=device).unsqueeze(0)  # [1, V]
            sorted_logits = sorted_logits.masked_fill(positions >= k, float("-inf"))
        if use_top_p:
            p = to_device(top_p, torch.float32, device).unsqueeze(1)
            probs = sorted_logits.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
            # Keep a token while the mass before it is still short of top_p.
            drop = (mass_before >= p) & (p < 1.0)
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
    if any(m > 0.0 for m in min_p):
        m = to_device(min_p, torch.float32, device).unsqueeze(1)
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * m
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def exponential_noise(
    like: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """E ~ Exp(1) i.i.d., shaped like `like` [R, V]. A row with a generator draws its noise only
    from that generator, so a seeded request gets the same tokens whatever shares the batch."""
    noise = torch.empty_like(like)
    if any(g is None for g in generators):
        noise.exponential_(generator=default_generator)
    for i, gen in enumerate(generators):
        if gen is not None:
            noise[i].exponential_(generator=gen)
    # NOTE: Exp(1) can return 0 (log 0 = -inf, 0 / 0 = NaN): keep the noise positive.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def random_sample(
    logits: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
    argmax: Callable[[torch.Tensor], torch.Tensor] = reference_argmax,
) -> torch.Tensor:
    """Sample one token per row of logits [R, V] by an exponential race.

    argmax_i p_i / E_i with E_i ~ Exp(1) picks i with probability p_i, and equals
    argmax_i (logit_i - log E_i), since log p_i = logit_i - logsumexp is a shift per row: no
    softmax is needed. `argmax`: the row argmax to use (torch's by default).
    """
    noise = exponential_noise(logits, generators, default_generator)
    return argmax(logits - noise.log_())


def compute_logprobs_topk(
    logits: torch.Tensor,
    token_ids: torch.Tensor | Sequence[int],
    k: int | Sequence[int],
) -> tuple[list[float], list[int], list[list[tuple[int, float]]]]:
    """Logprob and rank of token_ids[i] under log_softmax(logits[i]), plus row i's top k.

    logits: [N, V] (raw model logits); token_ids: [N]; k: one count for all rows or one per row,
    -1 meaning the whole vocabulary and 0 none. Rank is the number of tokens at least as likely
    (1 = best). Top-k lists are (token_id, logprob) in descending order.
    Used for sampled tokens and for prompt logprobs (token = the actual next prompt token).
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    ks = [k] * num_rows if isinstance(k, int) else list(k)
    if len(ks) != num_rows:
        raise ValueError(f"k has {len(ks)} entries for {num_rows} rows")
    ks = [vocab_size if kk == -1 else min(max(kk, 0), vocab_size) for kk in ks]
    if not isinstance(token_ids, torch.Tensor):
        token_ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    token_ids = token_ids.to(device=device, dtype=torch.long).view(num_rows, 1)

    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    token_logprobs = logprobs.gather(1, token_ids)  # [N, 1]
    ranks = (logprobs >= token_logprobs).sum(dim=-1)  # [N]

    max_k = max(ks, default=0)
    top_ids_list: list[list[int]] = [[] for _ in range(num_rows)]
    top_lps_list: list[list[float]] = [[] for _ in range(num_rows)]
    if max_k > 0:
        top_lps, top_ids = logprobs.topk(max_k, dim=-1)  # [N, max_k], descending
        top_ids_list = top_ids.tolist()
        top_lps_list = top_lps.tolist()
    topk = [
        list(zip(top_ids_list[i][: ks[i]], top_lps_list[i][: ks[i]], strict=True))
        for i in range(num_rows)
    ]
    return token_logprobs.view(-1).tolist(), ranks.tolist(), topk


class Sampler:
    """Chooses the next token of every row of a batch of logits.

    default_generator serves the rows without their own generator (None: torch's global RNG).
    The input logits are not modified.
    """

    def __init__(
        self,
        default_generator: torch.Generator | None = None,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.default_generator = default_generator
        # the row argmax of the greedy rows and the exponential race: the model's fused ops'
        # (FusedOps.argmax; torch's argmax reduces a row in one thread block) or torch's
        self.argmax = argmax or reference_argmax

    def sample_ids(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The sampled token of every row, [R] int64 on the logits' device, without a host sync
        (the overlapped decode path reads it one step later)."""
        num_rows, vocab_size = logits.shape
        if len(batch) != num_rows:
            raise ValueError(f"batch has {len(batch)} rows but logits have {num_rows}")
        device = logits.device
        penalised = [i for i, p in enumerate(batch.params) if has_penalties(p)]
        greedy = [i for i, p in enumerate(batch.params) if p.is_greedy]
        banned = any(batch.banned_token_ids)
        if len(greedy) == num_rows and not penalised and not banned:
            return self.argmax(logits)  # the common greedy batch: no copy
        work = self._penalised(logits, batch)  # [B, V]
        if not greedy:  # every row sampled: `work` itself, no longer needed, is filtered in place
            filtered = self._filtered(work, None, batch.params)
            return random_sample(filtered, batch.generators, self.default_generator, self.argmax)
        token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
        rows = to_device(greedy, torch.long, device)
        token_ids.index_copy_(0, rows, self.argmax(work.index_select(0, rows)))
        sampled_rows = [i for i, p in enumerate(batch.params) if not p.is_greedy]
        if sampled_rows:
            rows = to_device(sampled_rows, torch.long, device)
            sampled = random_sample(
                self._filtered(work, rows, [batch.params[i] for i in sampled_rows]),
                [batch.generators[i] for i in sampled_rows],
                self.default_generator,
                self.argmax,
            )
            token_ids.index_copy_(0, rows, sampled)
        return token_ids

    def probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """[R, V] float32: the distribution each row's token is sampled from (bans, penalties,
        temperature, top-k / top-p / min-p applied; greedy rows one-hot at their argmax).
        Speculative sampling accepts drafts against it (deltaserve/spec/acceptance.py)."""
        num_rows, vocab_size = logits.shape
        device = logits.device
        work = self._penalised(logits, batch)
        greedy = [i for i, p in enumerate(batch.params) if p.is_greedy]
        sampled_rows = [i for i, p in enumerate(batch.params) if not p.is_greedy]
        if not greedy:  # every row sampled
            return torch.softmax(self._filtered(work, None, batch.params), dim=-1)
        out = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
        rows = to_device(greedy, torch.long, device)
        hot = work.index_select(0, rows).argmax(dim=-1, keepdim=True)  # [G, 1]
        out.index_copy_(0, rows, torch.zeros_like(work[: len(greedy)]).scatter_(1, hot, 1.0))
        if sampled_rows:
            rows = to_device(sampled_rows, torch.long, device)
            sub = self._filtered(work, rows, [batch.params[i] for i in sampled_rows])
            out.index_copy_(0, rows, torch.softmax(sub, dim=-1))
        return out

    @staticmethod
    def _penalised(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """A float32 copy of the logits with bans and penalties applied."""
        work = logits.to(torch.float32, copy=True)  # [B, V]
        apply_banned_tokens(work, batch.banned_token_ids)
        penalised = [i for i, p in enumerate(batch.params) if has_penalties(p)]
        if penalised:
            rows = to_device(penalised, torch.long, logits.device)
            sub = work.index_select(0, rows)
            params = [batch.params[i] for i in penalised]
            apply_penalties(
                sub,
                [batch.prompt_token_ids[i] for i in penalised],
                [batch.output_token_ids[i] for i in penalised],
                [p.repetition_penalty for p in params],
                [p.frequency_penalty for p in params],
                [p.presence_penalty for p in params],
            )
            work.index_copy_(0, rows, sub)
        return work

    @staticmethod
    def _filtered(
        work: torch.Tensor, rows: torch.Tensor | None, params: list[SamplingParams]
    ) -> torch.Tensor:
        """The random rows `rows` of `work` (None: all of them, `work` itself, which is then
        changed in place), divided by their temperature, with top-k / top-p / min-p applied
        (filtered tokens -inf). A temperature of 1 divides nothing (x / 1 is x exactly): one
        pass over [R, V] float32 less, and one more without the row copy, at a batch's width."""
        sub = work if rows is None else work.index_select(0, rows)
        if any(p.temperature != 1.0 for p in params):
            temperature = to_device([p.temperature for p in params], torch.float32, work.device)
            sub.div_(temperature.unsqueeze(1))
        return apply_top_k_top_p_min_p(
            sub,
            [p.top_k for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
        )

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        num_rows = logits.shape[0]
        device = logits.device
        token_ids = self.sample_ids(logits, batch)
        # Logprobs (a full-vocabulary log_softmax) only for the rows that asked for them; the
        # others report 0.0 and rank 0, which the engine never shows (cumulative_logprob is
        # None for requests without logprobs).
        ids = token_ids.tolist()
        token_logprobs, ranks = [0.0] * num_rows, [0] * num_rows
        top: list[list[tuple[int, float]]] = [[] for _ in range(num_rows)]
        asked = [i for i, p in enumerate(batch.params) if p.logprobs is not None]
        if asked:
            rows = to_device(asked, torch.long, device)
            lps, rks, tops = compute_logprobs_topk(
                logits.index_select(0, rows),
                token_ids.index_select(0, rows),
                [batch.params[i].logprobs or 0 for i in asked],
            )
            for j, i in enumerate(asked):
                token_logprobs[i], ranks[i], top[i] = lps[j], rks[j], tops[j]
        return SamplerOutput(token_ids=ids, logprobs=token_logprobs, ranks=ranks, top_logprobs=top)


def has_penalties(params: SamplingParams) -> bool:
    """Whether any of the three penalties is active (they read the token histories)."""
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )
