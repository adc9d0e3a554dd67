"""Malformed and out-of-range requests get OpenAI-style 4xx bodies, never a 500, and the server
keeps serving; API keys; unknown routes; 503 when the waiting queue is full."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from conftest import API_KEY, MAX_MODEL_LEN, MODEL, start_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hi"}]

# (path, body: dict or raw str, expected status)
BAD_REQUESTS = [
    (COMPLETIONS, '{"prompt": "x", ', 400),  # malformed JSON
    (COMPLETIONS, "[1, 2]", 400),  # not an object
    (COMPLETIONS, "", 400),  # no body
    (COMPLETIONS, '{"prompt": "x", "temperature": NaN}', 400),
    (COMPLETIONS, {"max_tokens": 4}, 400),  # no prompt
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400),
    (COMPLETIONS, {"prompt": "x", "max_tokens": -3}, 400),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "many"}, 400),
    (COMPLETIONS, {"prompt": "x", "temperature": -0.5}, 400),
    (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, 400),
    (COMPLETIONS, {"prompt": "x", "top_k": -2}, 400),
    (COMPLETIONS, {"prompt": "x", "presence_penalty": 9}, 400),
    (COMPLETIONS, {"prompt": "x", "n": 0}, 400),
    (COMPLETIONS, {"prompt": "x", "n": 100000}, 400),
    (COMPLETIONS, {"prompt": "x", "seed": 2**70}, 400),
    (COMPLETIONS, {"prompt": "x", "logprobs": 1000}, 400),
    (COMPLETIONS, {"prompt": "x", "stop": [1, 2]}, 400),
    (COMPLETIONS, {"prompt": "x", "stop": [""]}, 400),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [10**9]}, 400),
    (COMPLETIONS, {"prompt": "x", "min_tokens": 9, "max_tokens": 2}, 400),
    (COMPLETIONS, {"prompt": "x", "model": "no-such-model"}, 400),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, 400),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 10}}, 400),
    (COMPLETIONS, {"prompt": ""}, 400),
    (COMPLETIONS, {"prompt": []}, 400),
    (COMPLETIONS, {"prompt": [5, -1]}, 400),
    (COMPLETIONS, {"prompt": [10**9]}, 400),
    (COMPLETIONS, {"prompt": [1] * (MAX_MODEL_LEN + 10)}, 400),  # longer than max_model_len
    (COMPLETIONS, {"prompt": [1] * 100, "max_tokens": MAX_MODEL_LEN}, 400),
    (COMPLETIONS, {"prompt": "x", "stream": True, "max_tokens": 0}, 400),
    (CHAT, {"messages": []}, 400),
    (CHAT, {"messages": "hi"}, 400),
    (CHAT, {"messages": [{"content": "no role"}]}, 400),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
        400,
    ),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    (CHAT, {"messages": HELLO, "max_completion_tokens": 0}, 400),
    (CHAT, {"messages": HELLO, "max_tokens": 10**6}, 400),
    (CHAT, {"messages": HELLO, "temperature": -1}, 400),
    (CHAT, {"messages": HELLO, "top_logprobs": 3}, 400),  # without logprobs=true
    (CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 99}, 400),
    (CHAT, {"messages": HELLO, "chat_template_kwargs": "thinking"}, 400),
    (CHAT, {"messages": HELLO, "chat_template_kwargs": {"tokenize": True}}, 400),
    (CHAT, {"messages": HELLO, "model": "gpt-4"}, 400),
    (CHAT, {"messages": HELLO, "response_format": {"type": "json_schema"}}, 400),
    ("/tokenize", {}, 400),
    ("/tokenize", {"messages": "x"}, 400),
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/detokenize", {"tokens": "abc"}, 400),
    ("/v1/no-such-route", {}, 404),
    ("/v1/models", {}, 405),
]


def _post(server, path, body, headers=None):
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {
        "Content-Type": "application/json",
        **(server.headers if headers is None else headers),
    }
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60)


def _assert_openai_error(resp, status):
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] and error["code"] == status


def _assert_still_serving(server):
    resp = _post(server, COMPLETIONS, {"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"]


@pytest.mark.parametrize(
    "path,body,status", BAD_REQUESTS, ids=[f"{i}-{p}" for i, (p, _, _) in enumerate(BAD_REQUESTS)]
)
def test_bad_request_gets_4xx_and_server_keeps_serving(server, path, body, status):
    _assert_openai_error(_post(server, path, body), status)
    _assert_still_serving(server)


def test_bad_requests_counted_as_errors(server):
    before = server.metrics()['deltaserve_requests_total{outcome="error"}']
    _post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 0})
    _post(server, CHAT, '{"messages": ')
    assert server.metrics()['deltaserve_requests_total{outcome="error"}'] == before + 2


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}]
)
def test_api_key_required(server, headers):
    for path in (COMPLETIONS, "/tokenize"):
        _assert_openai_error(_post(server, path, {"prompt": "x"}, headers=headers), 401)
    resp = httpx.get(f"{server.url}/v1/models", headers=headers)
    _assert_openai_error(resp, 401)
    # probes and scrapers need no key
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_unknown_route_is_404(server):
    _assert_openai_error(httpx.get(f"{server.url}/no/such/route"), 404)


def test_full_waiting_queue_is_503(deltaserve_cache_dir):
    """One sequence may run and one may wait: a third request gets 503 until there is room."""
    small = start_server(api_key=None, max_waiting=1, max_num_seqs=1)
    long_body = {
        "model": MODEL,
        "prompt": "x",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", f"{small.url}{COMPLETIONS}", json=long_body) as running:
                lines = running.iter_lines()  # NOTE: dropping the iterator would disconnect
                next(lines)  # the first request runs
                with c.stream("POST", f"{small.url}{COMPLETIONS}", json=long_body) as waiting:
                    assert waiting.status_code == 200
                    deadline = time.monotonic() + 60
                    while small.metrics()["deltaserve_num_requests_waiting"] < 1:
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
                    resp = _post(small, COMPLETIONS, {"prompt": "x", "max_tokens": 1})
                    _assert_openai_error(resp, 503)
                    assert small.metrics()['deltaserve_requests_total{outcome="rejected"}'] == 1
        # both streams closed: their requests are aborted, and the server serves again
        metrics = small.wait_idle()
        assert metrics["deltaserve_kv_blocks_used"] == 0
        assert metrics["deltaserve_state_slots_used"] == 0
        _assert_still_serving(small)
    finally:
        small.stop()
