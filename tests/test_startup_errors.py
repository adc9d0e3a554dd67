"""Start-up failures a user meets first: one line `error: ...` naming the file, exit status 1, no
traceback, from `generate`, `serve` and `LLM()`; Hub ids from the local Hugging Face cache."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deltaserve import LLM
from deltaserve.loader.demo import ensure_demo_model
from deltaserve.loader.files import CheckpointFileError

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A private copy of the demo checkpoint, free to damage."""
    path = tmp_path / "models" / "x"
    shutil.copytree(ensure_demo_model(), path)
    return path


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deltaserve(args: list[str], cwd: Path, env: dict[str, str] | None = None):
    """Run the real command; returns the CompletedProcess (text, bounded in time)."""
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "deltaserve.cli", *args],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _error_line(proc: subprocess.CompletedProcess, command: str) -> str:
    """The one error line of a failed run (and no traceback)."""
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"deltaserve {command}: error: ")
    return lines[0]


def test_truncated_safetensors_from_generate_and_serve(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    _truncate(weights, weights.stat().st_size // 2)
    cwd = model_dir.parents[1]  # the user types a relative path: the message repeats it
    proc = _deltaserve(["generate", "hi", "--model", "models/x", "--device", "cpu"], cwd)
    line = _error_line(proc, "generate")
    assert "error: models/x/model.safetensors is truncated or corrupt (" in line
    port = str(_free_port())
    proc = _deltaserve(["serve", "--model", "models/x", "--device", "cpu", "--port", port], cwd)
    assert "models/x/model.safetensors is truncated or corrupt" in _error_line(proc, "serve")


def test_truncated_config_json_from_generate(model_dir: Path) -> None:
    config = model_dir / "config.json"
    _truncate(config, 20)
    proc = _deltaserve(["generate", "hi", "--model", str(model_dir)], model_dir)
    line = _error_line(proc, "generate")
    assert f"error: {config} is truncated or not valid JSON (Expecting value: line 2" in line


def test_checkpoint_without_tokenizer_fails_at_start_up(model_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).unlink()
    proc = _deltaserve(["generate", "hi", "--model", str(model_dir), "--device", "cpu"], model_dir)
    line = _error_line(proc, "generate")
    assert f"no tokenizer files in {model_dir} (" in line
    assert "loaded" not in proc.stderr  # before any weight is read
    # with skip_tokenizer_init the same checkpoint serves token ids
    llm = LLM(str(model_dir), device="cpu", max_model_len=64, skip_tokenizer_init=True)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda d: _truncate(d / "model.safetensors", 1000), "model.safetensors"),
        (lambda d: _truncate(d / "generation_config.json", 10), "generation_config.json"),
        (lambda d: _truncate(d / "tokenizer.json", 300), "tokenizer.json"),
        (lambda d: _truncate(d / "tokenizer_config.json", 300), "tokenizer_config.json"),
    ],
    ids=["weights", "generation_config", "tokenizer", "tokenizer_config"],
)
def test_llm_names_the_damaged_file(model_dir: Path, damage, named: str) -> None:
    damage(model_dir)
    with pytest.raises(CheckpointFileError) as error:
        LLM(str(model_dir), device="cpu", max_model_len=64)
    assert isinstance(error.value, ValueError)
    message = str(error.value)
    assert "\n" not in message and message.startswith(str(model_dir / named))


def _hub_cache(root: Path, repo_id: str, source: Path) -> Path:
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    shutil.copytree(source, repo / "snapshots" / "abc123")
    return repo / "snapshots" / "abc123"


def test_hub_id_from_the_local_cache(tmp_path: Path) -> None:
    hub = tmp_path / "hf-home" / "hub"
    _hub_cache(hub, "tiny-org/tiny-demo", ensure_demo_model())
    args = ["generate", "hi", "--model", "tiny-org/tiny-demo", "--device", "cpu"]
    proc = _deltaserve([*args, "--max-tokens", "2"], tmp_path, {"HF_HOME": str(hub.parent)})
    assert proc.returncode == 0, proc.stderr
    assert "snapshots/abc123" in proc.stderr
    other = {"HF_HOME": str(tmp_path / "empty"), "HF_HUB_CACHE": ""}
    proc = _deltaserve(args, tmp_path, other)
    line = _error_line(proc, "generate")
    assert "model directory not found: tiny-org/tiny-demo (" in line
    assert "does not download" in line and str(tmp_path / "empty" / "hub") in line
