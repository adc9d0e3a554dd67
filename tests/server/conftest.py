"""A real deltaserve server on 127.0.0.1 (free port, background thread), serving the demo model
on CPU; shared by the server tests of the session."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

API_KEY = "test-key"
MODEL = "demo"
MAX_MODEL_LEN = 512


@dataclass
class RunningServer:
    url: str
    api_key: str | None
    app: object
    server: object
    thread: threading.Thread

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample name with labels: value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        values = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                values[m.group(1)] = float(m.group(2))
        return values

    def wait_idle(self, timeout: float = 120.0) -> dict[str, float]:
        """Poll /metrics until nothing is running or waiting; return the last metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["deltaserve_num_requests_running"] == 0
            if idle and m["deltaserve_num_requests_waiting"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy after {timeout} s: {m}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the server did not shut down"


def start_server(
    *,
    api_key: str | None = API_KEY,
    max_waiting: int = 1024,
    max_request_bytes: int | None = None,
    media=None,
    model: str | None = None,
    engine_process: bool = False,
    **engine_kwargs,
) -> RunningServer:
    """A server of `model` (default: the demo model) with `media` (a MediaConfig: where chat
    images may come from; default: the server's); `engine_process`: the engine runs in its own
    process (as `deltaserve serve` runs it), else in a thread of this one."""
    import uvicorn

    from deltaserve.config import create_engine_config
    from deltaserve.engine.llm_engine import LLMEngine
    from deltaserve.loader.demo import ensure_demo_model
    from deltaserve.server.app import build_app

    engine_kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    engine_kwargs.setdefault("device", "cpu")
    model = model or str(ensure_demo_model())
    config = create_engine_config(model, seed=0, **engine_kwargs)
    limits = {} if max_request_bytes is None else {"max_request_bytes": max_request_bytes}
    if media is not None:
        limits["media"] = media
    if engine_process:
        from deltaserve.server.engine_client import EngineProcessClient

        engine = EngineProcessClient(config)
    else:
        engine = LLMEngine(config)
    app = build_app(engine, model_names=[MODEL], api_key=api_key, max_waiting=max_waiting, **limits)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return RunningServer(f"http://127.0.0.1:{port}", api_key, app, server, thread)


@pytest.fixture(scope="session")
def server(deltaserve_cache_dir) -> Iterator[RunningServer]:
    # overlapped decode on, as on a GPU (the CPU default is off), and the engine in its own
    # process, as `deltaserve serve` runs it: every test of this server runs both
    running = start_server(async_scheduling=True, engine_process=True)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def client(server: RunningServer):
    import openai

    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c
