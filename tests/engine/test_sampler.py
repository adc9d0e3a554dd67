"""Sampler: greedy, filters, penalties, seeds, bans, logprobs, temperature statistics."""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.engine.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    compute_logprobs_topk,
)
from deltaserve.sampling_params import SamplingParams


def make_batch(
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    banned: list[list[int]] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(
        params=params,
        generators=generators if generators is not None else [None] * n,
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(n)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(n)],
        banned_token_ids=banned if banned is not None else [[] for _ in range(n)],
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def counts(tokens: list[int], vocab: int) -> list[int]:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).tolist()


# Probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1.
CRAFTED = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()


def draw(params: SamplingParams, logits_row: torch.Tensor, rows: int, seed: int = 0) -> list[int]:
    logits = logits_row.unsqueeze(0).repeat(rows, 1)
    return Sampler(seeded(seed))(logits, make_batch([params] * rows)).token_ids


def test_greedy_is_argmax_and_input_untouched() -> None:
    logits = torch.randn(7, 50, generator=seeded(1))
    before = logits.clone()
    out = Sampler()(logits, make_batch([SamplingParams(temperature=0.0)] * 7))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert torch.equal(logits, before)


def test_greedy_rows_unaffected_by_random_rows_in_batch() -> None:
    logits = torch.randn(6, 40, generator=seeded(2))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5) for i in range(6)]
    out = Sampler(seeded(0))(logits, make_batch(params))
    for i in range(1, 6, 2):
        assert out.token_ids[i] == logits[i].argmax().item()


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(64, 100, generator=seeded(3))
    params = [SamplingParams(temperature=1.0, top_k=1)] * 64
    out = Sampler(seeded(4))(logits, make_batch(params))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_equals_greedy() -> None:
    logits = torch.randn(64, 100, generator=seeded(5))
    params = [SamplingParams(temperature=1.0, top_p=1e-6)] * 64
    out = Sampler(seeded(6))(logits, make_batch(params))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    ("kwargs", "allowed"),
    [
        ({}, {0, 1, 2, 3}),
        ({"min_p": 0.2}, {0, 1, 2}),  # drop p < 0.2 * 0.5 = 0.1
        ({"min_p": 0.5}, {0, 1}),  # drop p < 0.25
        ({"top_k": 2}, {0, 1}),
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_p": 0.75}, {0, 1}),  # mass before token 2 is 0.8 >= 0.75
        ({"top_p": 0.85}, {0, 1, 2}),
        ({"top_p": 0.85, "min_p": 0.5}, {0, 1}),
    ],
)
def test_filters_decide_which_tokens_can_appear(kwargs: dict, allowed: set[int]) -> None:
    tokens = draw(SamplingParams(**kwargs), CRAFTED, rows=4000, seed=7)
    assert set(tokens) == allowed


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    apply_penalties(
        logits,
        prompt_token_ids=[[0, 1], [0, 1]],
        output_token_ids=[[1, 3, 3], [1, 3, 3]],
        repetition_penalties=[2.0, 1.0],
        frequency_penalties=[0.5, 0.0],
        presence_penalties=[0.25, 0.0],
    )
    # Row 0: repetition over {0, 1, 3}: 2/2, -1*2, 3/2; then output counts {1: 1, 3: 2}:
    # token 1: -2 - 0.5*1 - 0.25 = -2.75; token 3: 1.5 - 0.5*2 - 0.25 = 0.25.
    assert logits[0].tolist() == [1.0, -2.75, 0.5, 0.25, -2.0]
    assert logits[1].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]


def test_frequency_and_presence_ignore_prompt_tokens() -> None:
    logits = torch.zeros(1, 4)
    apply_penalties(logits, [[0, 0, 1]], [[2]], [1.0], [1.0], [1.0])
    assert logits[0].tolist() == [0.0, 0.0, -2.0, 0.0]


def test_penalties_change_greedy_choice_through_sampler() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0]] * 3)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, frequency_penalty=0.2),
        SamplingParams(temperature=0.0, repetition_penalty=1.1),
    ]
    out = Sampler()(logits, make_batch(params, prompts=[[3]] * 3, outputs=[[0]] * 3))
    assert out.token_ids == [0, 1, 1]


def test_banned_tokens_never_sampled() -> None:
    row = torch.tensor([0.0, 0.0, 9.0, 0.0, 8.0])
    greedy = Sampler()(row.unsqueeze(0), make_batch([SamplingParams(temperature=0)], banned=[[2]]))
    assert greedy.token_ids == [4]
    rows = 3000
    logits = row.unsqueeze(0).repeat(rows, 1)
    params = [SamplingParams(temperature=2.0)] * rows
    out = Sampler(seeded(8))(logits, make_batch(params, banned=[[2, 4]] * rows))
    assert set(out.token_ids) == {0, 1, 3}


def _run_steps(
    step_logits: list[torch.Tensor], row: int, params: list[SamplingParams], seeds: list[int | None]
) -> list[int]:
    """Sample len(step_logits) steps; return the tokens of batch row `row`."""
    generators = [seeded(s) if s is not None else None for s in seeds]
    sampler = Sampler()
    tokens = []
    for logits in step_logits:
        out = sampler(logits, make_batch(params, generators))
        tokens.append(out.token_ids[row])
    return tokens


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    vocab, steps = 500, 25
    base = [torch.randn(vocab, generator=seeded(100 + t)) for t in range(steps)]
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = _run_steps([b.unsqueeze(0) for b in base], 0, [p], [1234])
    other = SamplingParams(temperature=1.3, top_k=50)
    torch.manual_seed(99)
    batched_logits = [torch.stack([torch.randn(vocab), torch.randn(vocab), b]) for b in base]
    batched = _run_steps(batched_logits, 2, [other, other, p], [None, 7, 1234])
    assert len(set(alone)) > 5  # really random, not trivially constant
    assert batched == alone


def test_different_seeds_differ() -> None:
    vocab, steps = 500, 20
    base = [torch.zeros(1, vocab) for _ in range(steps)]
    a = _run_steps(base, 0, [SamplingParams(seed=1)], [1])
    b = _run_steps(base, 0, [SamplingParams(seed=2)], [2])
    a2 = _run_steps(base, 0, [SamplingParams(seed=1)], [1])
    assert a != b
    assert a == a2


def test_logprobs_ranks_topk_are_of_raw_distribution() -> None:
    logits = torch.randn(4, 30, generator=seeded(9))
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.5, repetition_penalty=1.7, logprobs=5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    out = Sampler(seeded(10))(
        logits, make_batch(params, outputs=[[1, 2]] * 4, banned=[[], [0], [], [5]])
    )
    raw = torch.log_softmax(logits, dim=-1)
    # row 2 asked for no logprobs: they are not computed (0.0, rank 0)
    assert out.logprobs[2] == 0.0 and out.ranks[2] == 0
    for i, tok in enumerate(out.token_ids):
        if i == 2:
            continue
        assert out.logprobs[i] == pytest.approx(raw[i, tok].item(), abs=1e-6)
        assert out.ranks[i] == int((raw[i] >= raw[i, tok]).sum())
        order = raw[i].argsort(descending=True).tolist()
        assert out.ranks[i] == order.index(tok) + 1
    assert out.ranks[0] == 1
    assert [len(t) for t in out.top_logprobs] == [3, 5, 0, 0]
    for i, top in enumerate(out.top_logprobs):
        expected = raw[i].topk(len(top)).values.tolist() if top else []
        assert [lp for _, lp in top] == pytest.approx(expected, abs=1e-6)
        for tok, lp in top:
            assert lp == pytest.approx(raw[i, tok].item(), abs=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:], strict=False))


def test_sampling_from_logits_equals_the_race_on_probabilities() -> None:
    from deltaserve.engine.sampler import exponential_noise, random_sample

    logits = torch.randn(6, 50, generator=seeded(3)) * 3
    logits[1, :10] = float("-inf")
    gens = [seeded(20 + i) if i % 2 else None for i in range(6)]
    gens2 = [seeded(20 + i) if i % 2 else None for i in range(6)]
    a = (logits.softmax(-1) / exponential_noise(logits, gens, seeded(5))).argmax(dim=-1)
    b = random_sample(logits, gens2, seeded(5))
    assert torch.equal(a, b) and (b[1] >= 10)


def test_compute_logprobs_topk_whole_vocab_for_prompt() -> None:
    logits = torch.randn(3, 12, generator=seeded(11))
    next_tokens = [4, 0, 11]
    lps, ranks, top = compute_logprobs_topk(logits, next_tokens, -1)
    raw = torch.log_softmax(logits, dim=-1)
    for i, tok in enumerate(next_tokens):
        assert lps[i] == pytest.approx(raw[i, tok].item(), abs=1e-6)
        assert ranks[i] == raw[i].argsort(descending=True).tolist().index(tok) + 1
        assert [t for t, _ in top[i]] == raw[i].argsort(descending=True).tolist()
        assert sum(math.exp(lp) for _, lp in top[i]) == pytest.approx(1.0, abs=1e-5)
    _, _, top2 = compute_logprobs_topk(logits, next_tokens, [2, 0, 1])
    assert [len(t) for t in top2] == [2, 0, 1]


def _chi_square(observed: list[int], probs: torch.Tensor) -> float:
    total = sum(observed)
    expected = (probs * total).tolist()
    return sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))


def test_temperature_histogram_matches_softmax() -> None:
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    temperature, rows = 0.7, 20000
    tokens = draw(SamplingParams(temperature=temperature), row, rows=rows, seed=12)
    observed = counts(tokens, 5)
    target = torch.softmax(row / temperature, dim=-1)
    # 4 degrees of freedom: P(chi2 > 25) ~ 5e-5.
    assert _chi_square(observed, target) < 25.0
    # The same draws are far from the untempered distribution (so the check can fail).
    assert _chi_square(observed, torch.softmax(row, dim=-1)) > 100.0


@pytest.mark.parametrize("temperatures", [[1.0, 1.0, 1.0], [0.7, 1.0, 1.3], [0.7, 0.0, 1.3]])
def test_sampled_rows_equal_the_exponential_race_written_out(temperatures: list[float]) -> None:
    """Every sampled row's token is argmax(logits / T - log E) with E the row's own Exp(1) draw
    (clamped to the smallest positive float), exactly, whether all rows are sampled (filtered in
    place, no row copy; a temperature of 1 divides nothing) or some are greedy; the input
    logits are untouched and `probs` is softmax(logits / T) on the sampled rows."""
    vocab = 50
    logits = torch.randn(3, vocab, generator=seeded(7)).to(torch.bfloat16)
    before = logits.clone()
    params = [SamplingParams(temperature=t) for t in temperatures]
    batch = make_batch(params, [seeded(10 + i) for i in range(3)])
    got = Sampler().sample_ids(logits, batch)
    assert torch.equal(logits, before)
    for i, t in enumerate(temperatures):
        row = logits[i].float()
        if t == 0.0:
            assert got[i].item() == row.argmax().item()
            continue
        noise = torch.empty(vocab).exponential_(generator=seeded(10 + i))
        noise = noise.clamp_(min=torch.finfo(torch.float32).tiny)
        want = (row / t - noise.log()).argmax().item()
        assert got[i].item() == want, (i, t)
    probs = Sampler().probs(logits, make_batch(params))
    for i, t in enumerate(temperatures):
        if t > 0.0:
            torch.testing.assert_close(
                probs[i], torch.softmax(logits[i].float() / t, -1), rtol=0, atol=0
            )
        else:
            assert probs[i].sum().item() == 1.0 and probs[i, logits[i].float().argmax()] == 1.0
