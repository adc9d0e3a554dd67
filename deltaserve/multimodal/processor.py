"""Prompt + PIL images -> expanded token ids + the request's multimodal record.

Resizing and normalisation are transformers' image processor, loaded from the checkpoint's
`preprocessor_config.json` (the class it names, e.g. Qwen2VLImageProcessor, which Qwen3.5's
processor uses); it returns `pixel_values` [sum(t*h*w), C*Tp*P*P] and `image_grid_thw`. Each
image's single `<|image_pad|>` placeholder in the prompt (inside `<|vision_start|> ...
<|vision_end|>`, as the chat template writes an image part) is expanded to t*h*w / merge^2
copies, as HF's processor does, and the M-RoPE positions are computed as HF's
`Qwen3_5Model.get_rope_index` does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from deltaserve.multimodal.inputs import ImageItem, MultiModalRecord

# Qwen3.5's released preprocessor_config.json (for random-weight models without files)
QWEN3_5_IMAGE_PROCESSOR = dict(
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    size={"shortest_edge": 65536, "longest_edge": 16777216},
)


def load_image_processor(path: str | None, vision_config) -> Any:
    """The checkpoint's transformers image processor (or Qwen3.5's settings for `path` None,
    with the vision config's patch and merge sizes)."""
    import transformers

    if path is None:
        kwargs = dict(QWEN3_5_IMAGE_PROCESSOR)
        kwargs.update(
            patch_size=vision_config.patch_size,
            temporal_patch_size=vision_config.temporal_patch_size,
            merge_size=vision_config.spatial_merge_size,
        )
        return transformers.Qwen2VLImageProcessor(**kwargs)
    file = Path(path) / "preprocessor_config.json"
    if not file.is_file():
        raise ValueError(f"image input needs {file} (the checkpoint's image processor config)")
    name = str(json.loads(file.read_text()).get("image_processor_type", ""))
    # NOTE: the "Fast" variants need torchvision; the plain class picks what is installed
    cls = getattr(transformers, name.removesuffix("Fast"), None)
    if cls is None:
        raise ValueError(f"{file}: unknown image_processor_type {name!r}")
    return cls.from_pretrained(str(path))


def image_hash(pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> str:
    """A content hash of one preprocessed image (its patches and grid)."""
    h = hashlib.sha256(repr(grid).encode())
    h.update(pixel_values.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def mrope_positions(ids: list[int], items: list[ImageItem], merge: int) -> tuple[torch.Tensor, int]:
    """([3, len(ids)] positions, delta) as HF's get_rope_index: text tokens advance all three
    axes together; an image of merged grid (t, h', w') starting at position s takes temporal
    s, heights s + row and widths s + column, and the text after it continues at
    s + max(h', w'). delta = max position + 1 - len(ids)."""
    pos = torch.empty(3, len(ids), dtype=torch.int64)
    cur, i = 0, 0
    for item in sorted(items, key=lambda it: it.offset):
        n = item.offset - i
        pos[:, i : item.offset] = torch.arange(cur, cur + n)
        cur += n
        t, h, w = item.grid_thw
        h, w = h // merge, w // merge
        tt = torch.arange(t).view(t, 1, 1).expand(t, h, w).reshape(-1)
        hh = torch.arange(h).view(1, h, 1).expand(t, h, w).reshape(-1)
        ww = torch.arange(w).view(1, 1, w).expand(t, h, w).reshape(-1)
        pos[0, item.offset : item.end] = cur + tt
        pos[1, item.offset : item.end] = cur + hh
        pos[2, item.offset : item.end] = cur + ww
        cur += max(h, w)
        i = item.end
    pos[:, i:] = torch.arange(cur, cur + len(ids) - i)
    delta = int(pos.max()) + 1 - len(ids) if len(ids) else 0
    return pos, delta


class ImageInputProcessor:
    """Turns (prompt ids with one placeholder per image, images) into the expanded ids and the
    request's `MultiModalRecord`; ValueError names what is wrong."""

    def __init__(self, image_processor: Any, hf_config, max_images: int) -> None:
        self.image_processor = image_processor
        self.image_token_id = int(hf_config.image_token_id)
        self.merge = int(hf_config.vision_config.spatial_merge_size)
        self.max_images = max_images

    def check_no_placeholders(self, ids: list[int]) -> None:
        """A prompt without images must not carry image placeholders (ValueError)."""
        n = sum(1 for t in ids if t == self.image_token_id)
        if n:
            raise ValueError(
                f"the prompt has {n} image placeholder(s) (<|image_pad|>, token "
                f"{self.image_token_id}) but no images were given (multi_modal_data)"
            )

    def process(self, ids: list[int], images: Any) -> tuple[list[int], MultiModalRecord]:
        from PIL import Image

        if not isinstance(images, (list, tuple)):
            images = [images]
        bad = [type(im).__name__ for im in images if not isinstance(im, Image.Image)]
        if bad:
            raise ValueError(f"multi_modal_data images must be PIL images, got {', '.join(bad)}")
        if len(images) > self.max_images:
            raise ValueError(
                f"{len(images)} images in one prompt exceed limit_mm_per_prompt image="
                f"{self.max_images}"
            )
        where = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(where) != len(images):
            raise ValueError(
                f"the prompt has {len(where)} image placeholder(s) (<|image_pad|>, token "
                f"{self.image_token_id}) but {len(images)} image(s) were given: write one "
                "placeholder per image, as the chat template does"
            )
        if not images:
            raise ValueError("multi_modal_data has no images")
        try:
            out = self.image_processor(images=list(images), return_tensors="pt")
        except Exception as e:  # a PIL image the processor cannot take (mode, size)
            raise ValueError(f"image preprocessing failed: {type(e).__name__}: {e}") from e
        pixels = out["pixel_values"].to(torch.float32)
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"].tolist()]
        new_ids: list[int] = []
        items: list[ImageItem] = []
        prev, row = 0, 0
        for at, grid in zip(where, grids, strict=True):
            n_patches = grid[0] * grid[1] * grid[2]
            pv = pixels[row : row + n_patches]
            row += n_patches
            num = n_patches // (self.merge * self.merge)
            new_ids.extend(ids[prev:at])
            items.append(ImageItem(pv, grid, image_hash(pv, grid), len(new_ids), num))
            new_ids.extend([self.image_token_id] * num)
            prev = at + 1
        new_ids.extend(ids[prev:])
        positions, delta = mrope_positions(new_ids, items, self.merge)
        return new_ids, MultiModalRecord(items, positions, delta)
