"""The engine in its own process (deltaserve/server/engine_client.py): a start-up failure is
reported with the engine's own error, a dead engine process fails running requests and turns
/health to 503, shutdown leaves no process behind; the engine loop sends light outputs between
a request's first and last update. (The session server of tests/server/conftest.py runs the
engine in its own process, so every server test also covers the transport.)"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from conftest import MODEL, start_server

from deltaserve.outputs import CompletionOutput, RequestOutput
from deltaserve.sampling_params import SamplingParams
from deltaserve.server.engine_loop import EngineBatch, EngineLoop, Failure, RequestUpdate


def test_start_up_failure_names_the_engine_error(deltaserve_cache_dir):
    from deltaserve.config import create_engine_config
    from deltaserve.loader.demo import ensure_demo_model
    from deltaserve.server.engine_client import EngineProcessClient

    config = create_engine_config(
        str(ensure_demo_model()), device="cpu", attention_backend="triton", max_model_len=256
    )
    with pytest.raises(RuntimeError, match="attention backend 'triton' cannot serve this model"):
        EngineProcessClient(config)


def test_a_dead_engine_process_fails_requests_and_health(deltaserve_cache_dir):
    running = start_server(api_key=None, engine_process=True)
    client = running.app.state.async_engine
    try:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
        ok = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60)
        assert ok.status_code == 200, ok.text
        assert httpx.get(f"{running.url}/health", timeout=10).status_code == 200

        answer: dict[str, httpx.Response] = {}

        def send() -> None:  # a long request, running when the engine dies
            long = {"model": MODEL, "prompt": "hello", "max_tokens": 400, "ignore_eos": True}
            answer["r"] = httpx.post(f"{running.url}/v1/completions", json=long, timeout=120)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        deadline = time.monotonic() + 60
        while client.snapshot.running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.snapshot.running == 1
        os.kill(client._process.pid, signal.SIGKILL)
        sender.join(timeout=60)
        resp = answer["r"]
        assert resp.status_code == 500, resp.text
        assert "engine process exited" in resp.json()["error"]["message"]
        assert httpx.get(f"{running.url}/health", timeout=10).status_code == 503
        refused = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60)
        assert refused.status_code == 503, refused.text
    finally:
        running.stop()


def test_shutdown_stops_the_engine_process(deltaserve_cache_dir):
    running = start_server(api_key=None, engine_process=True)
    process = running.app.state.async_engine._process
    assert process.is_alive()
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{running.url}/v1/completions", json=body, timeout=60).status_code == 200
    running.stop()
    process.join(timeout=30)
    assert not process.is_alive()
    assert process.exitcode == 0  # stopped, not killed


class _FakeSeq:
    def __init__(self, index: int) -> None:
        self.index = index
        self.detokenizer = None
        self.is_finished = False
        self.params = SamplingParams()


class _FakeEngine:
    """Two sequences (n=2): the second starts one step after the first."""

    def __init__(self) -> None:
        self.requests: dict = {}
        self.steps = [
            [[7], []],
            [[7, 8], [9]],
            [[7, 8, 1], [9, 2]],
            [[7, 8, 1, 3], [9, 2, 4]],
        ]

    def add_request(self, rid, prompt, params) -> None:
        if prompt == "bad":
            raise ValueError("the prompt is bad")

        class _Req:
            seqs = [_FakeSeq(0), _FakeSeq(1)]

        self.requests[rid] = _Req()

    def abort_request(self, rid) -> None:
        self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) and bool(self.steps)

    def step(self) -> list[RequestOutput]:
        ids = self.steps.pop(0)
        done = not self.steps
        outs = [
            CompletionOutput(i, "", list(t), finish_reason="length" if done else None)
            for i, t in enumerate(ids)
        ]
        out = RequestOutput("r", None, [1, 2, 3], outs, finished=done, num_cached_tokens=2)
        out.prompt_logprobs = [None, {}, {}]
        if done:
            self.requests.clear()
        return [out]

    def num_running_and_waiting(self) -> tuple[int, int]:
        return len(self.requests), 0

    def cache_usage(self) -> dict[str, int]:
        return {}

    def prefix_cache_stats(self) -> dict[str, int]:
        return {}


def _run_until_done(engine: _FakeEngine, loop: EngineLoop) -> None:
    """Run `loop` until the fake engine has made all its steps."""

    def stop_when_done() -> None:
        deadline = time.monotonic() + 10
        while engine.steps and time.monotonic() < deadline:
            time.sleep(0.005)
        loop.stop()

    threading.Thread(target=stop_when_done, daemon=True).start()
    loop.run()


def test_engine_loop_sends_light_outputs_between_first_and_last():
    batches: list[EngineBatch] = []
    engine = _FakeEngine()
    loop = EngineLoop(engine, batches.append, light_outputs=True)
    loop.put(("add", "r", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(n=2)))
    loop.put(("add", "x", "bad", SamplingParams()))
    _run_until_done(engine, loop)
    items = [item for batch in batches for item in batch.items]
    assert items[0] == Failure("x", "bad_request", "the prompt is bad")
    updates = [item for item in items if isinstance(item, RequestUpdate)]
    assert [u.finished for u in updates] == [False, False, False, True]
    full = [bool(u.output.prompt_token_ids) for u in updates]
    # step 1: first update; step 2: the second sequence's first delta; step 3: light; last: full
    assert full == [True, True, False, True]
    assert all(u.output.num_cached_tokens == 2 for u in updates)
    assert updates[1].output.prompt_logprobs == [None, {}, {}]
    assert updates[2].output.prompt_logprobs is None
    tokens = {0: [], 1: []}
    for u in updates:
        for d in u.deltas:
            tokens[d.index] += d.token_ids
    assert tokens == {0: [7, 8, 1, 3], 1: [9, 2, 4]}
    assert batches[-1].drained == 3  # n=2 plus the bad one


def test_engine_loop_in_thread_mode_sends_full_outputs():
    batches: list[EngineBatch] = []
    engine = _FakeEngine()
    loop = EngineLoop(engine, batches.append)
    loop.put(("add", "r", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(n=2)))
    _run_until_done(engine, loop)
    updates = [i for b in batches for i in b.items if isinstance(i, RequestUpdate)]
    assert len(updates) == 4
    assert all(u.output.prompt_token_ids == [1, 2, 3] for u in updates)


def test_serve_runs_the_engine_in_its_own_process_by_default():
    from deltaserve.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).engine_process is True
    assert parser.parse_args(["serve", "--no-engine-process"]).engine_process is False


def _children(pid: int) -> list[int]:
    """Live child processes of `pid` (from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(entry))
    return kids


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_tensor_parallel_engine_process_serves_and_stops(deltaserve_cache_dir):
    """The engine process starts its rank workers itself (so it is no daemon) and stops them."""
    running = start_server(api_key=None, engine_process=True, tensor_parallel_size=2)
    process = running.app.state.async_engine._process
    try:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0}
        resp = httpx.post(f"{running.url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 3
        workers = _children(process.pid)
        assert workers, "no rank worker under the engine process"
    finally:
        running.stop()
    process.join(timeout=30)
    assert process.exitcode == 0
    deadline = time.monotonic() + 30
    while any(_alive(w) for w in workers):
        assert time.monotonic() < deadline, "a rank worker outlived the engine process"
        time.sleep(0.1)


def test_a_request_that_cannot_travel_fails_alone(deltaserve_cache_dir):
    """A request whose command cannot be pickled fails with 500; the engine serves the next and
    counts nothing as waiting."""
    import asyncio

    from deltaserve.config import create_engine_config
    from deltaserve.loader.demo import ensure_demo_model
    from deltaserve.server.engine_client import EngineProcessClient
    from deltaserve.server.errors import EngineError

    config = create_engine_config(str(ensure_demo_model()), device="cpu", max_model_len=128)
    client = EngineProcessClient(config)

    async def scenario() -> list[int]:
        client.start()
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        bad = {"prompt": None, "prompt_token_ids": [5, 6, 7], "hook": lambda: None}
        group = client.submit("bad", [bad], params)
        with pytest.raises(EngineError, match="cannot send the request to the engine"):
            async for _ in group.updates():
                pass
        group.close()
        good = client.submit("good", [{"prompt": None, "prompt_token_ids": [5, 6, 7]}], params)
        tokens = []
        async for _, update in good.updates():
            tokens += [t for d in update.deltas for t in d.token_ids]
        assert client.num_waiting() == 0
        await client.shutdown()
        return tokens

    try:
        assert len(asyncio.run(scenario())) == 2
    finally:
        client.close()
