"""`deltaserve smoke` and `deltaserve bench serve` against the test server, and the command-line
wiring of `serve` and `smoke`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import API_KEY

from deltaserve import cli

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_smoke_passes(server, capsys):
    assert cli.main(["smoke", "--endpoint", server.url + "/v1", "--api-key", API_KEY]) == 0
    out = capsys.readouterr().out
    assert out.count("ok   request") == 3 and "smoke PASSED: 3/3" in out


@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--api-key", "wrong"], "HTTP 401"),
        (["--api-key", API_KEY, "--min-gen-tps", "1e12"], "below --min-gen-tps"),
        (["--api-key", API_KEY, "--model", "unknown"], "HTTP 400"),
    ],
)
def test_smoke_fails_loudly(server, capsys, extra, expected):
    assert cli.main(["smoke", "--endpoint", server.url, "--num-requests", "1", *extra]) == 1
    out = capsys.readouterr().out
    assert expected in out and "FAIL" in out


def test_smoke_fails_without_server(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    assert cli.main(["smoke", "--endpoint", f"http://127.0.0.1:{port}", "--timeout", "5"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_bench_serve(server, tmp_path, capsys):
    path = tmp_path / "bench.json"
    args = "--num-prompts 8 --concurrency 4 --input-len 16 --output-len 6 --api-key".split()
    rc = cli.main(["bench", "serve", "--endpoint", server.url, *args, API_KEY, "--json", str(path)])
    assert rc == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    r = json.loads(path.read_text())
    assert (r["completed"], r["failed"]) == (8, 0)
    assert r["total_input_tokens"] == 8 * 16 and r["total_output_tokens"] == 8 * 6
    assert r["duration"] > 0 and r["request_throughput"] == pytest.approx(8 / r["duration"])
    assert r["output_throughput"] == pytest.approx(48 / r["duration"])
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"median_{name}_ms"] <= r[f"p99_{name}_ms"]
    assert r["p99_ttft_ms"] <= r["p99_e2el_ms"]


def test_bench_serve_multi_turn(server, tmp_path, capsys):
    """4 conversations of 3 turns sharing a 40-token system prompt: each turn resends the
    history with the model's answers (return_token_ids), so from turn 2 on the prefix cache
    serves most of the prompt; the server computed exactly the tokens it did not serve."""
    path = tmp_path / "multi.json"
    args = (
        "--multi-turn 3 --num-prompts 4 --concurrency 2 --system-len 40 --input-len 9 "
        "--output-len 7 --api-key"
    ).split()
    rc = cli.main(["bench", "serve", "--endpoint", server.url, *args, API_KEY, "--json", str(path)])
    assert rc == 0
    assert "Multi-turn Serving Benchmark" in capsys.readouterr().out
    r = json.loads(path.read_text())
    assert (r["completed"], r["failed"], r["output_tokens"]) == (12, 0, 12 * 7)
    # turn t's prompt: system + t user turns + (t - 1) answers
    assert r["prompt_len_by_turn"] == {str(t): 40 + 9 * t + 7 * (t - 1) for t in (1, 2, 3)}
    assert r["prompt_tokens"] == 4 * sum(40 + 9 * t + 7 * (t - 1) for t in (1, 2, 3))
    assert r["computed_prompt_tokens"] == r["prompt_tokens"] - r["cached_prompt_tokens"]
    # turns 2 and 3 of every conversation hit at least their previous turn's first 2 blocks
    assert r["cached_prompt_tokens"] >= 8 * 32
    assert r["ttft_turn_1"]["n"] == 4 and r["ttft_turns_2_plus"]["n"] == 8
    assert 0 < r["ttft_turns_2_plus"]["p50_ms"] <= r["ttft_turns_2_plus"]["p99_ms"]
    # every request, in send order: (conversation, turn, sent at, TTFT ms)
    reqs = r["requests"]
    assert sorted((c, t) for c, t, _, _ in reqs) == [(c, t) for c in range(4) for t in (1, 2, 3)]
    assert [s for _, _, s, _ in reqs] == sorted(s for _, _, s, _ in reqs)
    assert all(s >= 0 and ms > 0 for _, _, s, ms in reqs)


def test_bench_serve_random_range_ratio(server, tmp_path, capsys):
    """--random-range-ratio 0.5: input and output lengths drawn from [L/2, 3L/2] per request
    (per turn in multi-turn mode), as vLLM's random dataset does; 0 keeps them exact."""
    path = tmp_path / "bench.json"
    args = "--num-prompts 8 --concurrency 4 --input-len 16 --output-len 6 --api-key".split()
    extra = ["--random-range-ratio", "0.5", "--json", str(path)]
    rc = cli.main(["bench", "serve", "--endpoint", server.url, *args, API_KEY, *extra])
    assert rc == 0
    r = json.loads(path.read_text())
    assert (r["completed"], r["failed"], r["random_range_ratio"]) == (8, 0, 0.5)
    assert 8 * 8 <= r["total_input_tokens"] <= 8 * 24 and r["total_input_tokens"] != 8 * 16
    assert 8 * 3 <= r["total_output_tokens"] <= 8 * 9 and r["total_output_tokens"] != 8 * 6
    multi = "--multi-turn 2 --num-prompts 3 --system-len 20 --input-len 10 --output-len 5".split()
    multi += ["--api-key", API_KEY, *extra]
    rc = cli.main(["bench", "serve", "--endpoint", server.url, *multi])
    assert rc == 0
    r = json.loads(path.read_text())
    assert (r["completed"], r["failed"], r["random_range_ratio"]) == (6, 0, 0.5)
    assert 6 * 3 <= r["output_tokens"] <= 6 * 8 and r["output_tokens"] != 6 * 5
    capsys.readouterr()
    bad = ["bench", "serve", "--endpoint", server.url, "--random-range-ratio", "1"]
    assert cli.main(bad) != 0
    assert "--random-range-ratio must be in [0, 1), got 1.0" in capsys.readouterr().err


def test_parsers():
    parser = cli.build_parser()
    args = parser.parse_args(["serve"])
    assert (args.model, args.host, args.port, args.api_key) == (None, "127.0.0.1", 8000, None)
    assert (args.served_model_name, args.max_waiting) == (None, 1024)
    args = parser.parse_args(
        "serve --model m --port 9 --api-key k --served-model-name n --max-waiting 3".split()
    )
    assert (args.model, args.port, args.api_key, args.served_model_name) == ("m", 9, "k", "n")
    args = parser.parse_args(["smoke", "--endpoint", "http://h:1", "--min-gen-tps", "5"])
    assert (args.endpoint, args.min_gen_tps, args.api_key) == ("http://h:1", 5.0, None)


def test_parsers_import_nothing_heavy():
    code = (
        "import argparse, sys\n"
        "from deltaserve.server.cli import add_serve_parser, add_smoke_parser\n"
        "from deltaserve.bench import serve\n"
        "p = argparse.ArgumentParser(); sub = p.add_subparsers()\n"
        "add_serve_parser(sub); add_smoke_parser(sub)\n"
        "serve.add_parser(sub.add_parser('bench').add_subparsers())\n"
        "p.parse_args(['serve'])\n"
        "heavy = [m for m in ('torch', 'fastapi', 'uvicorn', 'httpx') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_serve_command_end_to_end(deltaserve_cache_dir, server):
    """`deltaserve serve` in a subprocess: serves, then shuts down cleanly on SIGINT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DELTASERVE_CACHE_DIR": str(deltaserve_cache_dir)}
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", "--device", "cpu", "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--max-model-len", "256", "--served-model-name", "tiny", "--log-level", "warning"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "deltaserve serve did not come up"
            time.sleep(0.1)
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["tiny"] and models[0]["max_model_len"] == 256
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
        out = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert out["usage"]["completion_tokens"] == 3
        # graceful shutdown: a stream in flight at SIGINT still runs to its end
        body.update(max_tokens=120, stream=True)
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: {")
            proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert (
            json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
        )
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
