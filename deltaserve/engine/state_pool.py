"""Recurrent-state slots for linear-attention layers (bookkeeping only, no tensors).

Slot 0 is the null slot: padded batch rows point at it, no request ever owns it.
"""

from __future__ import annotations


class StatePool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"the state pool needs at least 2 slots (1 null + 1), got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, 0, -1))  # pop() yields 1, 2, ...
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def capacity(self) -> int:
        """Slots requests can own (all but the null slot)."""
        return self.num_slots - 1

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
