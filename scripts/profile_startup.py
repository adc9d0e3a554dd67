"""Where start-up goes: time an engine's construction from before its import (GPU machine).

python scripts/profile_startup.py [--random-model qwen3.5-9b] [--cprofile FILE] [--top N]
Prints the seconds to import deltaserve, to build the engine (up to and including its warm-up)
and the whole, then, with --cprofile, the top functions by cumulative time (`deltaserve bench
startup` times fresh processes without a profiler). Run it under
`python -X importtime` (stderr) for the imports' own tree.

NOTE: the GPU machines set PYTHONDONTWRITEBYTECODE=1, so every start there compiles the Python
source of torch, transformers and fla-core again (`builtins.compile` in the profile); run it
under `env -u PYTHONDONTWRITEBYTECODE` twice to time a start with bytecode caches, as an
installed package has them.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

T0 = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-model", default="qwen3.5-9b")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--cprofile", default=None, help="write the cProfile stats here")
    ap.add_argument("--top", type=int, default=45)
    args = ap.parse_args()
    prof = cProfile.Profile() if args.cprofile else None
    if prof is not None:
        prof.enable()
    t_import = time.perf_counter()
    from deltaserve import LLM

    t_built = time.perf_counter()
    llm = LLM(
        random_model=args.random_model,
        dtype="bfloat16",
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
    )
    t_end = time.perf_counter()
    if prof is not None:
        prof.disable()
    print(
        f"start-up: import {t_built - t_import:.2f} s, engine {t_end - t_built:.2f} s, "
        f"script total {t_end - T0:.2f} s"
    )
    phases = llm.llm_engine.startup_phases
    print("phases: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()))
    if prof is not None:
        prof.dump_stats(args.cprofile)
        stats = pstats.Stats(prof).sort_stats("cumulative")
        stats.print_stats(args.top)
        stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
