"""A long prompt is tokenized off the event loop: /health answers while it tokenizes. Request
bodies past --max-request-bytes get an OpenAI-style 413, counted with Content-Length or, for a
chunked body, as it arrives."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
from conftest import MODEL, start_server

from deltaserve.server import DEFAULT_MAX_REQUEST_BYTES

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
LONG_TEXT = "word " * 200_000  # 1 MB of text: tokenizes for a while, far past max_model_len
CAP = 4096  # the small server's --max-request-bytes


def _long_body(path: str) -> dict:
    if path == CHAT:
        return {"model": MODEL, "messages": [{"role": "user", "content": LONG_TEXT}]}
    return {"model": MODEL, "prompt": LONG_TEXT, "max_tokens": 1}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_health_answers_while_a_long_prompt_tokenizes(server, monkeypatch, path):
    """The engine's tokenize step is held until /health has answered: if tokenizing ran on the
    event loop, the loop would be stuck in it and /health could not answer at all."""
    engine = server.app.state.async_engine.engine
    tokenize_prompt = engine.tokenize_prompt
    entered, release = threading.Event(), threading.Event()

    def held_tokenize(prompt):
        entered.set()
        release.wait(timeout=120)
        return tokenize_prompt(prompt)

    monkeypatch.setattr(engine, "tokenize_prompt", held_tokenize)
    answer: dict[str, httpx.Response] = {}

    def send() -> None:
        answer["long"] = httpx.post(
            server.url + path, json=_long_body(path), headers=server.headers, timeout=180
        )

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        assert entered.wait(timeout=120), "the long request never reached the tokenizer"
        health = httpx.get(f"{server.url}/health", timeout=5)  # ReadTimeout if the loop is stuck
        assert health.status_code == 200
        assert sender.is_alive(), "the long request finished before it was released"
    finally:
        release.set()
        sender.join(timeout=180)
    resp = answer["long"]  # then it is tokenized for real, and is too long for the model
    assert resp.status_code == 400, resp.text
    assert "longer than the model allows" in resp.json()["error"]["message"]


@pytest.fixture(scope="module")
def capped(deltaserve_cache_dir):
    running = start_server(api_key=None, max_request_bytes=CAP)
    yield running
    running.stop()


def _body_of_size(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (padded by a field the server
    ignores)."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "pad": ""}
    base = len(json.dumps(body).encode())
    body["pad"] = "x" * (size - base)
    data = json.dumps(body).encode()
    assert len(data) == size
    return data


def _chunks(data: bytes, size: int = 1000):
    for i in range(0, len(data), size):
        yield data[i : i + size]


def _assert_413(resp: httpx.Response) -> None:
    assert resp.status_code == 413, resp.text
    error = resp.json()["error"]
    assert error["code"] == 413 and error["type"] == "invalid_request_error"
    assert "--max-request-bytes" in error["message"] and str(CAP) in error["message"]


def _post(url: str, content, chunked: bool) -> httpx.Response:
    if chunked:  # a generator body goes out with Transfer-Encoding: chunked, no Content-Length
        content = _chunks(content)
    headers = {"Content-Type": "application/json"}
    return httpx.post(url + COMPLETIONS, content=content, headers=headers, timeout=60)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_over_the_cap_is_413(capped, chunked):
    _assert_413(_post(capped.url, _body_of_size(CAP + 1), chunked))
    _assert_413(_post(capped.url, _body_of_size(20 * CAP), chunked))
    # the server keeps serving, and a body of exactly the cap is accepted
    resp = _post(capped.url, _body_of_size(CAP), chunked)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] == "length"


def test_body_cap_defaults_to_32_mib(server):
    """The session server runs with the default cap: a declared length past it is refused at
    once, before any of the body is read (the client waits for `100 Continue`, which never
    comes, and sends nothing)."""
    host, port = server.url.removeprefix("http://").split(":")
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {server.api_key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {DEFAULT_MAX_REQUEST_BYTES + 1}\r\nExpect: 100-continue\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode())
        reply = b""
        while b"}}" not in reply:  # the end of the JSON error body
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    status_line, _, rest = reply.decode().partition("\r\n")
    assert status_line.split()[1] == "413", reply
    error = json.loads(rest.partition("\r\n\r\n")[2])["error"]
    assert str(DEFAULT_MAX_REQUEST_BYTES) in error["message"]
