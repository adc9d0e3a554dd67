"""Profile one prefill and a few decode steps of a random-weight preset (GPU machine).

python scripts/profile_step.py [--random-model qwen3.5-9b] [--prompt-len 512] [--decode-batch B]
    [--tensor-parallel-size N] [--row-limit N] [--no-prefix-caching]
    [--prefix-snapshot-decode-interval N]
Prints the prefill time and the top kernels / ops by CUDA and by CPU time, then the decode
ms/step of B sequences and their top kernels / ops (torch.profiler tables on stdout). Under
tensor parallelism the tables are rank 0's (its host and its GPU; the ranks run in lockstep).
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-model", default="qwen3.5-9b")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--decode-gemm-backend", default="auto")
    ap.add_argument("--decode-batch", type=int, default=1, help="sequences in the decode steps")
    ap.add_argument("--skip-prefill-profile", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--row-limit", type=int, default=20, help="rows of each profiler table")
    ap.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="the decode requests' temperature (1: sampled, as `bench throughput` samples; 0: "
        "greedy, one argmax, as the peer harness decodes)",
    )
    ap.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="prefix caching off (`bench throughput` and the peer harness run without it; on, "
        "a hybrid model's decoding sequences copy their state into a trailing snapshot at "
        "block boundaries)",
    )
    ap.add_argument(
        "--prefix-snapshot-decode-interval",
        type=int,
        default=None,
        metavar="N",
        help="the engine's option of that name (default: every block)",
    )
    args = ap.parse_args()
    # NOTE: runtime stats sync the device at each phase, which defeats overlapped decode: the
    # decode ms/step printed is then the non-overlapped one. Off unless asked for.
    os.environ.setdefault("DELTASERVE_RUNTIME_STATS", "0")
    os.environ.setdefault("DELTASERVE_RUNTIME_STATS_INTERVAL", "10")
    from deltaserve import LLM, SamplingParams

    llm = LLM(
        random_model=args.random_model,
        dtype="bfloat16",
        max_model_len=max(4096, args.prompt_len + 256),
        max_num_seqs=max(4, args.decode_batch),
        attention_backend=args.attention_backend,
        decode_gemm_backend=args.decode_gemm_backend,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_prefix_caching=not args.no_prefix_caching,
        prefix_snapshot_decode_interval=args.prefix_snapshot_decode_interval,
    )
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(0)

    def prompt() -> dict:
        return {
            "prompt_token_ids": torch.randint(0, 1000, (args.prompt_len,), generator=gen).tolist()
        }

    one = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate([prompt()], one, use_tqdm=False)  # warm-up (compiles, autotunes)
    llm.generate([prompt()], one, use_tqdm=False)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    if not args.skip_prefill_profile:
        with torch.profiler.profile(activities=acts) as prof:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate([prompt()], one, use_tqdm=False)
            torch.cuda.synchronize()
            print(f"prefill {args.prompt_len}: {1e3 * (time.perf_counter() - t0):.2f} ms")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.row_limit))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.row_limit))

    B = args.decode_batch
    long = SamplingParams(
        max_tokens=10_000, ignore_eos=True, detokenize=False, temperature=args.temperature
    )
    for i in range(B):
        engine.add_request(f"d{i}", prompt(), long)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.decode_steps):
        engine.step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.decode_steps
    print(f"decode B={B}: {1e3 * dt:.3f} ms/step ({B / dt:.1f} tok/s)")
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.row_limit))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.row_limit))
    engine.abort_request([f"d{i}" for i in range(B)])


if __name__ == "__main__":
    main()
