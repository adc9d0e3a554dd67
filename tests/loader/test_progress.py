"""The weight-loading progress bar: shown on a terminal, quiet in tests, CI and pipes."""

from __future__ import annotations

import io
import sys

import pytest

from deltaserve import LLM
from deltaserve.loader import progress
from deltaserve.loader.demo import ensure_demo_model


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    "tty, level, shown",
    [(True, "INFO", True), (True, "DEBUG", True), (True, "WARNING", False), (False, "INFO", False)],
)
def test_progress_enabled(
    monkeypatch: pytest.MonkeyPatch, tty: bool, level: str, shown: bool
) -> None:
    monkeypatch.setattr(sys, "stderr", _Terminal() if tty else io.StringIO())
    monkeypatch.setenv("DELTASERVE_LOG_LEVEL", level)
    assert progress.progress_enabled() is shown


def test_loading_weights_shows_a_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(ensure_demo_model())
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setenv("DELTASERVE_LOG_LEVEL", "INFO")
    LLM(path, device="cpu", max_model_len=64)
    text = terminal.getvalue()
    assert "loading weights (1 shard)" in text and "tensor" in text
    quiet = io.StringIO()  # not a terminal: nothing
    monkeypatch.setattr(sys, "stderr", quiet)
    llm = LLM(path, device="cpu", max_model_len=64)
    assert "loading weights" not in quiet.getvalue()

    # LLM.generate / LLM.chat show vLLM's "Processed prompts" bar unless use_tqdm=False
    llm.generate(["a", "b"])
    assert "Processed prompts" in quiet.getvalue()
    quiet.seek(0), quiet.truncate()
    llm.chat([{"role": "user", "content": "hi"}])
    assert "Processed prompts" in quiet.getvalue()
    quiet.seek(0), quiet.truncate()
    llm.generate(["a"], use_tqdm=False)
    assert "Processed prompts" not in quiet.getvalue()
