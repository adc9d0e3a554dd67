"""Encoder outputs by image content hash: each image is encoded once per request (and shared by
requests with the same image while it stays cached), evicted least recently used past a
capacity in embedding rows. An entry is pinned while a running request still needs it."""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    """content hash -> embeddings [num_tokens, hidden] on the device."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"encoder cache capacity must be >= 1 token, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._pins: dict[str, int] = {}
        self.num_tokens = 0
        self.num_encoded = 0  # images run through the encoder (a miss each)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: str, value: torch.Tensor) -> None:
        """Insert (counted as one encoder run), then evict unpinned entries, oldest first,
        while over capacity (the new entry stays even when it alone exceeds it)."""
        self.num_encoded += 1
        if key in self._entries:
            self.num_tokens -= self._entries[key].shape[0]
        self._entries[key] = value
        self._entries.move_to_end(key)
        self.num_tokens += value.shape[0]
        for old in list(self._entries):
            if self.num_tokens <= self.capacity_tokens:
                break
            if old == key or self._pins.get(old, 0):
                continue
            self.num_tokens -= self._entries.pop(old).shape[0]

    def pin(self, keys: list[str]) -> None:
        """A request that will need these images was admitted."""
        for k in keys:
            self._pins[k] = self._pins.get(k, 0) + 1

    def unpin(self, keys: list[str]) -> None:
        """A request that needed these images finished or was aborted: they may be evicted."""
        for k in keys:
            n = self._pins.get(k, 0) - 1
            if n > 0:
                self._pins[k] = n
            else:
                self._pins.pop(k, None)
        if self.num_tokens > self.capacity_tokens:
            for old in list(self._entries):
                if self.num_tokens <= self.capacity_tokens:
                    break
                if not self._pins.get(old, 0):
                    self.num_tokens -= self._entries.pop(old).shape[0]

    @property
    def num_pinned(self) -> int:
        return len(self._pins)
