"""Acceptance statistics of speculative decoding (runtime stats and /metrics).

Per verify row (a sequence's row that carried drafts): the drafts it carried and how many were
accepted. Mean acceptance length = tokens a verify row emits on average = 1 + accepted / rows.
Per-position acceptance rate at position i = rows that accepted draft i / rows that carried a
draft i.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecSnapshot:
    """Totals since start (counters) and the derived rates."""

    num_verify_rows: int
    num_draft_tokens: int
    num_accepted_tokens: int
    drafted_per_position: tuple[int, ...]
    accepted_per_position: tuple[int, ...]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify row (accepted drafts + the target's own token)."""
        if not self.num_verify_rows:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_verify_rows

    @property
    def acceptance_rate_per_position(self) -> tuple[float, ...]:
        return tuple(
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)
        )


class SpecStats:
    def __init__(self, k: int) -> None:
        self.k = k
        self.reset()

    def reset(self) -> None:
        """Every count back to zero."""
        self.num_verify_rows = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.drafted = [0] * self.k
        self.accepted = [0] * self.k

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One verify row: `num_drafts` drafts carried, the first `num_accepted` accepted."""
        if not 0 <= num_accepted <= num_drafts <= self.k:
            raise ValueError(f"{num_accepted} accepted of {num_drafts} drafts (k = {self.k})")
        self.num_verify_rows += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_drafts):
            self.drafted[i] += 1
        for i in range(num_accepted):
            self.accepted[i] += 1

    def snapshot(self) -> SpecSnapshot:
        return SpecSnapshot(
            self.num_verify_rows,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            tuple(self.drafted),
            tuple(self.accepted),
        )

    def describe(self) -> str:
        s = self.snapshot()
        rates = " ".join(f"{r:.2f}" for r in s.acceptance_rate_per_position)
        return (
            f"speculative: {s.num_verify_rows} verify rows, {s.num_draft_tokens} drafts, "
            f"{s.num_accepted_tokens} accepted, mean acceptance length "
            f"{s.mean_acceptance_length:.2f}, per position [{rates}]"
        )
