"""Piecewise CUDA graphs on the GPU (`pytest -m gpu`): captured pieces replayed around the fast
backends' cores (Triton attention, conv, GDN and MLA kernels; the Triton MoE kernels inside the
graphs) equal the eager forward (the pieces off, same device and backends) token for token and
in logprobs, with batched and chunked prefill, decode rows beside prefill rows and prefix-cache
hits; the pools are back to full."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_models import SPECS_BY_NAME, build_model  # noqa: E402
from test_invariants import random_prompt  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = 1e-3  # float32; the buckets' padded GEMMs may sum in another order than the eager ones


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append(
            (list(c.token_ids), [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids)])
        )
    return result


MODELS = [
    ("qwen3_5_r2_g3", {}),
    ("qwen3_g4_kv2", {}),
    ("qwen3_5_moe_e10k3_g3", {"moe_backend": "triton"}),
    ("deepseek_v2_qproj_greedy_yarn", {"moe_backend": "triton", "mla_backend": "triton"}),
]


@pytest.mark.parametrize("name,backends", MODELS, ids=[n for n, _ in MODELS])
def test_piecewise_graphs_equal_eager_on_gpu(name, backends, tmp_path, monkeypatch) -> None:
    model_dir, _ = build_model(SPECS_BY_NAME[name], tmp_path / "m", load_oracle=False)
    prompts = [random_prompt(n, 200, seed) for seed, n in enumerate((17, 33, 150, 90, 300))]
    prompts.append(prompts[2][:128] + random_prompt(20, 200, 9))  # a prefix-cache hit
    outs = {}
    for tokens in ("0", "256"):
        monkeypatch.setenv("DELTASERVE_PIECEWISE_GRAPH_TOKENS", tokens)
        llm = LLM(
            str(model_dir),
            device="cuda",
            dtype="float32",
            max_model_len=512,
            max_num_seqs=4,
            max_num_batched_tokens=200,
            block_size=16,
            skip_tokenizer_init=True,
            seed=0,
            attention_backend="triton",
            **backends,
        )
        outs[tokens] = _run(llm, prompts[:4]) + _run(llm, prompts[4:])
        pw = llm.llm_engine.runner.instance.piecewise
        if tokens == "0":
            assert pw is None
        else:
            assert pw is not None and not pw.emulate and sum(pw.replays.values()) > 0
        for pool in llm.llm_engine.scheduler.pools:
            assert pool.num_used == 0, pool.kind
        del llm
        torch.cuda.empty_cache()
    for (want_ids, want_lps), (got_ids, got_lps) in zip(outs["0"], outs["256"], strict=True):
        assert got_ids == want_ids
        assert max(abs(a - b) for a, b in zip(want_lps, got_lps)) < TOL
