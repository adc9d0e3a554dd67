"""Read a checkpoint's config.json through transformers' config classes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deltaserve.models.registry import (
    architecture_for_model_type,
    supported_architectures,
)


def load_hf_config(path: str | Path) -> tuple[Any, Any, str]:
    """Returns (config, text_config, architecture) for a local checkpoint directory.

    Raises ValueError for a missing config.json or an unsupported architecture (listing the
    supported ones) before any weight is read.
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"no config.json in {path}")
    raw = json.loads(cfg_file.read_text())
    archs = raw.get("architectures") or []
    supported = supported_architectures()
    arch = next((a for a in archs if a in supported), None)
    if arch is None and not archs:
        arch = architecture_for_model_type(raw.get("model_type", ""))
    if arch is None:
        named = ", ".join(archs) if archs else f"model_type {raw.get('model_type')!r}"
        raise ValueError(f"unsupported architecture {named}; supported: " + ", ".join(supported))

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return config, text_config, arch
