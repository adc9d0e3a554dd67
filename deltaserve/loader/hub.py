"""Where a model argument points: a local directory, or a Hugging Face Hub id (`org/name`)
already in the local Hugging Face cache. Nothing is ever downloaded (as vLLM with
HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from deltaserve.logger import get_logger

logger = get_logger(__name__)
# org/name as the Hub spells repository ids (letters, digits, "-", "_", "."; no "--" or "..")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]$")


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment now (huggingface_hub's rules):
    HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    hf_home = os.environ.get("HF_HOME")
    if not hf_home:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        hf_home = os.path.join(xdg, "huggingface")
    return Path(hf_home).expanduser() / "hub"


def is_hub_id(model: str) -> bool:
    """True for a string shaped like a Hub repository id (`org/name`)."""
    return bool(_HUB_ID.match(model)) and "--" not in model and ".." not in model


def cached_snapshot(repo_id: str, cache_dir: Path | None = None) -> Path | None:
    """The local snapshot directory of `repo_id` in the Hugging Face cache (the revision that
    refs/main points to), or None when it is not there. Never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(
            repo_id, cache_dir=str(cache_dir or hf_hub_cache()), local_files_only=True
        )
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None
    return Path(folder) if Path(folder).is_dir() else None


def resolve_model_path(model: str | Path, what: str = "model") -> Path:
    """The local directory for `model`: the directory itself, or the cached snapshot of a Hub
    id. Raises ValueError on one line saying where the files are expected."""
    if not str(model).strip():
        raise ValueError(f"{what} directory not found: {str(model)!r} (an empty path)")
    path = Path(model)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{what} directory not found: {model} (it is a file; pass its directory)")
    text = str(model)
    if not is_hub_id(text):
        raise ValueError(f"{what} directory not found: {model}")
    cache = hf_hub_cache()
    snapshot = cached_snapshot(text, cache)
    if snapshot is not None:
        logger.info("%s %s: the Hugging Face cache's snapshot %s", what, text, snapshot)
        return snapshot
    cache_entry = cache / ("models--" + text.replace("/", "--"))
    raise ValueError(
        f"{what} directory not found: {model} (not a local directory, and the Hugging Face Hub "
        f"id is not in the local cache {cache_entry}; deltaserve does not download: put the "
        f"files in a local directory and pass its path, or fetch them first, e.g. "
        f"`hf download {text}`, with HF_HOME / HF_HUB_CACHE pointing at the cache used here)"
    )
