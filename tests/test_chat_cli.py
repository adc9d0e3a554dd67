"""`deltaserve chat` as a user runs it: a real process on the demo model, over a pipe and over a
terminal (pty)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CHAT = [sys.executable, "-m", "deltaserve", "chat", "--device", "cpu", "--max-tokens", "2"]


def test_a_turn_past_max_model_len_is_dropped_and_the_session_goes_on() -> None:
    long_message = " ".join(["word"] * 200)
    stdin = f"Hi\n{long_message}\nAgain\n"
    result = subprocess.run(
        [*CHAT, "--max-model-len", "64"],
        cwd=REPO_ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1
    assert errors[0].startswith("deltaserve chat: error: the prompt (")
    assert errors[0].endswith("(message dropped; the conversation so far is kept)")
    assert "max_model_len=64" in errors[0]
    assert "Traceback" not in result.stderr
    assert len(result.stdout.splitlines()) == 2  # the answers to "Hi" and "Again"


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_terminal_input_is_edited_with_readline() -> None:
    """On a terminal, arrow keys edit the line: "/eit", two Left arrows, "x" is "/exit"."""
    import pty

    leader, follower = pty.openpty()
    env = {**os.environ, "TERM": "xterm"}
    proc = subprocess.Popen(
        CHAT, cwd=REPO_ROOT, stdin=follower, stdout=follower, stderr=follower, env=env
    )
    os.close(follower)
    seen = b""
    try:
        deadline = time.monotonic() + 300
        while b">>> " not in seen and time.monotonic() < deadline:  # the model is loaded
            seen += _read(leader, deadline)
            assert proc.poll() is None, seen.decode(errors="replace")
        os.write(leader, b"/eit\x1b[D\x1b[Dx\r")
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            seen += _read(leader, min(deadline, time.monotonic() + 1))
        assert proc.poll() == 0, seen.decode(errors="replace")  # /exit: no EOF was sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)


def _read(fd: int, deadline: float) -> bytes:
    ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
    if not ready:
        return b""
    try:
        return os.read(fd, 4096)
    except OSError:  # the child closed the terminal
        return b""
