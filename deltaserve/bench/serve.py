"""`deltaserve bench serve`: serving load against an OpenAI-compatible endpoint.

Like `vllm bench serve` with its random dataset: N prompts of exactly `--input-len` random token
ids go to /v1/completions as token-id prompts, streamed, with `ignore_eos` so that each output is
`--output-len` tokens long (with `--random-range-ratio R` each length is drawn from
[L(1 - R), L(1 + R)] instead, as vLLM's random dataset does), at most `--concurrency` in flight
(and optionally Poisson arrivals at `--request-rate`). Reports request throughput, output and
total tok/s, and TTFT, TPOT (time per output token after the first), ITL (gaps between streamed
chunks) and end-to-end latency percentiles; `--json PATH` saves them.

`--multi-turn N`: chat-like conversations instead (deltaserve/bench/multi_turn.py): each of
`--num-prompts` conversations starts from one shared `--system-len`-token system prompt and
sends N turns, each its whole history so far (system prompt, earlier turns and the model's
answers) plus `--input-len` new tokens; TTFT is reported per turn index, with the prefill tokens
the server computed and those its prefix cache served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


def add_parser(subcommands: Any) -> None:
    parser = subcommands.add_parser(
        "serve",
        help="serving load: throughput, TTFT / TPOT / ITL percentiles of a running server",
        description=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--endpoint", required=True, metavar="URL", help="e.g. http://host:8000")
    parser.add_argument("--api-key", default=None, metavar="KEY")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--num-prompts", type=int, default=100, metavar="N")
    parser.add_argument("--concurrency", type=int, default=8, metavar="C")
    parser.add_argument("--input-len", type=int, default=128, metavar="I")
    parser.add_argument("--output-len", type=int, default=128, metavar="O")
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        metavar="R",
        help="each prompt's (each turn's new) input and each output length drawn uniformly from "
        "[L * (1 - R), L * (1 + R)] around --input-len / --output-len, as vLLM's random dataset "
        "does (default 0: exact lengths)",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        metavar="R",
        help="Poisson arrivals at R requests/s (default: all at once, up to --concurrency)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=256,
        metavar="V",
        help="prompt token ids are drawn uniformly from [0, V) (default 256: valid everywhere)",
    )
    parser.add_argument(
        "--multi-turn",
        type=int,
        default=0,
        metavar="N",
        help="conversations of N turns, each sending its growing history (default 0: off)",
    )
    parser.add_argument(
        "--system-len",
        type=int,
        default=1024,
        metavar="S",
        help="with --multi-turn: tokens of the system prompt every conversation shares",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per request")
    parser.add_argument("--json", default=None, metavar="PATH", help="save the results as JSON")
    parser.set_defaults(handler=_run)


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    turn: int = 1  # with --multi-turn: the turn of its conversation (1-based)
    conversation: int = 0  # with --multi-turn: its conversation (0-based)
    token_ids: list[int] = field(default_factory=list)  # generated (with return_token_ids)
    cached_tokens: int = 0  # prompt tokens the server's prefix cache served
    sent_at: float = 0.0  # time.perf_counter() when the request was sent


def _run(args: argparse.Namespace) -> int:
    for name in ("num_prompts", "concurrency", "input_len", "output_len", "vocab_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.multi_turn:
        from deltaserve.bench.multi_turn import run_multi_turn

        return run_multi_turn(args)
    results, duration, model = asyncio.run(_bench(args))
    report = summarize(results, duration)
    report.update(
        endpoint=args.endpoint,
        model=model,
        num_prompts=args.num_prompts,
        concurrency=args.concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        random_range_ratio=args.random_range_ratio,
        request_rate=None if math.isinf(args.request_rate) else args.request_rate,
    )
    print(format_report(report))
    errors = [r.error for r in results if not r.ok]
    if errors:
        print(f"{len(errors)} request(s) failed; first error: {errors[0]}", file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 1 if errors else 0


async def _bench(args: argparse.Namespace) -> tuple[list[RequestResult], float, str]:
    import httpx

    from deltaserve.server.sse_client import auth_headers, base_url

    url = base_url(args.endpoint)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(args.vocab_size) for _ in range(draw_len(rng, args.input_len, args))]
        for _ in range(args.num_prompts)
    ]
    outputs = [draw_len(rng, args.output_len, args) for _ in prompts]
    limits = httpx.Limits(max_connections=args.concurrency + 1)
    async with httpx.AsyncClient(
        headers=auth_headers(args.api_key), timeout=httpx.Timeout(args.timeout), limits=limits
    ) as client:
        model = args.model or await _first_model(client, url)
        slots = asyncio.Semaphore(args.concurrency)

        async def limited(prompt: list[int], output_len: int) -> RequestResult:
            async with slots:
                return await _one_request(client, url, model, prompt, output_len)

        start = time.perf_counter()
        tasks = []
        for prompt, output_len in zip(prompts, outputs, strict=True):
            tasks.append(asyncio.create_task(limited(prompt, output_len)))
            if not math.isinf(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration, model


def draw_len(rng: random.Random, length: int, args: argparse.Namespace) -> int:
    """`length`, or with --random-range-ratio R a uniform draw from [L(1 - R), L(1 + R)]
    (at least 1)."""
    r = args.random_range_ratio
    if not r:
        return length
    return max(1, rng.randint(round(length * (1 - r)), round(length * (1 + r))))


async def _first_model(client: Any, url: str) -> str:
    resp = await client.get(f"{url}/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def _one_request(
    client: Any, url: str, model: str, prompt: list[int], output_len: int, want_ids: bool = False
) -> RequestResult:
    """One streamed completion; with `want_ids` the generated token ids are collected (and a
    chunk counts as output when it carries ids, even without text)."""
    import httpx

    from deltaserve.server.sse_client import SSEParser

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if want_ids:
        body["return_token_ids"] = True
    result = RequestResult(prompt_len=len(prompt))
    start = last = result.sent_at = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                result.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return result
            parser = SSEParser()
            async for line in resp.aiter_lines():
                data = parser.feed(line)
                if data is None or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
                choices = chunk.get("choices", [])
                for c in choices:
                    result.token_ids.extend(c.get("token_ids") or [])
                if any(c.get("text") or c.get("token_ids") for c in choices):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no text streamed"
    return result


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile with linear interpolation (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    report: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name, values in series.items():
        ms = [v * 1000 for v in values]
        report[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else 0.0
        report[f"median_{name}_ms"] = statistics.median(ms) if ms else 0.0
        report[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else 0.0
        for p in PERCENTILES:
            report[f"p{p}_{name}_ms"] = percentile(ms, p)
    return report


_SECTIONS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


def report_row(lines: list[str], label: str, value: Any) -> None:
    """One `label ... value` line of a benchmark report (floats to 2 decimals)."""
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    lines.append(f"{label:<45}{text:>15}")


def format_report(r: dict[str, Any]) -> str:
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]

    def row(label: str, value: Any) -> None:
        report_row(lines, label, value)

    row("Successful requests:", r["completed"])
    row("Failed requests:", r["failed"])
    row("Benchmark duration (s):", r["duration"])
    row("Total input tokens:", r["total_input_tokens"])
    row("Total generated tokens:", r["total_output_tokens"])
    row("Request throughput (req/s):", r["request_throughput"])
    row("Output token throughput (tok/s):", r["output_throughput"])
    row("Total token throughput (tok/s):", r["total_token_throughput"])
    for key, title, short in _SECTIONS:
        lines.append(f"{title:-^60}")
        row(f"Mean {short} (ms):", r[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", r[f"median_{key}_ms"])
        for p in PERCENTILES:
            if p != 50:
                row(f"P{p} {short} (ms):", r[f"p{p}_{key}_ms"])
    lines.append("=" * 60)
    return "\n".join(lines)
