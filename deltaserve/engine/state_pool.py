"""Recurrent-state slots for linear-attention layers (bookkeeping only, no tensors).

Slot 0 is the null slot: padded batch rows point at it, no request ever owns it.
"""

from __future__ import annotations

from deltaserve.cache.manager import PoolManager
from deltaserve.engine.prefix_cache import PrefixHit
from deltaserve.engine.sequence import Sequence


class StatePool(PoolManager):
    """The "slots" pool: a running sequence holds one slot (`seq.state_slot`), whatever its
    length. It cannot serve prefix-cache hits (that needs state snapshots)."""

    kind = "slots"
    supports_prefix_caching = False

    def __init__(self, num_slots: int, num_scratch: int = 0) -> None:
        if num_slots - num_scratch < 2:
            raise ValueError(
                f"the state pool needs at least 2 slots (1 null + 1) besides its {num_scratch} "
                f"scratch slots, got {num_slots}"
            )
        self.num_slots = num_slots
        # NOTE: the last num_scratch slots are never handed out: speculative decoding keeps the
        # pre-verify states of a step's draft rows there (deltaserve.spec.gdn_rollback)
        self.scratch_slots = range(num_slots - num_scratch, num_slots)
        owned = num_slots - num_scratch
        self._free: list[int] = list(range(owned - 1, 0, -1))  # pop() yields 1, 2, ...
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def capacity(self) -> int:
        """Slots requests can own (all but the null slot and the scratch slots)."""
        return self.num_slots - 1 - len(self.scratch_slots)

    @property
    def max_sequences(self) -> int:
        return self.capacity

    def allocate(self) -> int | None:
        """A free slot id, or None when all are taken."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"state slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)

    # ---- PoolManager -------------------------------------------------------------------
    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> bool:
        return bool(seq.state_slot) or bool(self._free)

    def allocate_for(
        self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> None:
        if seq.state_slot:
            return
        slot = self.allocate()
        if slot is None:
            raise RuntimeError(self.shortage(seq, num_new_tokens))
        seq.state_slot = slot

    def release(self, seq: Sequence) -> None:
        if seq.state_slot:
            self.free(seq.state_slot)
        seq.state_slot = 0

    def shortage(self, seq: Sequence, num_new_tokens: int) -> str:
        return "no free recurrent-state slot"
