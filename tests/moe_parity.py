"""Shared pieces of the MoE parity tests (Qwen3.5-MoE, Qwen3-Next): the engine under test, the
oracle's routing, prefill logprobs against HF's uncached forward and greedy continuations
against HF's generate."""

from __future__ import annotations

from pathlib import Path

import torch

from deltaserve import LLM, SamplingParams

LOGPROB_ATOL = 1e-4
NUM_NEW_TOKENS = 24
PREFILL_LEN = 37
GREEDY_PROMPT_LENS = (37, 5, 130)


def record_rows(monkeypatch, owner, name: str) -> list[int]:  # noqa: ANN001
    """Wrap `owner.name` (a module's function or a class's method) for the test: each call
    appends its result's first dimension (its rows) to the returned list."""
    real = getattr(owner, name)
    rows: list[int] = []

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        got = real(*args, **kwargs)
        rows.append(got.shape[0])
        return got

    monkeypatch.setattr(owner, name, recording)
    return rows


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab - 4, (length,), generator=gen).tolist()


def make_llm(model_dir: Path, **overrides) -> LLM:
    kwargs = dict(
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enable_chunked_prefill=True,
        block_size=16,
        skip_tokenizer_init=True,
        seed=0,
    )
    kwargs.update(overrides)
    return LLM(str(model_dir), **kwargs)


def vocab_of(oracle) -> int:
    return oracle.config.get_text_config().vocab_size


def oracle_routes(oracle) -> list[torch.Tensor]:
    """The top-k expert ids [T, k] of every router of the oracle on the parity prompt."""
    routes: list[torch.Tensor] = []
    routers = [m for m in oracle.modules() if type(m).__name__.endswith("TopKRouter")]
    hooks = [r.register_forward_hook(lambda m, i, out: routes.append(out[2])) for r in routers]
    try:
        with torch.no_grad():
            oracle(torch.tensor([random_prompt(PREFILL_LEN, vocab_of(oracle), seed=11)]))
    finally:
        for h in hooks:
            h.remove()
    return routes


@torch.no_grad()
def prefill_max_diff(oracle, llm: LLM) -> tuple[float, torch.Tensor, list[int]]:
    """(max |prompt logprob - HF's|, HF's logprobs [P, vocab], the engine's one sampled token)."""
    vocab = vocab_of(oracle)
    prompt = random_prompt(PREFILL_LEN, vocab, seed=11)
    ref = torch.log_softmax(oracle(torch.tensor([prompt])).logits[0].float(), dim=-1)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=-1)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
    plp = out.prompt_logprobs
    ours = torch.full((PREFILL_LEN - 1, vocab), float("nan"))
    for p in range(1, PREFILL_LEN):
        ids = torch.tensor(list(plp[p].keys()))
        ours[p - 1, ids] = torch.tensor([lp.logprob for lp in plp[p].values()])
    diff = (ours - ref[: PREFILL_LEN - 1]).abs()
    assert not diff.isnan().any()
    return diff.max().item(), ref, list(out.outputs[0].token_ids)


@torch.no_grad()
def hf_greedy(oracle, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = oracle.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=NUM_NEW_TOKENS,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def check_greedy_matches_hf(name: str, model_dir: Path, oracle, llm: LLM) -> None:
    """24 greedy tokens equal HF's: one prompt at a time, the three in one batch, and the batch
    again under a 32-token budget (chunked prefill: the 130-token prompt in five chunks, mixed
    with the others' decodes)."""
    prompts = [random_prompt(n, vocab_of(oracle), seed=100 + n) for n in GREEDY_PROMPT_LENS]
    expected = [hf_greedy(oracle, p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
        assert list(out.outputs[0].token_ids) == expected[i], (name, "alone", i)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected, (name, "batched")
    chunked = make_llm(model_dir, max_num_batched_tokens=32)
    outs = chunked.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected, (name, "chunked")
