"""The scheduler's view of one cache pool: units handed to sequences (bookkeeping, no tensors).

A pool manager owns the unit ids of one pool kind ("paged" blocks, "slots"); every layer whose
spec names that pool indexes its tensors with the same ids. The scheduler holds a list of them
and asks each, in turn, whether a sequence can grow by n tokens, then lets each allocate: it
never needs to know what a unit is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from deltaserve.engine.prefix_cache import PrefixCache, PrefixHit
    from deltaserve.engine.sequence import Sequence


class PoolManager(ABC):
    """Units of one pool for the running sequences.

    NOTE: `can_allocate` and `allocate_for` come in pairs: the scheduler asks every pool first
    and allocates only when all agree, so a refused step changes nothing anywhere.
    """

    kind: ClassVar[str] = "?"  # the pool kind it manages (deltaserve.cache.pools)
    # whether a prefix-cache hit can stand in for computing its tokens in this pool
    supports_prefix_caching: ClassVar[bool] = False
    prefix_cache: PrefixCache | None = None  # the prefix cache over this pool's units, if any

    @abstractmethod
    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> bool:
        """Whether `seq` can get the units for `num_new_tokens` more tokens (after the tokens of
        a prefix-cache `hit`, which it would then share)."""

    @abstractmethod
    def allocate_for(
        self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> None:
        """Give `seq` the units for `num_new_tokens` more tokens (call after `can_allocate`)."""

    @abstractmethod
    def release(self, seq: Sequence) -> None:
        """Drop every unit `seq` holds (finished, aborted or preempted)."""

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """`seq` now has only `num_tokens` tokens (rejected drafts rolled back): drop the units
        past them. Pools whose units do not depend on length keep everything."""
        return None

    def shortage(self, seq: Sequence, num_new_tokens: int) -> str:
        """Why `can_allocate(seq, num_new_tokens)` is False, in words."""
        return f"the {self.kind} pool has {self.num_free} free units, too few"

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Units sequences can own (null units excluded)."""

    @property
    @abstractmethod
    def num_free(self) -> int:
        """Units ready to be handed out (cached-but-unused blocks included)."""

    @property
    def num_used(self) -> int:
        """Units held by sequences."""
        return self.capacity - self.num_free

    def wrap_prefix_cache(
        self, cache: PrefixCache | None, pools: list[PoolManager]
    ) -> PrefixCache | None:
        """The prefix cache the scheduler uses, given the one built so far over `pools`: a pool
        that extends prefix hits (state snapshots) wraps it; others return it unchanged."""
        return cache

    @property
    def max_sequences(self) -> int | None:
        """The most sequences this pool can serve at once, or None when only length limits it."""
        return None
