"""`deltaserve serve` start-up, run as a user runs it (a subprocess): a bad or busy port and an
empty API key fail at once, before the model loads, in one line and without a traceback;
DELTASERVE_API_KEY stands in for --api-key."""

from __future__ import annotations

import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _serve(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "deltaserve.cli", "serve", *args]


def _run(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DELTASERVE_API_KEY"}
    env.update(env_extra or {})
    return subprocess.run(
        _serve(args), cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def _assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("deltaserve serve: error: "), lines[0]
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# A model directory that does not exist: had the model been looked at first, the error would
# name it instead of the flag at fault.
def _missing_model(tmp_path: Path) -> list[str]:
    return ["--model", str(tmp_path / "no-such-model")]


@pytest.mark.parametrize("port", ["99999", "-1", "65536"])
def test_port_out_of_range(tmp_path, port):
    _assert_one_line_error(_run([*_missing_model(tmp_path), "--port", port]), f"--port {port}")


def test_port_in_use(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _run([*_missing_model(tmp_path), "--host", "127.0.0.1", "--port", str(port)])
    _assert_one_line_error(result, f"127.0.0.1:{port}", "in use", "--port")


def test_empty_api_key_is_refused(tmp_path):
    _assert_one_line_error(_run([*_missing_model(tmp_path), "--api-key", ""]), "--api-key")


def test_empty_api_key_variable_is_refused(tmp_path):
    result = _run(_missing_model(tmp_path), {"DELTASERVE_API_KEY": ""})
    _assert_one_line_error(result, "DELTASERVE_API_KEY")


def test_api_key_from_the_environment(deltaserve_cache_dir):
    """A real `deltaserve serve` (demo model, CPU, any free port) with DELTASERVE_API_KEY set
    and no --api-key: /v1/* need that key, /health does not."""
    env = {**os.environ, "DELTASERVE_API_KEY": "from-env"}
    args = ["--device", "cpu", "--max-model-len", "128", "--max-num-seqs", "4", "--port", "0"]
    proc = subprocess.Popen(
        _serve(args),
        cwd=REPO_ROOT,
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        url, seen, deadline = None, [], time.monotonic() + 240
        while url is None:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert line is not None, "serve exited before it listened:\n" + "".join(seen)
            seen.append(line)
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        # both processes froze their start-up heap out of garbage collection (server/heap.py)
        log = "".join(seen)
        for role in ("engine process", "server"):
            m = re.search(rf"{role}: (\d+) start-up objects frozen out of garbage collection", log)
            assert m and int(m.group(1)) > 10_000, log
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
        wrong = {"Authorization": "Bearer wrong"}
        assert httpx.get(f"{url}/v1/models", headers=wrong, timeout=30).status_code == 401
        right = {"Authorization": "Bearer from-env"}
        assert httpx.get(f"{url}/v1/models", headers=right, timeout=30).status_code == 200
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def test_image_flags_make_the_media_config(tmp_path):
    from deltaserve import cli
    from deltaserve.multimodal.media import MediaConfig
    from deltaserve.server.cli import media_config

    argv = ["serve", "--allowed-local-media-path", str(tmp_path), "--media-fetch-timeout", "2.5"]
    argv += ["--max-image-bytes", "1000", "--max-image-pixels", "64"]
    argv += ["--allowed-media-domains", "a.example", "B.example"]
    assert media_config(cli.build_parser().parse_args(argv)) == MediaConfig(
        allowed_local_media_path=str(tmp_path.resolve()),
        fetch_timeout=2.5,
        max_image_bytes=1000,
        max_image_pixels=64,
        allowed_media_domains=("a.example", "b.example"),
    )
    assert media_config(cli.build_parser().parse_args(["serve"])) == MediaConfig()


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--allowed-local-media-path", "/no/such/dir"], "'/no/such/dir' does not exist"),
        (["--media-fetch-timeout", "0"], "timeout must be > 0"),
        (["--max-image-bytes", "0"], "max_image_bytes must be >= 1"),
    ],
)
def test_bad_image_flags_fail_before_the_model_loads(tmp_path, flags, needle):
    result = _run([*_missing_model(tmp_path), *flags])
    _assert_one_line_error(result, "bad image flag", needle)
