"""Endpoints clients probe before they send requests: /ping (GET and POST), /version and
/tokenizer_info (lm-eval's remote tokenizer: special tokens and the chat template)."""

from __future__ import annotations

import httpx
import pytest
from conftest import MAX_MODEL_LEN
from jinja2.sandbox import ImmutableSandboxedEnvironment

import deltaserve


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_like_health_without_a_key(server, method):
    assert httpx.request(method, f"{server.url}/ping", timeout=30).status_code == 200


def test_version(server):
    resp = httpx.get(f"{server.url}/version", timeout=30)
    assert resp.status_code == 200
    assert resp.json() == {"version": deltaserve.__version__}


def test_tokenizer_info_needs_the_key(server):
    assert httpx.get(f"{server.url}/tokenizer_info", timeout=30).status_code == 401


def test_tokenizer_info_describes_the_served_tokenizer(server):
    resp = httpx.get(f"{server.url}/tokenizer_info", headers=server.headers, timeout=30)
    assert resp.status_code == 200, resp.text
    info = resp.json()
    engine = server.app.state.async_engine.engine
    tok = engine.tokenizer
    assert info["tokenizer_class"] == type(tok).__name__
    for name in ("eos", "bos", "pad"):
        assert info[f"{name}_token"] == getattr(tok, f"{name}_token")
        assert info[f"{name}_token_id"] == getattr(tok, f"{name}_token_id")
    assert info["eos_token"] and info["pad_token"]  # the demo tokenizer has both
    assert info["eos_token_ids"] == sorted(engine.eos_token_ids)
    assert info["eos_token_id"] in info["eos_token_ids"]
    assert info["chat_template"] == tok.chat_template and info["chat_template"]
    assert info["model_max_length"] == MAX_MODEL_LEN
    assert info["vocab_size"] == engine.vocab_size


def test_remote_tokenizer_round_trip(server):
    """What lm-eval's remote tokenizer does with it: encode eos_token through /tokenize to get
    its id, and render chat_template locally, which must match the server's own rendering."""
    info = httpx.get(f"{server.url}/tokenizer_info", headers=server.headers, timeout=30).json()
    eos = httpx.post(
        f"{server.url}/tokenize",
        json={"prompt": info["eos_token"], "add_special_tokens": False},
        headers=server.headers,
        timeout=30,
    ).json()["tokens"]
    assert eos == [info["eos_token_id"]]
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    local = env.from_string(info["chat_template"]).render(
        messages=messages, add_generation_prompt=True, eos_token=info["eos_token"]
    )
    served = httpx.post(
        f"{server.url}/tokenize",
        json={"messages": messages, "add_generation_prompt": True},
        headers=server.headers,
        timeout=30,
    ).json()["tokens"]
    local_ids = httpx.post(
        f"{server.url}/tokenize",
        json={"prompt": local, "add_special_tokens": False},
        headers=server.headers,
        timeout=30,
    ).json()["tokens"]
    assert local_ids == served
