"""One request's images after preprocessing: what the engine keeps on its Sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageItem:
    """One image of a prompt: its patches, grid and where its placeholder tokens sit."""

    pixel_values: torch.Tensor  # [t * h * w, C * Tp * P * P] host float32 (the processor's)
    grid_thw: tuple[int, int, int]  # patch grid before the spatial merge
    content_hash: str  # sha256 of the patches and grid: equal images share it
    offset: int  # index of its first placeholder token in the prompt
    num_tokens: int  # placeholder tokens = merged embeddings = t * h * w / merge^2

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass
class MultiModalRecord:
    """A prompt's images, in prompt order, and its M-RoPE positions.

    `positions` [3, P] int64 (temporal, height, width) of every prompt token; past the prompt
    (and from the last image's end on) a token at index i sits at i + `mrope_delta` on all
    three axes, as HF's `get_rope_index` / `rope_deltas` place decoded tokens."""

    items: list[ImageItem]
    positions: torch.Tensor  # [3, P] int64, host
    mrope_delta: int

    @property
    def last_end(self) -> int:
        return max(item.end for item in self.items)

    def rope_positions(self, start: int, n: int) -> list[list[int]] | list[int]:
        """Positions of tokens start .. start + n - 1: a list [n] when the three axes agree for
        all of them (the plain rotary path), else three lists [3][n]."""
        P = self.positions.shape[1]
        if start >= self.last_end:  # text after the last image, prompt or generated
            d = self.mrope_delta
            return list(range(start + d, start + n + d))
        stop = min(start + n, P)
        block = self.positions[:, start:stop]  # [3, m]
        tail = list(range(stop + self.mrope_delta, start + n + self.mrope_delta))
        if bool((block[0] == block[1]).all()) and bool((block[0] == block[2]).all()):
            return block[0].tolist() + tail
        rows = block.tolist()
        return [r + tail for r in rows]

    def overlapping(self, start: int, end: int) -> list[ImageItem]:
        """The images with a placeholder token in [start, end)."""
        return [it for it in self.items if it.offset < end and start < it.end]

    def hash_key(self, start: int, end: int) -> tuple[str, ...]:
        """Content hashes of the images whose placeholders overlap tokens [start, end): mixed
        into prefix-cache block hashes so two images never share a block by placeholder ids."""
        return tuple(it.content_hash for it in self.overlapping(start, end))
