"""Many concurrent streaming clients, some disconnecting: the rest complete, aborted requests
free their KV blocks and state slots, and the engine batches the requests together."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
from conftest import MODEL

NUM_CLIENTS = 64
LEAVING = frozenset(range(1, NUM_CLIENTS, 3))  # a third of the clients disconnect mid-stream
NUM_DISCONNECT = len(LEAVING)


def _abort_count(server) -> float:
    return server.metrics()['deltaserve_requests_total{outcome="abort"}']


async def _stream(client: httpx.AsyncClient, server, i: int, gate: dict, seen_running: list):
    leaves = i in LEAVING
    body = {
        "model": MODEL,
        "prompt": f"client {i} says",
        "max_tokens": 480 if leaves else 8,
        "temperature": 0.8,
        "seed": i,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, finish, usage, done = "", None, None, False
    async with client.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            usage = chunk["usage"] or usage
            for choice in chunk["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
            if leaves and text:
                # every leaving client has output and cannot have finished (480 tokens):
                # while they all hold their streams open, the last to arrive looks at the
                # engine; then they all leave.
                gate["arrived"] += 1
                if gate["arrived"] == NUM_DISCONNECT:
                    seen_running.append(server.metrics()["deltaserve_num_requests_running"])
                    gate["all_seen"].set()
                await gate["all_seen"].wait()
                return None
    return text, finish, usage, done


def test_concurrent_streams_with_disconnects(server):
    aborts_before = _abort_count(server)

    async def main():
        gate = {"arrived": 0, "all_seen": asyncio.Event()}
        seen_running: list[float] = []
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 4)
        async with httpx.AsyncClient(headers=server.headers, timeout=120, limits=limits) as c:
            results = await asyncio.gather(
                *(_stream(c, server, i, gate, seen_running) for i in range(NUM_CLIENTS))
            )
        return results, seen_running

    results, seen_running = asyncio.run(main())
    completed = [r for r in results if r is not None]
    assert len(completed) == NUM_CLIENTS - NUM_DISCONNECT
    for text, finish, usage, done in completed:
        assert done and finish == "length" and text
        assert usage["completion_tokens"] == 8
    # the leaving clients' requests ran side by side in the engine's batch
    assert seen_running and seen_running[0] >= NUM_DISCONNECT

    metrics = server.wait_idle()
    assert metrics["deltaserve_kv_blocks_used"] == 0
    assert metrics["deltaserve_state_slots_used"] == 0
    assert metrics["deltaserve_kv_blocks_total"] > 0 and metrics["deltaserve_state_slots_total"] > 0
    assert _abort_count(server) - aborts_before == NUM_DISCONNECT


def test_non_streaming_client_disconnect_aborts(server):
    aborts_before = _abort_count(server)
    body = json.dumps(
        {"model": MODEL, "prompt": "long", "max_tokens": 500, "ignore_eos": True}
    ).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {server.api_key}\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 60
        while server.metrics()["deltaserve_num_requests_running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    # the socket is closed: the server must notice and abort the request
    metrics = server.wait_idle()
    assert metrics["deltaserve_kv_blocks_used"] == 0
    assert metrics["deltaserve_state_slots_used"] == 0
    assert _abort_count(server) - aborts_before == 1
