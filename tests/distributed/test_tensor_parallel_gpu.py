"""Tensor parallelism with NCCL on 2 GPUs: TP=2 greedy output equals TP=1 (float32 weights, so
the comparison is not at the mercy of bf16 rounding), and NVLink multicast stays off."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from hf_models import SPECS_BY_NAME, build_model

from deltaserve import LLM, SamplingParams
from deltaserve.distributed.parallel_state import MULTICAST_OFF_ENV, tp_size

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs 2 CUDA devices",
    ),
]

PROMPT_LENS = (37, 5, 130)


def _generate(model_dir, tp: int, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cuda",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.3,
        tensor_parallel_size=tp,
    )
    try:
        if tp > 1:
            assert tp_size() == tp
            for name, value in MULTICAST_OFF_ENV.items():
                assert os.environ.get(name) == value, name
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        procs = list(llm.llm_engine._tp_workers.processes) if tp > 1 else []
        llm.shutdown()
        del llm
        gc.collect()
        assert all(not p.is_alive() and p.exitcode == 0 for p in procs)


@pytest.mark.parametrize(
    "spec_name",
    [
        "qwen3_g5",
        "qwen3_5_r2_g3",
        "qwen3_5_r1_g1_tied",
        "qwen3_5_moe_e12k4_g5_fused",  # MoE: expert slices per rank, one all-reduce per block
        "qwen3_next_e12k4_r3_step2_nonorm",  # MoE + dense layers, per-expert tensors
    ],
)
def test_tp2_nccl_matches_tp1(tmp_path, spec_name: str) -> None:
    spec = SPECS_BY_NAME[spec_name]
    model_dir, _ = build_model(spec, tmp_path / spec_name, load_oracle=False)
    gen = torch.Generator().manual_seed(7)
    vocab = spec.config["vocab_size"]
    prompts = [torch.randint(3, vocab - 4, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    assert _generate(model_dir, 2, prompts) == _generate(model_dir, 1, prompts)
