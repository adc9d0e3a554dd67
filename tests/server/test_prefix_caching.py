"""Prefix caching through the server (hybrid demo model): a 5-turn chat computes, from turn 2
on, at most the new turn's tokens plus one block; /metrics and the usage's
`prompt_tokens_details.cached_tokens` say so."""

from __future__ import annotations

import httpx

BLOCK_SIZE = 16  # the server's default block size


def _chat(server, messages: list[dict]) -> dict:
    body = {"model": "demo", "messages": messages, "max_tokens": 10, "temperature": 0}
    r = httpx.post(
        f"{server.url}/v1/chat/completions", json=body, headers=server.headers, timeout=120
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_multi_turn_chat_computes_only_the_new_turn(server):
    messages = [{"role": "system", "content": "Server prefix test. " * 4}]
    history = 0  # prompt tokens plus answer tokens of the previous turn
    for turn in range(5):
        messages.append({"role": "user", "content": f"Turn {turn}: what about {turn * 11}?"})
        before = server.wait_idle()
        reply = _chat(server, messages)
        after = server.wait_idle()
        usage = reply["usage"]
        computed = (
            after["deltaserve_prompt_tokens_computed_total"]
            - before["deltaserve_prompt_tokens_computed_total"]
        )
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached == usage["prompt_tokens"] - computed
        if turn == 0:
            assert computed == usage["prompt_tokens"]
        else:
            new_turn = usage["prompt_tokens"] - history
            assert computed <= new_turn + BLOCK_SIZE, f"turn {turn + 1}: {computed} tokens"
            hits = (
                after["deltaserve_prefix_cache_hits_total"]
                - before["deltaserve_prefix_cache_hits_total"]
            )
            assert hits == 1 and cached > 0
        history = usage["prompt_tokens"] + usage["completion_tokens"]
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    m = server.wait_idle()
    assert m["deltaserve_prefix_state_snapshots_held"] > 0
    assert (
        m["deltaserve_prefix_state_snapshots_total"] >= m["deltaserve_prefix_state_snapshots_held"]
    )
    assert m["deltaserve_prefix_cache_hit_tokens_total"] > 0
    assert m["deltaserve_prefix_cache_queries_total"] >= 5
