"""Damaged checkpoint files fail with one line naming the file; tokenizer files are required."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deltaserve.loader.demo import ensure_demo_model
from deltaserve.loader.files import (
    CheckpointFileError,
    check_checkpoint_files,
    read_json,
    safetensors_tensor_names,
)
from deltaserve.loader.tokenizer import eos_token_ids, has_tokenizer_files, load_tokenizer
from deltaserve.loader.weights import checkpoint_files, iter_checkpoint


@pytest.fixture
def st_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(4, 4), "b": torch.ones(3)}, str(path))
    return path


def _one_line_naming(error: pytest.ExceptionInfo, path: Path, words: str) -> None:
    message = str(error.value)
    assert "\n" not in message
    assert str(path) in message and words in message


def test_intact_safetensors_lists_its_tensors(st_file: Path) -> None:
    assert sorted(safetensors_tensor_names(st_file)) == ["a", "b"]
    assert checkpoint_files(st_file.parent) == [st_file]


@pytest.mark.parametrize("keep", [0, 5, 40, -1])
def test_truncated_safetensors_named_before_loading(st_file: Path, keep: int) -> None:
    data = st_file.read_bytes()
    st_file.write_bytes(data[:keep] if keep >= 0 else data[: len(data) - 1])
    with pytest.raises(CheckpointFileError) as error:
        checkpoint_files(st_file.parent)
    _one_line_naming(error, st_file, "is truncated or corrupt")
    with pytest.raises(CheckpointFileError):
        check_checkpoint_files(st_file.parent)


def test_trailing_bytes_and_garbage_header(st_file: Path) -> None:
    st_file.write_bytes(st_file.read_bytes() + b"xx")
    with pytest.raises(CheckpointFileError, match="2 bytes past the end"):
        safetensors_tensor_names(st_file)
    st_file.write_bytes((10).to_bytes(8, "little") + b"not json!!" + b"\0" * 16)
    with pytest.raises(CheckpointFileError, match="header is not valid JSON"):
        safetensors_tensor_names(st_file)
    st_file.write_bytes((1 << 60).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointFileError, match="not plausible"):
        safetensors_tensor_names(st_file)


def test_damaged_tensor_data_named_while_reading(st_file: Path) -> None:
    """A header that passes the size check but describes bad data: safetensors' own error is
    wrapped with the file's name."""
    data = bytearray(st_file.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    header["a"]["shape"] = [4, 5]  # 80 bytes of data, the offsets span 64
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(header_len)
    assert len(raw) == header_len
    data[8 : 8 + header_len] = raw
    st_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointFileError) as error:
        list(iter_checkpoint(st_file.parent))
    _one_line_naming(error, st_file, "is truncated or corrupt")


@pytest.mark.parametrize(
    "content, words",
    [
        ("", "is empty"),
        ('{"a": ', "is truncated or not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_read_json_names_the_file(tmp_path: Path, content: str, words: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(CheckpointFileError) as error:
        read_json(path)
    _one_line_naming(error, path, words)


def test_truncated_index_named(st_file: Path) -> None:
    index = st_file.parent / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": "model.safe')
    with pytest.raises(CheckpointFileError) as error:
        checkpoint_files(st_file.parent)
    _one_line_naming(error, index, "is truncated or not valid JSON")


def test_truncated_generation_config_named(tmp_path: Path) -> None:
    gen = tmp_path / "generation_config.json"
    gen.write_text('{"eos_token_id": [1, ')
    with pytest.raises(CheckpointFileError) as error:
        check_checkpoint_files(tmp_path)
    _one_line_naming(error, gen, "is truncated or not valid JSON")
    gen.write_text('{"eos_token_id": "end"}')
    with pytest.raises(CheckpointFileError, match="eos_token_id 'end'"):
        eos_token_ids(tmp_path, None, None)


# --- tokenizer files -----------------------------------------------------------------------------


@pytest.fixture
def demo_copy(tmp_path: Path) -> Path:
    path = tmp_path / "demo"
    shutil.copytree(ensure_demo_model(), path)
    return path


@pytest.mark.parametrize(
    "files, expected",
    [
        ([], False),
        (["tokenizer_config.json"], False),  # a config without a vocabulary is no tokenizer
        (["vocab.json"], False),  # BPE needs its merges
        (["vocab.json", "merges.txt"], True),
        (["tokenizer.json"], True),
        (["tokenizer.model"], True),
        (["qwen.tiktoken"], True),
    ],
)
def test_what_counts_as_tokenizer_files(tmp_path: Path, files: list[str], expected: bool) -> None:
    for name in files:
        (tmp_path / name).write_text("{}")
    assert has_tokenizer_files(tmp_path) is expected


def test_no_tokenizer_files_fails_naming_the_directory(demo_copy: Path) -> None:
    assert len(load_tokenizer(demo_copy)) > 1
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (demo_copy / name).unlink()
    with pytest.raises(ValueError) as error:
        load_tokenizer(demo_copy)
    _one_line_naming(error, demo_copy, "no tokenizer files in")
    assert "skip_tokenizer_init=True" in str(error.value)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_truncated_tokenizer_file_named(demo_copy: Path, name: str) -> None:
    path = demo_copy / name
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointFileError) as error:
        load_tokenizer(demo_copy)
    _one_line_naming(error, path, "is truncated or not valid JSON")
