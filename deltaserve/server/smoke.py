"""`deltaserve smoke`: a gateway regression smoke against a running OpenAI-compatible endpoint.

It streams a few chat requests and checks each: HTTP 200 with `text/event-stream`, every event
valid JSON of object `chat.completion.chunk`, a first delta with role `assistant`, a non-empty
answer, a finish_reason, a usage chunk, `data: [DONE]` last, no time-out, and with
`--min-gen-tps` a generation speed of at least X tokens/s (tokens after the first, over the time
after the first). Exit status 0 only if every check passes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import dataclass

import httpx

from deltaserve.server.sse_client import SSEParser, auth_headers, base_url

PROMPTS = (
    "Say hello in one short sentence.",
    "What is two plus two?",
    "Name three colours.",
    "Write a haiku about the sea.",
)


class SmokeFailure(Exception):
    pass


@dataclass
class SmokeResult:
    completion_tokens: int
    ttft_s: float
    gen_tps: float
    text: str


def run_smoke(args: argparse.Namespace) -> int:
    url = base_url(args.endpoint)
    timeout = httpx.Timeout(args.timeout)
    failures = 0
    with httpx.Client(timeout=timeout, headers=auth_headers(args.api_key)) as client:
        try:
            model = args.model or _first_model(client, url)
        except (httpx.HTTPError, SmokeFailure) as e:
            print(f"FAIL /v1/models: {_describe(e)}")
            return 1
        for i in range(args.num_requests):
            prompt = PROMPTS[i % len(PROMPTS)]
            try:
                r = _stream_chat(client, url, model, prompt, args)
            except (httpx.HTTPError, SmokeFailure) as e:
                failures += 1
                print(f"FAIL request {i}: {_describe(e)}")
                continue
            print(
                f"ok   request {i}: {r.completion_tokens} tokens, first token {r.ttft_s:.3f} s, "
                f"{r.gen_tps:.1f} tok/s: {r.text[:40]!r}"
            )
    passed = args.num_requests - failures
    print(f"smoke {'PASSED' if not failures else 'FAILED'}: {passed}/{args.num_requests} ok")
    return 1 if failures else 0


def _describe(error: Exception) -> str:
    if isinstance(error, httpx.TimeoutException):
        return f"timed out ({type(error).__name__})"
    return str(error) or type(error).__name__


def _first_model(client: httpx.Client, url: str) -> str:
    resp = client.get(f"{url}/v1/models")
    if resp.status_code != 200:
        raise SmokeFailure(f"HTTP {resp.status_code}: {resp.text[:200]}")
    data = resp.json().get("data") or []
    if not data:
        raise SmokeFailure("no models listed")
    return data[0]["id"]


def _stream_chat(
    client: httpx.Client, url: str, model: str, prompt: str, args: argparse.Namespace
) -> SmokeResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.monotonic()
    deadline = start + args.timeout
    pieces: list[str] = []
    first_token = last_token = None
    role_seen = done = False
    finish_reason = usage = None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise SmokeFailure(f"HTTP {resp.status_code}: {resp.text[:200]}")
        ctype = resp.headers.get("content-type", "")
        if not ctype.startswith("text/event-stream"):
            raise SmokeFailure(f"content-type {ctype!r}, expected text/event-stream")
        parser = SSEParser()
        for line in itertools.chain(resp.iter_lines(), [""]):  # "" ends a last event
            if time.monotonic() > deadline:
                raise SmokeFailure(f"timed out after {args.timeout:.0f} s")
            data = parser.feed(line)
            if data is None:
                continue
            if done:
                raise SmokeFailure("events after data: [DONE]")
            if data == "[DONE]":
                done = True
                continue
            chunk = _parse_chunk(data)
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                if not role_seen:
                    if delta.get("role") != "assistant":
                        raise SmokeFailure(f"first delta has no role 'assistant': {delta}")
                    role_seen = True
                if delta.get("content"):
                    last_token = time.monotonic()
                    first_token = first_token or last_token
                    pieces.append(delta["content"])
                finish_reason = choice.get("finish_reason") or finish_reason
    text = "".join(pieces)
    if not done:
        raise SmokeFailure("the stream did not end with data: [DONE]")
    if finish_reason is None:
        raise SmokeFailure("no finish_reason")
    if not text.strip() or first_token is None or last_token is None:
        raise SmokeFailure(f"empty answer (finish_reason {finish_reason})")
    if not usage or not usage.get("completion_tokens"):
        raise SmokeFailure("no usage chunk with completion_tokens")
    tokens = int(usage["completion_tokens"])
    if tokens > 1 and last_token > first_token:
        tps = (tokens - 1) / (last_token - first_token)
    else:
        tps = tokens / max(last_token - start, 1e-9)
    if args.min_gen_tps is not None and tps < args.min_gen_tps:
        raise SmokeFailure(
            f"generation speed {tps:.1f} tok/s below --min-gen-tps {args.min_gen_tps}"
        )
    return SmokeResult(tokens, first_token - start, tps, text)


def _parse_chunk(data: str) -> dict:
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError as e:
        raise SmokeFailure(f"invalid JSON in an event: {data[:100]!r}") from e
    if not isinstance(chunk, dict):
        raise SmokeFailure(f"event is not a JSON object: {data[:100]!r}")
    if "error" in chunk:
        raise SmokeFailure(f"error event: {chunk['error']}")
    if chunk.get("object") != "chat.completion.chunk" or "choices" not in chunk:
        raise SmokeFailure(f"not a chat.completion.chunk: {data[:100]!r}")
    return chunk
