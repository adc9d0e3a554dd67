"""`deltaserve bench serve --multi-turn N`: chat-like conversations against a running server.

Every conversation starts from the same `--system-len`-token system prompt (random ids, one
draw for all); turn t sends, as a token-id prompt to /v1/completions, the system prompt, each
earlier turn's `--input-len` user tokens (or a length drawn with `--random-range-ratio`) and
the model's answer to it (its generated token ids,
asked for with `return_token_ids`), then this turn's new user tokens. A conversation's turns run
one after another; at most `--concurrency` conversations run at once.

Reported: TTFT p50 / p99 per turn index, for turn 1 and for turns >= 2 together, and the prefill
work: prompt tokens sent, those the server's prefix cache served (the usage's
`prompt_tokens_details.cached_tokens`) and, when /metrics has it, the prompt tokens the server
computed (`deltaserve_prompt_tokens_computed_total`, before and after the run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from typing import Any

from deltaserve.bench.serve import (
    RequestResult,
    _first_model,
    _one_request,
    draw_len,
    percentile,
    report_row,
)

_COMPUTED = "deltaserve_prompt_tokens_computed_total"


def run_multi_turn(args: argparse.Namespace) -> int:
    if args.system_len < 0:
        raise ValueError("--system-len must be at least 0")
    results, duration, model, computed = asyncio.run(_bench(args))
    report = summarize_turns(results, duration, computed)
    report.update(
        endpoint=args.endpoint,
        model=model,
        conversations=args.num_prompts,
        turns=args.multi_turn,
        concurrency=args.concurrency,
        system_len=args.system_len,
        input_len=args.input_len,
        output_len=args.output_len,
        random_range_ratio=args.random_range_ratio,
    )
    print(format_turns(report))
    errors = [r.error for r in results if not r.ok]
    if errors:
        print(f"{len(errors)} request(s) failed; first error: {errors[0]}", file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 1 if errors else 0


async def _bench(args: argparse.Namespace) -> tuple[list[RequestResult], float, str, int | None]:
    import httpx

    from deltaserve.server.sse_client import auth_headers, base_url

    url = base_url(args.endpoint)
    rng = random.Random(args.seed)
    system = [rng.randrange(args.vocab_size) for _ in range(args.system_len)]
    user_turns = [
        [
            (
                [rng.randrange(args.vocab_size) for _ in range(n)],
                draw_len(rng, args.output_len, args),
            )
            for n in [draw_len(rng, args.input_len, args) for _ in range(args.multi_turn)]
        ]
        for _ in range(args.num_prompts)
    ]
    limits = httpx.Limits(max_connections=args.concurrency + 2)
    async with httpx.AsyncClient(
        headers=auth_headers(args.api_key), timeout=httpx.Timeout(args.timeout), limits=limits
    ) as client:
        model = args.model or await _first_model(client, url)
        slots = asyncio.Semaphore(args.concurrency)

        async def conversation(c: int, turns: list[tuple[list[int], int]]) -> list[RequestResult]:
            history = list(system)
            done = []
            async with slots:
                for t, (user, output_len) in enumerate(turns, start=1):
                    prompt = history + user
                    r = await _one_request(client, url, model, prompt, output_len, True)
                    r.turn = t
                    r.conversation = c
                    done.append(r)
                    if not r.ok:
                        break
                    history = prompt + r.token_ids
            return done

        before = await _computed(client, url)
        start = time.perf_counter()
        per_conv = await asyncio.gather(
            *(conversation(c, turns) for c, turns in enumerate(user_turns))
        )
        duration = time.perf_counter() - start
        after = await _computed(client, url)
    computed = after - before if before is not None and after is not None else None
    for conv in per_conv:
        for r in conv:
            r.sent_at -= start  # seconds into the run
    return [r for conv in per_conv for r in conv], duration, model, computed


async def _computed(client: Any, url: str) -> int | None:
    """The server's prompt tokens computed so far (None when /metrics does not say)."""
    try:
        resp = await client.get(f"{url}/metrics")
    except Exception:  # noqa: BLE001 - a server without /metrics still benchmarks
        return None
    m = re.search(rf"^{_COMPUTED} (\S+)$", resp.text, re.MULTILINE)
    return int(float(m.group(1))) if m else None


def summarize_turns(
    results: list[RequestResult], duration: float, computed: int | None
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    report: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "prompt_tokens": sum(r.prompt_len for r in ok),
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "computed_prompt_tokens": computed,
        "output_tokens": sum(r.output_tokens for r in ok),
    }

    def ttft(rs: list[RequestResult]) -> dict[str, float]:
        ms = [r.ttft * 1000 for r in rs]
        return {"n": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99)}

    report["ttft_turn_1"] = ttft([r for r in ok if r.turn == 1])
    report["ttft_turns_2_plus"] = ttft([r for r in ok if r.turn >= 2])
    by_turn: dict[int, list[RequestResult]] = {}
    for r in ok:
        by_turn.setdefault(r.turn, []).append(r)
    turns = sorted(by_turn)
    report["ttft_by_turn"] = {str(t): ttft(by_turn[t]) for t in turns}
    # every request: (conversation, turn, sent at s into the run, TTFT ms), in send order
    report["requests"] = sorted(
        ((r.conversation, r.turn, round(r.sent_at, 4), round(r.ttft * 1000, 2)) for r in ok),
        key=lambda x: x[2],
    )
    report["prompt_len_by_turn"] = {
        str(t): sum(r.prompt_len for r in by_turn[t]) / len(by_turn[t]) for t in turns
    }
    return report


def format_turns(r: dict[str, Any]) -> str:
    lines = ["{:=^60}".format(" Multi-turn Serving Benchmark ")]

    def row(label: str, value: Any) -> None:
        report_row(lines, label, value)

    row("Successful requests:", r["completed"])
    row("Failed requests:", r["failed"])
    row("Benchmark duration (s):", r["duration"])
    row("Prompt tokens sent:", r["prompt_tokens"])
    row("Prompt tokens served by the prefix cache:", r["cached_prompt_tokens"])
    computed = r["computed_prompt_tokens"]
    row("Prompt tokens computed (server):", "n/a" if computed is None else computed)
    row("Generated tokens:", r["output_tokens"])
    lines.append("{:-^60}".format(" TTFT (ms) "))
    row("Turn 1: P50 / P99:", _pair(r["ttft_turn_1"]))
    row("Turns >= 2: P50 / P99:", _pair(r["ttft_turns_2_plus"]))
    for turn, t in r["ttft_by_turn"].items():
        prompt = r["prompt_len_by_turn"][turn]
        row(f"Turn {turn} ({prompt:.0f} prompt tokens): P50 / P99:", _pair(t))
    lines.append("=" * 60)
    return "\n".join(lines)


def _pair(t: dict[str, float]) -> str:
    return f"{t['p50_ms']:.1f} / {t['p99_ms']:.1f}"
