"""Read a checkpoint's files with errors that name the file: JSON files (config.json,
generation_config.json, the safetensors index, tokenizer files) and safetensors headers.

A damaged file fails start-up with one line, `<file> is truncated or corrupt (<why>)` or
`<file> is not valid JSON (<why>)`, as a `CheckpointFileError` (a ValueError, so the command
line prints it without a traceback).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# safetensors refuses headers above 100 MB; a larger length is a corrupt file
_MAX_HEADER_BYTES = 100_000_000


class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be read (its path and the reason in the message)."""


def one_line(error: BaseException | str) -> str:
    """An exception's message on one line (the first non-empty line, whitespace collapsed)."""
    text = str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = " ".join(lines[0].split()) if lines else type(error).__name__
    return first + (" ..." if len(lines) > 1 else "")


def read_json(path: str | Path) -> dict[str, Any]:
    """The JSON object in `path`; raises CheckpointFileError naming the file when it is not
    readable, not JSON (a truncated download) or not an object."""
    path = Path(path)
    try:
        raw = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointFileError(f"cannot read {path} ({one_line(e)})") from e
    except json.JSONDecodeError as e:
        if path.stat().st_size == 0:
            raise CheckpointFileError(f"{path} is empty (0 bytes; an interrupted copy?)") from e
        raise CheckpointFileError(f"{path} is truncated or not valid JSON ({one_line(e)})") from e
    if not isinstance(raw, dict):
        raise CheckpointFileError(
            f"{path} is not valid (expected a JSON object, found {type(raw).__name__})"
        )
    return raw


def safetensors_tensor_names(path: str | Path) -> list[str]:
    """The tensor names in a safetensors file's header, after checking that the file holds
    exactly the bytes its header describes (reads the header only: cheap on any size).

    Raises CheckpointFileError `<file> is truncated or corrupt (<why>)`."""
    path = Path(path)

    def corrupt(why: str) -> CheckpointFileError:
        return CheckpointFileError(f"{path} is truncated or corrupt ({why})")

    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            if size < 8:
                raise corrupt(f"{size} bytes, less than the 8-byte header length")
            header_len = int.from_bytes(f.read(8), "little")
            if header_len > _MAX_HEADER_BYTES:
                raise corrupt(f"header length {header_len} bytes is not plausible")
            if 8 + header_len > size:
                raise corrupt(f"the header needs {8 + header_len} bytes, the file has {size}")
            header_bytes = f.read(header_len)
    except OSError as e:
        raise CheckpointFileError(f"cannot read {path} ({one_line(e)})") from e
    try:
        header = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise corrupt(f"header is not valid JSON: {one_line(e)}") from e
    if not isinstance(header, dict):
        raise corrupt("header is not a JSON object")
    names = [name for name in header if name != "__metadata__"]
    try:
        data_end = max((int(header[n]["data_offsets"][1]) for n in names), default=0)
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise corrupt(f"header entry without valid data_offsets: {one_line(e)}") from e
    expected = 8 + header_len + data_end
    if expected > size:
        raise corrupt(f"the header describes {expected} bytes, the file has {size}")
    if expected < size:
        raise corrupt(f"{size - expected} bytes past the end of the tensor data")
    return names


def check_checkpoint_files(path: str | Path) -> None:
    """Read the headers of a checkpoint directory's small files before anything is loaded: the
    JSON files the engine reads (generation_config.json, the safetensors index) and every
    safetensors header present. A truncated or corrupt one raises CheckpointFileError naming
    it; absent files are left to the loaders to report."""
    path = Path(path)
    for name in ("generation_config.json", "model.safetensors.index.json"):
        if (path / name).is_file():
            read_json(path / name)
    for file in sorted(path.glob("*.safetensors")):
        safetensors_tensor_names(file)
