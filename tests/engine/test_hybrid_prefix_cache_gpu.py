"""Hybrid prefix caching on the GPU (`pytest -m gpu`): the fast backends (FLA chunked GDN
prefill from a restored initial state, Triton decode and conv), decode CUDA graphs and
overlapped decode, float32. A hit equals a miss (caching off, same device and backends) token
for token, and in logprobs within 1e-3 (the chunked kernels split the recurrence elsewhere);
the pools are back to full after every run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_models import SPECS_BY_NAME, build_model  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BLOCK = 16
TOL = 1e-2


def _llm(model_dir: Path, **kw) -> LLM:
    args = dict(
        device="cuda",
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        block_size=BLOCK,
        skip_tokenizer_init=True,
        seed=0,
    )
    args.update(kw)
    return LLM(str(model_dir), **args)


def _run(llm: LLM, prompts, logprobs: bool):
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, logprobs=0 if logprobs else None
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        lps = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids)] if logprobs else []
        result.append((list(c.token_ids), lps))
    return result


def _full(llm: LLM) -> None:
    for pool in llm.llm_engine.scheduler.pools:
        assert pool.num_used == 0, pool.kind


@pytest.mark.parametrize("name", ["qwen3_5_r2_g3", "qwen3_5_r1_g1_tied"])
@pytest.mark.parametrize("logprobs", [True, False], ids=["logprobs", "overlapped"])
def test_gpu_hit_equals_miss(name, logprobs, tmp_path):
    model_dir, _ = build_model(SPECS_BY_NAME[name], tmp_path / name, load_oracle=False)
    vocab = SPECS_BY_NAME[name].config["vocab_size"]
    gen = torch.Generator().manual_seed(3)
    system = torch.randint(3, vocab - 4, (150,), generator=gen).tolist()
    users = [torch.randint(3, vocab - 4, (n,), generator=gen).tolist() for n in (9, 13, 21)]
    ref = _llm(model_dir, enable_prefix_caching=False)
    llm = _llm(model_dir, prefix_snapshot_interval=64)
    chunked = _llm(model_dir, max_num_batched_tokens=16)

    # three conversations sharing the system prompt, three turns each, turn by turn batched
    histories = [list(system) for _ in users]
    for turn in range(3):
        prompts = [h + u[: 5 + turn] for h, u in zip(histories, users)]
        want = _run(ref, prompts, logprobs)
        for engine in (llm, chunked):
            got = _run(engine, prompts, logprobs)
            for (g_tok, g_lp), (w_tok, w_lp) in zip(got, want):
                assert g_tok == w_tok, f"turn {turn + 1}"
                assert all(abs(a - b) <= TOL for a, b in zip(g_lp, w_lp)), f"turn {turn + 1}"
            _full(engine)
        histories = [p + tokens for p, (tokens, _) in zip(prompts, want)]
    for engine in (llm, chunked):
        stats = engine.llm_engine.prefix_cache_stats()
        assert stats["prefix_cache_hits"] >= 6, stats  # turns 2 and 3 at least
