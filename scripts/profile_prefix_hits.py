"""Profile prefills that hit the hybrid prefix cache, as chat turns do (GPU machine).

python scripts/profile_prefix_hits.py [--random-model qwen3.5-9b] [--conversations 16]

Turn 1 sends `--conversations` prompts of a shared system prompt plus a distinct user message
and generates answers; each later turn sends every conversation's history (prompt, answer as
token ids, a new user message) for one token, timed: all conversations at once, then one alone.
The last turn runs under torch.profiler (all together, or with --profile-alone the one
conversation alone): the top kernels by CUDA time and host ops by CPU time.
Set DELTASERVE_RUNTIME_STATS=1 DELTASERVE_RUNTIME_STATS_INTERVAL=1 for per-step phase times.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-model", default="qwen3.5-9b")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument(
        "--profile-alone",
        action="store_true",
        help="profile the last turn's one-conversation-alone prefill instead of all together",
    )
    ap.add_argument(
        "--server-order",
        action="store_true",
        help="each later turn as a server sees it: right after the answers' decode, the first "
        "conversation's new prompt alone, then the others together (--profile-alone: the first)",
    )
    ap.add_argument(
        "--cprofile",
        action="store_true",
        help="also run the last turn's one-conversation-alone prefill under cProfile (host time)",
    )
    ap.add_argument("--cprofile-out", help="with --cprofile: also dump the pstats to this file")
    args = ap.parse_args()
    from deltaserve import LLM, SamplingParams

    llm = LLM(
        random_model=args.random_model,
        dtype="bfloat16",
        max_model_len=8192,
        attention_backend=args.attention_backend,
    )
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 50000, (n,), generator=gen).tolist()

    def timed(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    def first_token(prompts: list[list[int]], prof: torch.profiler.profile | None) -> float:
        """Seconds to the first token of `prompts`, under `prof` when given."""
        with prof if prof is not None else contextlib.nullcontext():
            seconds, _ = timed(prompts, 1)
        return seconds

    system = tokens(args.system_len)
    histories = [system + tokens(args.input_len) for _ in range(args.conversations)]
    seconds, answers = timed(histories, args.output_len)
    print(f"turn 1: {seconds:.2f} s for {args.conversations} conversations (warm-up)", flush=True)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for turn in range(2, args.turns + 1):
        histories = [h + a + tokens(args.input_len) for h, a in zip(histories, answers)]
        last = turn == args.turns
        prof = torch.profiler.profile(activities=acts) if last else None
        # the one-conversation step or the others' under the profiler (none before the last)
        alone_prof, together_prof = (prof, None) if args.profile_alone else (None, prof)
        if args.server_order:
            first = first_token(histories[:1], alone_prof)
            rest = first_token(histories[1:], together_prof)
            print(
                f"turn {turn}: first conversation alone {1e3 * first:.1f} ms, then the other "
                f"{len(histories) - 1} together {1e3 * rest:.1f} ms (prompt {len(histories[0])})",
                flush=True,
            )
        else:
            together = first_token(histories, together_prof)
            alone = first_token([histories[0] + tokens(args.input_len)], alone_prof)
            if last and args.cprofile:
                host = cProfile.Profile()
                host.enable()
                timed([histories[0] + tokens(args.input_len)], 1)
                host.disable()
                if args.cprofile_out:
                    host.dump_stats(args.cprofile_out)
                for key in ("cumulative", "tottime"):
                    buf = io.StringIO()
                    pstats.Stats(host, stream=buf).sort_stats(key).print_stats(args.rows)
                    print(buf.getvalue(), flush=True)
            print(
                f"turn {turn}: first token of all {args.conversations} together "
                f"{1e3 * together:.1f} ms; one conversation alone {1e3 * alone:.1f} ms (prompt "
                f"{len(histories[0])} tokens)",
                flush=True,
            )
        if prof is not None:
            table = prof.key_averages()
            print(table.table(sort_by="cuda_time_total", row_limit=args.rows))
            print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows), flush=True)
        _, answers = timed(histories, args.output_len)  # the answers the next turn extends


if __name__ == "__main__":
    main()
