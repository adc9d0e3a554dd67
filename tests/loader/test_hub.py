"""Hub ids resolve to the local Hugging Face cache only (never a download)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltaserve.loader.hub import hf_hub_cache, is_hub_id, resolve_model_path


def fake_cache(root: Path, repo_id: str, revision: str = "0123abcd") -> Path:
    """The Hugging Face cache layout for one repository: returns the snapshot directory."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    (snapshot / "config.json").write_text("{}")
    return snapshot


@pytest.fixture
def no_hf_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Qwen/Qwen3-0.6B", True),
        ("org/name_v2.1", True),
        ("models/tiny-qwen3/", False),
        ("/abs/dir", False),
        ("./rel", False),
        ("a/b/c", False),
        ("org--x/name", False),
        ("tiny", False),
    ],
)
def test_hub_id_shape(text: str, expected: bool) -> None:
    assert is_hub_id(text) is expected


def test_cache_location_follows_the_environment(
    no_hf_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert hf_hub_cache() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hf_hub_cache() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hf_hub_cache() == tmp_path / "c"


def test_hub_id_resolves_to_the_cached_snapshot(
    no_hf_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    snapshot = fake_cache(tmp_path / "hub", "Org/Tiny-1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_path("Org/Tiny-1") == snapshot
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # $HF_HOME/hub
    assert resolve_model_path("Org/Tiny-1") == snapshot


def test_local_directory_wins_over_a_hub_id(
    no_hf_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_cache(tmp_path / "hub", "org/x")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "org" / "x").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/x") == Path("org/x")


def test_uncached_hub_id_says_where_to_put_the_files(
    no_hf_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError) as error:
        resolve_model_path("Qwen/Qwen3-0.6B")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("model directory not found: Qwen/Qwen3-0.6B (")
    assert "does not download" in message
    assert str(tmp_path / "hub" / "models--Qwen--Qwen3-0.6B") in message


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="an empty path"):
        resolve_model_path("")  # an unset variable, not the current directory
    with pytest.raises(ValueError, match="model directory not found: .*nope$"):
        resolve_model_path(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="it is a file"):
        resolve_model_path(tmp_path / "config.json")
