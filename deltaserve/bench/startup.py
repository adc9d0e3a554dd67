"""`deltaserve bench startup`: seconds from a fresh process to a ready engine, and where they go.

Each of `--repeats` runs starts a new Python process that imports deltaserve, builds the engine
(`LLM(...)`: config, tokenizer, weights, caches, CUDA graphs and, on CUDA, the warm-up) and
reports, from inside, the seconds since the process started (`/proc`, the interpreter's own
start included), the import's and the engine's seconds and the engine's start-up phases (the
ready line's: `before the engine`, `tokenizer`, then the runner's). The first run of a machine
pays Triton's compiles and autotuning; later ones read their caches, as a restarted server does.
`--env K=V` sets a variable for the runs (e.g. `PYTHONDONTWRITEBYTECODE=` to let Python cache
bytecode on a machine that sets it).

Output: a markdown table (one row per run), and `--json PATH`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# the child: build the engine, print one JSON line, leave at once (no teardown in the figures)
CHILD = """
import json, os, sys, time
t0 = time.perf_counter()
from deltaserve import LLM
from deltaserve.engine.stats import process_uptime
t1 = time.perf_counter()
llm = LLM(**json.loads(sys.argv[1]))
t2 = time.perf_counter()
print("STARTUP " + json.dumps(dict(
    ready_s=process_uptime(), import_s=t1 - t0, engine_s=t2 - t1,
    phases=llm.llm_engine.startup_phases,
)), flush=True)
os._exit(0)
"""


DEFAULT_MAX_MODEL_LEN = 8192  # the runs' max_model_len unless --max-model-len is given


def add_parser(sub: Any) -> None:
    p = sub.add_parser("startup", help="seconds from a fresh process to a ready engine")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="a checkpoint directory (default: the demo)")
    src.add_argument("--random-model", default=None, help="a random-weight preset")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help=f"default {DEFAULT_MAX_MODEL_LEN}, or a checkpoint's max_position_embeddings if "
        "smaller (the demo model's 4096)",
    )
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--repeats", type=int, default=2, help="fresh processes, one after another")
    p.add_argument(
        "--env", action="append", default=[], metavar="K=V", help="a variable for the runs"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take")
    p.add_argument("--json", default=None, metavar="PATH")
    p.set_defaults(handler=handler)


def checkpoint_max_positions(model_dir: str) -> int | None:
    """max_position_embeddings from a checkpoint's config.json (its text_config's for a
    multimodal one), or None where it has none."""
    try:
        with open(Path(model_dir) / "config.json") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None  # the engine's own load says what is wrong with the directory
    value = config.get("max_position_embeddings")
    if value is None:
        value = (config.get("text_config") or {}).get("max_position_embeddings")
    return int(value) if value else None


def llm_kwargs(args: argparse.Namespace) -> dict:
    """The child's `LLM(...)` keywords (neither --model nor --random-model: the demo model);
    max_model_len DEFAULT_MAX_MODEL_LEN unless given, or less where a checkpoint allows less."""
    kwargs = dict(dtype=args.dtype, device=args.device, attention_backend=args.attention_backend)
    max_len = args.max_model_len or DEFAULT_MAX_MODEL_LEN
    if args.random_model is not None:
        return dict(kwargs, random_model=args.random_model, max_model_len=max_len)
    if args.model is not None:
        model = args.model
    else:
        from deltaserve.loader.demo import ensure_demo_model

        model = str(ensure_demo_model())
    if args.max_model_len is None:
        max_len = min(max_len, checkpoint_max_positions(model) or max_len)
    return dict(kwargs, model=model, max_model_len=max_len)


def child_env(pairs: list[str]) -> dict[str, str]:
    """os.environ plus the `K=V` pairs (`K=` sets K to the empty string)."""
    env = dict(os.environ)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--env takes K=V, got {pair!r}")
        env[key] = value
    return env


def run_once(kwargs: dict, env: dict[str, str], timeout: float) -> dict:
    """One fresh process: its STARTUP report plus `wall_s` (spawn to report, as the parent saw
    it). RuntimeError with the child's last output when it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(kwargs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith("STARTUP "):
            return dict(json.loads(line[len("STARTUP ") :]), wall_s=wall)
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    raise RuntimeError(f"start-up run failed (exit {proc.returncode}): " + " | ".join(tail))


def table(rows: list[dict]) -> str:
    """Markdown: one row per run, the phases as columns (in the order the runs report them)."""
    names: list[str] = []
    for r in rows:
        names += [k for k in r["phases"] if k not in names]
    head = ["run", "ready (s)", "wall (s)", "import (s)", "engine (s)", *names]
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---:"] * len(head)) + " |"]
    for i, r in enumerate(rows, 1):
        ready = "" if r["ready_s"] is None else f"{r['ready_s']:.1f}"
        cells = [str(i), ready, f"{r['wall_s']:.1f}", f"{r['import_s']:.1f}"]
        cells += [f"{r['engine_s']:.1f}"]
        cells += [f"{r['phases'][n]:.1f}" if n in r["phases"] else "" for n in names]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def handler(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    kwargs, env = llm_kwargs(args), child_env(args.env)
    rows = [run_once(kwargs, env, args.timeout) for _ in range(args.repeats)]
    print(
        "Start-up to ready, each run a fresh process (ready: seconds since the process "
        "started, from inside it; wall: spawn to ready as the parent saw it)\n"
    )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(llm=kwargs, env=args.env, runs=rows), f, indent=2)
    return 0
