"""Prompt lookup ("ngram") drafting: no drafter model.

For a sequence ending in tokens s = t[L-n:] (n from prompt_lookup_max down to
prompt_lookup_min), find the most recent earlier place where the same n tokens occur; the tokens
that followed them there are the drafts (up to k, fewer near the end). The longest n that
matches wins; no match: no drafts. Drafts are deterministic (q one-hot).
"""

from __future__ import annotations

import numpy as np

from deltaserve.engine.sequence import Sequence
from deltaserve.spec.proposer import Draft, Proposer


def lookup_ngram(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of
    `tokens` of length in [lo, hi] that occurs earlier; [] when none does."""
    L = len(tokens)
    if L < 2 or k < 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(hi, L - 1), lo - 1, -1):
        suffix = arr[L - n :]
        # windows starting at 0 .. L - n - 1 (the suffix itself, at L - n, is excluded)
        windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)  # [L - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the token after the most recent match
            return [int(t) for t in arr[start : start + k]]
    return []


class NgramProposer(Proposer):
    """Prompt lookup over each sequence's own tokens (prompt and output)."""

    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[Draft]:
        lo, hi = self.spec.prompt_lookup_min, self.spec.prompt_lookup_max
        assert lo is not None and hi is not None
        return [
            Draft(lookup_ngram(seq.token_ids, lo, hi, k))
            for seq, k in zip(seqs, max_drafts, strict=True)
        ]
