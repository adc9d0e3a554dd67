"""`limit_mm_per_prompt` (vLLM's option) and whether a run takes images at all.

NOTE: no torch import here (the CLI imports this to check its flag)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEFAULT_IMAGE_LIMIT = 999  # images per prompt when limit_mm_per_prompt does not say


def parse_limit_mm_per_prompt(value: Any) -> dict[str, int]:
    """{"image": N} from a dict, a JSON object string ('{"image": 2}') or vLLM's CLI syntax
    ("image=2", "image=2,video=0"); None gives the default. ValueError names what is wrong.
    Video input is not supported: a video limit must be 0."""
    if value is None:
        return {"image": DEFAULT_IMAGE_LIMIT}
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"limit_mm_per_prompt: invalid JSON {value!r} ({e})") from e
        else:
            parsed: dict[str, Any] = {}
            for part in filter(None, (p.strip() for p in text.split(","))):
                key, eq, num = part.partition("=")
                if not eq:
                    raise ValueError(
                        f"limit_mm_per_prompt: expected MODALITY=N (e.g. image=2), got {part!r}"
                    )
                parsed[key.strip()] = num.strip()
            value = parsed
    if not isinstance(value, dict):
        raise ValueError(f"limit_mm_per_prompt must map modality -> count, got {value!r}")
    limits = {"image": DEFAULT_IMAGE_LIMIT}
    for key, num in value.items():
        try:
            n = int(num)
        except (TypeError, ValueError):
            raise ValueError(f"limit_mm_per_prompt: {key}={num!r} is not an integer") from None
        if n < 0:
            raise ValueError(f"limit_mm_per_prompt: {key}={n} must be >= 0")
        if key == "video":
            if n:
                raise ValueError("limit_mm_per_prompt: video input is not supported (video=0)")
            continue
        if key != "image":
            raise ValueError(f"limit_mm_per_prompt: unknown modality {key!r} (image)")
        limits["image"] = n
    return limits


def no_image_reason(config) -> str | None:
    """Why this engine takes no images (None: it does). `config` is an EngineConfig."""
    mc = config.model
    if getattr(mc.hf_config, "vision_config", None) is None or not hasattr(
        mc.hf_config, "image_token_id"
    ):
        return f"the model ({mc.architecture}) has no vision tower: it takes text only"
    if config.limit_mm_per_prompt.get("image", 0) == 0:
        return "images are disabled (limit_mm_per_prompt image=0)"
    if mc.random_model is None and not (Path(mc.path) / "preprocessor_config.json").is_file():
        return "the checkpoint has no preprocessor_config.json (its image processor settings)"
    if config.tensor_parallel_size > 1:
        return "image input is not supported with tensor parallelism yet"
    if config.speculative is not None:
        return "image input cannot be combined with speculative decoding yet"
    return None
