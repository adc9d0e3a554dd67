"""The official `openai` client, unchanged, against the real server: chat and completions,
streaming and not, n > 1, stop strings, seeds, logprobs, and lm-eval-style loglikelihood."""

from __future__ import annotations

import httpx
import pytest
from conftest import MAX_MODEL_LEN, MODEL

IGNORE_EOS = {"ignore_eos": True}


def _tokenize(server, **body) -> list[int]:
    resp = httpx.post(f"{server.url}/tokenize", json=body, headers=server.headers, timeout=30)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["count"] == len(data["tokens"]) and data["max_model_len"] == MAX_MODEL_LEN
    return data["tokens"]


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model"


def test_chat_stream_matches_non_stream(client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    kwargs = dict(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=IGNORE_EOS
    )
    full = client.chat.completions.create(**kwargs)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert full.usage.completion_tokens == 8
    assert full.usage.total_tokens == full.usage.prompt_tokens + 8

    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == ""
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    # the same token counts (the second request may hit the prefix cache the first filled)
    assert chunks[-1].choices == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(chunks[-1].usage, k) for k in counts] == [
        getattr(full.usage, k) for k in counts
    ]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_stream_matches_non_stream(client):
    kwargs = dict(model=MODEL, prompt="Once upon", max_tokens=10, temperature=0)
    full = client.completions.create(**kwargs, extra_body=IGNORE_EOS)
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 10
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body=IGNORE_EOS))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_max_completion_tokens(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=3,
        extra_body=IGNORE_EOS,
    )
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_n_and_seed(client):
    kwargs = dict(model=MODEL, prompt="abc", max_tokens=8, temperature=1.0, n=3, seed=7)
    a = client.completions.create(**kwargs, extra_body=IGNORE_EOS)
    b = client.completions.create(**kwargs, extra_body=IGNORE_EOS)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # each choice samples on its own
    assert a.usage.completion_tokens == 24

    # two prompts, n=2: choice index = prompt index * n + completion index
    multi = client.completions.create(
        model=MODEL, prompt=["abc", "xyz"], max_tokens=4, n=2, seed=7, extra_body=IGNORE_EOS
    )
    assert [c.index for c in multi.choices] == [0, 1, 2, 3]
    assert multi.choices[0].text == a.choices[0].text[: len(multi.choices[0].text)]
    assert multi.usage.prompt_tokens == 6 and multi.usage.completion_tokens == 16

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        n=2,
        seed=3,
        stream=True,
        extra_body=IGNORE_EOS,
    )
    texts, finished = {0: "", 1: ""}, set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    full = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        n=2,
        seed=3,
        extra_body=IGNORE_EOS,
    )
    assert finished == {0, 1}
    assert texts == {c.index: c.message.content for c in full.choices}


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_stop_string_spanning_tokens_never_leaks(client, api):
    def run(stream: bool, stop=None) -> tuple[str, str | None]:
        common = dict(
            model=MODEL,
            max_tokens=40,
            temperature=0,
            stop=stop,
            stream=stream,
            extra_body=IGNORE_EOS,
        )
        if api == "completions":
            out = client.completions.create(prompt="The sky", **common)
            if not stream:
                return out.choices[0].text, out.choices[0].finish_reason
            chunks = [c.choices[0] for c in out if c.choices]
            return "".join(c.text for c in chunks), chunks[-1].finish_reason
        messages = [{"role": "user", "content": "The sky"}]
        out = client.chat.completions.create(messages=messages, **common)
        if not stream:
            return out.choices[0].message.content, out.choices[0].finish_reason
        chunks = [c.choices[0] for c in out if c.choices]
        return "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason

    full, _ = run(False)
    assert len(full) >= 10
    stop = full[5:8]  # three characters: three byte-level tokens
    expected = full[: full.find(stop)]
    assert run(False, [stop]) == (expected, "stop")
    streamed, reason = run(True, [stop])
    assert (streamed, reason) == (expected, "stop")  # deltas only append: nothing leaked


def test_seeded_sampling_streams_the_same_text(client):
    # high temperature reaches non-ASCII bytes: incremental UTF-8 decoding must add up
    for seed in (1, 2, 3):
        kwargs = dict(model=MODEL, prompt="é漢", max_tokens=24, temperature=2.0, seed=seed)
        full = client.completions.create(**kwargs, extra_body=IGNORE_EOS).choices[0].text
        chunks = client.completions.create(**kwargs, stream=True, extra_body=IGNORE_EOS)
        assert "".join(c.choices[0].text for c in chunks) == full


def test_completion_logprobs(client):
    out = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=6, temperature=0, logprobs=3, extra_body=IGNORE_EOS
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 4
        assert top[token] == pytest.approx(value) == pytest.approx(max(top.values()))  # greedy


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=IGNORE_EOS,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert [x.logprob for x in t.top_logprobs] == sorted(
            (x.logprob for x in t.top_logprobs), reverse=True
        )
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token  # greedy
        assert t.bytes == list(t.token.encode())


def test_loglikelihood_echo(client, server):
    context = _tokenize(server, prompt="The quick brown")
    step = client.completions.create(
        model=MODEL, prompt=context, max_tokens=1, temperature=0, logprobs=1
    )
    next_token_lp = step.choices[0].logprobs.token_logprobs[0]
    [next_id] = _tokenize(server, prompt=step.choices[0].logprobs.tokens[0])

    # lm-eval: score context + continuation, echo=True, max_tokens=0, logprobs=1
    scored = client.completions.create(
        model=MODEL, prompt=context + [next_id], max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = scored.choices[0]
    lps = choice.logprobs.token_logprobs
    assert len(lps) == len(context) + 1 and lps[0] is None
    assert all(v <= 0 for v in lps[1:])
    assert lps[-1] == pytest.approx(next_token_lp, abs=1e-3)
    assert choice.text == "The quick brown" + step.choices[0].text
    assert scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == len(context) + 1

    # max_tokens=1: the prompt's logprobs, then one generated token's
    one = client.completions.create(
        model=MODEL, prompt=context + [next_id], max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    lps1 = one.choices[0].logprobs.token_logprobs
    assert len(lps1) == len(context) + 2 and lps1[: len(lps)] == pytest.approx(lps, abs=1e-5)


def test_chat_template_roles_and_kwargs(client, server):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "Thanks"},
    ]
    kwargs = {"enable_thinking": False}
    out = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=2,
        extra_body={"chat_template_kwargs": kwargs},
    )
    with_kwargs = _tokenize(server, messages=messages, chat_template_kwargs=kwargs)
    without = _tokenize(server, messages=messages)
    assert out.usage.prompt_tokens == len(with_kwargs) > len(without)


def test_tokenize_detokenize(server):
    ids = _tokenize(server, prompt="héllo wörld")
    resp = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, headers=server.headers)
    assert resp.status_code == 200 and resp.json() == {"prompt": "héllo wörld"}
