"""Read a checkpoint's config.json through transformers' config classes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltaserve.loader.files import CheckpointFileError, one_line, read_json
from deltaserve.loader.hub import resolve_model_path
from deltaserve.models.registry import (
    architecture_for_model_type,
    supported_architectures,
)


def load_hf_config(path: str | Path) -> tuple[Any, Any, str]:
    """Returns (config, text_config, architecture) for a local checkpoint directory (or a Hub
    id in the local Hugging Face cache, see deltaserve.loader.hub).

    Raises ValueError for a missing, truncated or invalid config.json (naming it) or an
    unsupported architecture (listing the supported ones) before any weight is read.
    """
    path = resolve_model_path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"no config.json in {path}")
    raw = read_json(cfg_file)
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        raise CheckpointFileError(f"{cfg_file} is not valid (architectures is not a list)")
    supported = supported_architectures()
    arch = next((a for a in archs if a in supported), None)
    if arch is None and not archs:
        arch = architecture_for_model_type(raw.get("model_type", ""))
    if arch is None:
        named = ", ".join(archs) if archs else f"model_type {raw.get('model_type')!r}"
        raise ValueError(f"unsupported architecture {named}; supported: " + ", ".join(supported))

    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=False
        )
    except Exception as e:  # transformers raises several types for a config it cannot read
        raise CheckpointFileError(
            f"{cfg_file} is not a valid {arch} config ({type(e).__name__}: {one_line(e)})"
        ) from e
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return config, text_config, arch
