"""Speculative decoding on the GPU with the fast kernels (Triton conv1d, GDN decode and the GDN
replay of the rollback; plain decode steps in CUDA graphs, verify steps eager): stub proposers
give the output of decoding without speculation (`pytest -m gpu`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stub_proposers  # noqa: E402,F401

from deltaserve import LLM, SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[5, 17, 3, 44, 9, 12, 31], [11, 4, 9, 33, 21, 6, 7, 19, 28, 40, 3], [8, 8, 21, 30, 2]]


def make_llm(spec=None, enforce_eager=False):
    return LLM(
        enforce_eager=enforce_eager,
        random_model="tiny-qwen3.5",
        dtype="float32",
        device="cuda",
        max_model_len=256,
        max_num_seqs=8,
        seed=0,
        speculative_config=spec,
        async_scheduling=None if spec is None else False,
    )


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("method,extra", [("oracle", {}), ("anti_oracle", {}),
                                          ("truncated_oracle", {"j": 5})])  # fmt: skip
def test_gpu_speculation_gives_the_plain_output(method, extra, eager):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    plain = make_llm()
    want = [list(o.outputs[0].token_ids) for o in plain.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]  # fmt: skip
    decisions = plain.llm_engine.runner.backend_decisions
    del plain
    spec = {
        "method": method,
        "num_speculative_tokens": 15,
        "continuations": [(tuple(p), w) for p, w in zip(PROMPTS, want, strict=True)],
        **extra,
    }
    llm = make_llm(spec, eager)
    runner = llm.llm_engine.runner
    assert runner.backend_decisions["gdn_replay"].chosen.name == "triton"
    if not eager:  # verify steps (q = 16) replay graphs with the GDN scratch inside
        assert runner.graphs is not None and runner.graphs.query_lens == (1, 16)
        replays = []
        inner = runner.instance.replay
        runner.instance.replay = lambda *a: replays.append(a[2].decode_query_len) or inner(*a)
    assert decisions["gdn_decode"].chosen.name == "triton"
    got = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]  # fmt: skip
    assert got == want
    assert llm.llm_engine.spec.stats.num_verify_rows > 0
    if not eager:
        assert 16 in replays
