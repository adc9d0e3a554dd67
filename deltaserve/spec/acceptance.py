"""Rejection sampling of drafts against the target (speculative sampling), for drafts that come
with their draft distributions q.

Row inputs [x, d_1 .. d_k], target distributions p_0 .. p_k (after temperature, top-k / top-p /
min-p, penalties and bans: what the target would sample from), draft distributions q_1 .. q_k
(d_i was drawn from q_i):

    for i = 1 .. k:
        accept d_i with probability min(1, p_{i-1}(d_i) / q_i(d_i))
        on rejection: emit t ~ norm(max(p_{i-1} - q_i, 0)) and stop
    all accepted: emit a bonus t ~ p_k

Each emitted token has exactly the target's distribution given the tokens before it (Leviathan
et al. 2023; Chen et al. 2023): P(t) = min(p, q)(t) + (1 - sum min(p, q)) * norm(p - q)+(t) = p(t).
Deterministic drafts are q one-hot, where this reduces to engine/logits.py's rule (accept with
probability p(d), else a sample from p without d).
"""

from __future__ import annotations

import torch


def rejection_sample_batch(
    p: torch.Tensor,
    q: torch.Tensor,
    drafts: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of N rows of k drafts at once (no host reads).

    Args:
        p: [N, k + 1, V] target probabilities at each row's positions.
        q: [N, k, V] draft probabilities the drafts were sampled from.
        drafts: [N, k] int64 draft token ids.
        generator: drives every draw (None: torch's default), on p's device.

    Returns:
        num_accepted [N] (0 .. k) and the token each row emits after its accepted drafts [N]: a
        sample of the residual at the first rejection, or the bonus token from p_k.
    """
    N, k1, V = p.shape
    k = k1 - 1
    if q.shape != (N, k, V) or drafts.shape != (N, k):
        raise ValueError(f"p {tuple(p.shape)}, q {tuple(q.shape)}, drafts {tuple(drafts.shape)}")
    p, q = p.float(), q.float()
    u = torch.rand(N, k, generator=generator, device=p.device)
    pd = p[:, :k].gather(2, drafts[..., None]).squeeze(-1)  # [N, k] p_{i-1}(d_i)
    qd = q.gather(2, drafts[..., None]).squeeze(-1)  # [N, k] q_i(d_i)
    # NOTE: u < p/q written as u * q < p: min(1, p/q) without dividing (q(d) = 0 accepts)
    accept = u * qd < pd
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # leading accepts, [N]
    rows = torch.arange(N, device=p.device)
    p_a = p[rows, num_accepted]  # [N, V] the target at the first rejected (or bonus) position
    q_a = q[rows, num_accepted.clamp(max=max(k - 1, 0))] if k else torch.zeros_like(p_a)
    q_a = torch.where((num_accepted < k)[:, None], q_a, torch.zeros_like(q_a))  # bonus: p_k
    residual = (p_a - q_a).clamp_min(0.0)
    total = residual.sum(dim=-1, keepdim=True)
    # residual mass 0 means p <= q everywhere, i.e. p == q: rejection had probability 0
    dist = torch.where(total > 0, residual / total.clamp_min(1e-30), p_a)
    final = torch.multinomial(dist, 1, generator=generator).squeeze(1)
    return num_accepted, final


def rejection_sample(
    p: torch.Tensor,
    q: torch.Tensor,
    drafts: list[int],
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens one verify row emits: the accepted drafts, then one target token.

    Args:
        p: [k + 1, V] target probabilities at the row's positions (rows sum to 1).
        q: [k, V] draft probabilities the drafts were sampled from.
        drafts: the k draft token ids.
        generator: the request's generator (None: torch's default), on p's device.

    Returns:
        a + 1 token ids (a = drafts accepted, 0 .. k).
    """
    k = len(drafts)
    if q.shape[0] != k or p.shape[0] != k + 1 or p.shape[1] != q.shape[1]:
        raise ValueError(f"p {tuple(p.shape)}, q {tuple(q.shape)} for {k} drafts")
    d = torch.tensor([drafts], dtype=torch.long, device=p.device).view(1, k)
    a, final = rejection_sample_batch(p[None], q[None], d, generator)
    n = int(a[0])
    return list(drafts[:n]) + [int(final[0])]
