"""Profile speculative verify steps at forced acceptance beside plain decode steps (GPU machine).

python scripts/profile_spec.py [--random-model qwen3.5-9b] [--batch 1] [--tau 8] [-k 15]

Builds the engine as `deltaserve bench spec` does (random drafts, acceptance forced to tau - 1
drafts per step), then prints, for plain decode steps and for verify steps, the wall time per
step and the torch.profiler tables of the top kernels (CUDA time) and host ops (CPU time).
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-model", default="qwen3.5-9b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tau", type=int, default=8)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=15)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--rows", type=int, default=30, help="rows of each profiler table")
    args = ap.parse_args()

    from deltaserve.bench.spec import ForcedAcceptance, _register_bench_proposer
    from deltaserve.bench.synthetic import fill_caches, mark_context_computed
    from deltaserve.config import create_engine_config
    from deltaserve.engine.llm_engine import LLMEngine
    from deltaserve.sampling_params import SamplingParams

    _register_bench_proposer()
    k = args.num_speculative_tokens
    room = (k + 2) * (4 * args.steps + 16)
    config = create_engine_config(
        None,
        random_model=args.random_model,
        device="cuda",
        dtype="bfloat16",
        max_model_len=args.context + room,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(8192, args.batch * (k + 1)),
        speculative_config={"method": "bench_drafts", "num_speculative_tokens": k},
        enable_prefix_caching=False,
        attention_backend=args.attention_backend,
    )
    engine = LLMEngine(config)
    forced = ForcedAcceptance(engine.runner.logits)
    fill_caches(engine, 0)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=room, ignore_eos=True)
    rids = []
    for i in range(args.batch):
        prompt = torch.randint(3, engine.vocab_size - 3, (args.context,), generator=gen)
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt.tolist()}, params)
        rids.append(f"r{i}")
    mark_context_computed(engine, [engine.requests[r].seqs[0] for r in rids])
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for name, spec_k in (("plain decode", 0), (f"verify tau={args.tau}", k)):
        engine.spec.k = spec_k
        forced.accepted = max(args.tau - 1, 0)
        for _ in range(4):
            engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - t0) / args.steps
        print(f"== {name}: {ms:.3f} ms/step (batch {args.batch}, unprofiled)", flush=True)
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
        table = prof.key_averages()
        print(table.table(sort_by="cuda_time_total", row_limit=args.rows))
        print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows), flush=True)
    engine.abort_request(rids)


if __name__ == "__main__":
    main()
