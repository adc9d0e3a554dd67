"""Speculative sampling keeps the target's distribution exactly.

A synthetic target p(. | prefix) and drafter q(. | prefix) over a vocabulary of 4: speculative
generation of 3 tokens (k = 2 drafts per round, rounds repeated until 3 tokens) is sampled 1e5
times (vectorised over samples) and the joint distribution of the 3 tokens is compared, by a
chi-square test, with the exact one enumerated from the target (prod_i p(t_i | prefix)).
Drafters: q = p, one-hot q (a greedy drafter of another model), random q, and q with zeros where
p > 0. A wrong rule (resampling from p instead of the residual) fails the same test.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from deltaserve.spec.acceptance import rejection_sample, rejection_sample_batch

V, NEW, K = 4, 3, 2
SAMPLES = 100_000
MAX_LEN = NEW + K  # longest prefix a distribution is asked for


def code(prefix: tuple[int, ...]) -> int:
    """A unique index per prefix (base V + 1, digits t + 1)."""
    c = 0
    for t in prefix:
        c = c * (V + 1) + t + 1
    return c


def table(seed: int, kind: str = "random") -> torch.Tensor:
    """[(V + 1) ** MAX_LEN, V]: a distribution for every prefix of up to MAX_LEN tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros((V + 1) ** MAX_LEN, V)
    for n in range(MAX_LEN + 1):
        for prefix in itertools.product(range(V), repeat=n):
            logits = torch.randn(V, generator=gen) * 1.5
            if kind == "zeros":  # q = 0 on two tokens (where p > 0)
                logits[torch.randperm(V, generator=gen)[:2]] = float("-inf")
            out[code(prefix)] = torch.softmax(logits, dim=0)
    return out


def drafter(kind: str, p: torch.Tensor) -> torch.Tensor:
    if kind == "q=p":
        return p
    if kind == "one-hot":  # a greedy drafter of a slightly different model
        return torch.nn.functional.one_hot((p + 0.3 * torch.arange(V)).argmax(-1), V).float()
    return table(7, kind)


def rejection_batch_rule(p, q, drafts, gen):
    return rejection_sample_batch(p, q, drafts, gen)


def wrong_rule(p, q, drafts, gen):
    """Accepts as the right rule, but resamples from p (not the residual) after a rejection."""
    a, _ = rejection_sample_batch(p, q, drafts, gen)
    rows = torch.arange(p.shape[0])
    final = torch.multinomial(p[rows, a], 1, generator=gen).squeeze(1)
    return a, final


def speculate(p, q, rule, samples, seed=0) -> torch.Tensor:
    """[samples, NEW] tokens from speculative rounds until NEW tokens."""
    gen = torch.Generator().manual_seed(seed)
    N = samples
    out = torch.zeros(N, NEW + K + 1, dtype=torch.long)
    length = torch.zeros(N, dtype=torch.long)
    codes = torch.zeros(N, dtype=torch.long)  # code of each sample's prefix so far
    rows = torch.arange(N)
    while bool((length < NEW).any()):
        c = codes.clone()
        drafts, qs, ps = [], [], [p[c]]
        for _ in range(K):
            qi = q[c]  # [N, V]
            d = torch.multinomial(qi, 1, generator=gen).squeeze(1)
            drafts.append(d)
            qs.append(qi)
            c = c * (V + 1) + d + 1
            ps.append(p[c])
        d = torch.stack(drafts, 1)  # [N, K]
        a, final = rule(torch.stack(ps, 1), torch.stack(qs, 1), d, gen)
        active = length < NEW
        for i in range(K + 1):  # emit d_1 .. d_a, then final
            tok = d[:, i] if i < K else final
            tok = torch.where(i < a, tok, final)
            put = active & (i <= a) & (length < NEW)
            out[rows[put], length[put]] = tok[put]
            codes = torch.where(put, codes * (V + 1) + tok + 1, codes)
            length = length + put.long()
    return out[:, :NEW]


def chi2_critical(df: int, z: float = 4.26) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile z sigmas out (p ~ 1e-5)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(p, q, rule, samples=SAMPLES) -> tuple[float, int]:
    toks = speculate(p, q, rule, samples)
    idx = (toks * torch.tensor([V * V, V, 1])).sum(1)
    counts = torch.bincount(idx, minlength=V**NEW).double()
    stat = 0.0
    for seq in itertools.product(range(V), repeat=NEW):
        exact = math.prod(float(p[code(seq[:i]), seq[i]]) for i in range(NEW))
        expected = exact * samples
        j = seq[0] * V * V + seq[1] * V + seq[2]
        stat += (float(counts[j]) - expected) ** 2 / expected
    return stat, V**NEW - 1


@pytest.mark.parametrize("kind", ["q=p", "one-hot", "random", "zeros"])
def test_joint_distribution_is_the_targets(kind):
    p = table(0)
    stat, df = chi2_stat(p, drafter(kind, p), rejection_batch_rule)
    assert stat < chi2_critical(df), (kind, stat, df)


def test_a_wrong_rule_fails_the_same_test():
    p = table(0)
    stat, df = chi2_stat(p, drafter("random", p), wrong_rule, samples=20_000)
    assert stat > 3 * chi2_critical(df), stat


def test_one_row_form_agrees_with_the_batch():
    """`rejection_sample` (one row, host lists) = the batch form on the same draws."""
    p = torch.softmax(torch.randn(3, 5, generator=torch.Generator().manual_seed(1)), -1)
    q = torch.softmax(torch.randn(2, 5, generator=torch.Generator().manual_seed(2)), -1)
    for seed in range(20):
        got = rejection_sample(p, q, [1, 3], torch.Generator().manual_seed(seed))
        a, final = rejection_sample_batch(
            p[None], q[None], torch.tensor([[1, 3]]), torch.Generator().manual_seed(seed)
        )
        assert got == [1, 3][: int(a[0])] + [int(final[0])]


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="for 2 drafts"):
        rejection_sample(torch.rand(2, 4), torch.rand(2, 4), [1, 2])
