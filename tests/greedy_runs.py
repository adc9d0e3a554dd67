"""A tiny model's greedy tokens and logprobs, for the tests that switch a kernel path on and
check that nothing changes (importable from any test directory: `from greedy_runs import
greedy_run`)."""

from __future__ import annotations

from pathlib import Path

from kernel_helpers import kernel_device

from deltaserve import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [3 + i, 9, 17, 4 + 2 * i, 30 - i]} for i in range(3)]


def greedy_run(model_dir: Path, max_tokens: int = 6, **llm_kwargs) -> list[tuple]:
    """[(token ids, their logprobs)] per prompt of PROMPTS: fp16 on CPU (the kernel device),
    greedy, `llm_kwargs` on top (backends); the engine is shut down after."""
    llm = LLM(
        str(model_dir),
        **{
            "dtype": "float16",
            "device": str(kernel_device()),
            "max_model_len": 64,
            "skip_tokenizer_init": True,
            "seed": 0,
            **llm_kwargs,
        },
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [
        (c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
        for c in (o.outputs[0] for o in outs)
    ]
