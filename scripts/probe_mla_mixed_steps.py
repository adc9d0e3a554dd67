"""Time long prompts prefilled beside running decodes on an MLA preset (GPU machine): the
mixed steps of `DELTASERVE_MLA_PREFILL` (expanded prefill rows beside absorbed decode rows, or
the whole step absorbed).

python scripts/probe_mla_mixed_steps.py [--random-model deepseek-v2-lite] [--mla-backend triton]
    [--prompts 8] [--prompt-len 8192] [--max-tokens 64] [--repeats 2]
All prompts go in at once with a token budget of one prompt a step, so after the first step
every step carries one prompt's chunk beside the decode rows of the prompts before it. Prints
the wall time of each repeat (after one warm-up of the same shape), prompt and output tok/s,
and how many layer calls ran a mixed step's decode rows alone (`decode_rows`: the prefill rows
beside them expanded). Run it once per DELTASERVE_MLA_PREFILL value (the layers read it when
they are built).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-model", default="deepseek-v2-lite")
    ap.add_argument("--mla-backend", default="triton")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None, help="save the figures here")
    args = ap.parse_args()
    from deltaserve import LLM, SamplingParams

    llm = LLM(
        random_model=args.random_model,
        dtype="bfloat16",
        max_model_len=args.prompt_len + args.max_tokens + 16,
        max_num_seqs=args.prompts,
        max_num_batched_tokens=args.prompt_len,
        enable_prefix_caching=False,
        mla_backend=args.mla_backend,
    )
    mla = llm.llm_engine.runner.instance.backends["mla"]
    calls = {"decode_rows": 0}
    inner = mla.decode_rows

    def counted(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls["decode_rows"] += 1
        return inner(*a, **k)

    mla.decode_rows = counted
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0)

    def batch() -> list[dict]:
        return [
            {"prompt_token_ids": torch.randint(0, 1000, (args.prompt_len,), generator=gen).tolist()}
            for _ in range(args.prompts)
        ]

    llm.generate(batch(), params, use_tqdm=False)  # warm-up: compiles, autotunes
    times = []
    for _ in range(args.repeats):
        calls["decode_rows"] = 0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(batch(), params, use_tqdm=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    best = min(times)
    result = {
        "model": args.random_model,
        "mla_backend": mla.name,
        "mla_prefill": os.environ.get("DELTASERVE_MLA_PREFILL", "auto") or "auto",
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "seconds": times,
        "prompt_tok_s": args.prompts * args.prompt_len / best,
        "output_tok_s": args.prompts * args.max_tokens / best,
        "decode_rows_calls": calls["decode_rows"],
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
