"""The residual add + RMSNorm in the first projection's GEMV at one-row decode steps
(ops/linear/triton_gemv_norm.py, DELTASERVE_NORM_GEMV=fused, the default) against the norm kernel
then the GEMV (`separate`), on the GPU (`pytest -m gpu`), bf16, batch-1 decode graphs: the same
greedy tokens (or, where they part, a near-tie in both runs' top two) and logprobs within bf16
rounding, for a dense Qwen3.5, a Qwen3.5-MoE (whose experts read the normalised row the GEMV
writes) and DeepSeek-V2 (MLA). The fused kernel must have been captured."""

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

MODELS = [
    ("qwen3_5_r2_g3", {}),
    ("qwen3_5_moe_e10k3_g3", {"moe_backend": "triton"}),
    ("deepseek_v2_qproj_greedy_yarn", {"moe_backend": "triton", "mla_backend": "triton"}),
]
LP_TOL = 0.05  # bf16: the fused statistics may differ from the norm kernel's in rstd's last bit


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[dict[int, float]]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    result = []
    for p in prompts:  # one at a time: batch-1 decode steps
        (out,) = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        c = out.outputs[0]
        steps = []
        for tok, pos in zip(c.token_ids, c.logprobs, strict=True):
            top = {t: lp.logprob for t, lp in pos.items()}
            top["chosen"] = tok
            steps.append(top)
        result.append(steps)
    return result


@pytest.mark.parametrize("name,backends", MODELS, ids=[n for n, _ in MODELS])
def test_norm_gemv_equals_norm_then_gemv(name, backends, tmp_path, monkeypatch) -> None:
    from deltaserve.ops.linear import triton_gemv_norm

    model_dir, _ = build_model(SPECS_BY_NAME[name], tmp_path / "m", load_oracle=False)
    prompts = [random_prompt(n, 200, seed) for seed, n in enumerate((9, 40))]
    real, calls = triton_gemv_norm.decode_gemv_add_norm, []

    def counted(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(triton_gemv_norm, "decode_gemv_add_norm", counted)
    outs = {}
    for mode in ("separate", "fused"):
        monkeypatch.setenv("DELTASERVE_NORM_GEMV", mode)
        calls.clear()
        llm = LLM(
            str(model_dir),
            device="cuda",
            dtype="bfloat16",
            max_model_len=256,
            max_num_seqs=1,
            block_size=16,
            skip_tokenizer_init=True,
            seed=0,
            attention_backend="triton",
            decode_gemm_backend="triton",
            **backends,
        )
        outs[mode] = _run(llm, prompts)
        assert bool(calls) == (mode == "fused"), (mode, len(calls))
        del llm
        torch.cuda.empty_cache()
    for want, got in zip(outs["separate"], outs["fused"], strict=True):
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            if w["chosen"] != g["chosen"]:  # only at a near-tie, and nothing compared after
                a, b = w["chosen"], g["chosen"]
                assert a in g and b in w, (i, w, g)
                assert abs(w[a] - w[b]) < LP_TOL and abs(g[a] - g[b]) < LP_TOL, (i, w, g)
                break
            t = w["chosen"]
            assert abs(w[t] - g[t]) < LP_TOL, (i, w, g)
