"""Fewer attention kv heads than tensor-parallel ranks: each kv head is replicated on the ranks
whose query heads read it. On CPU over gloo: 2 kv heads (8 q heads) at TP=4, each kv head on
2 ranks, gives TP=1's greedy tokens and logprobs."""

from __future__ import annotations

import gc
import re

import pytest
import torch
from hf_models import SPECS_BY_NAME, build_model

from deltaserve import LLM, SamplingParams
from deltaserve.distributed.sharding import ShardRule, kv_head_replicas

PROMPT_LENS = (23, 6, 41)


def _run(model_dir, tp: int, prompts: list[list[int]]):
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        max_model_len=128,
        max_num_seqs=4,
        block_size=16,
        skip_tokenizer_init=True,
        seed=0,
        tensor_parallel_size=tp,
    )
    procs = list(llm.llm_engine._tp_workers.processes) if tp > 1 else []
    try:
        if tp > 1:  # this rank's cache: one kv head (of the model's 2), two q heads (of 8)
            (spec, *_) = [s for s in llm.llm_engine.runner.specs if s.layer_kind == "attention"]
            assert (spec.num_heads, spec.num_kv_heads) == (8 // tp, 1)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    assert [p.exitcode for p in procs] == [0] * (tp - 1)
    return [o.outputs[0] for o in outs]


def test_tp4_with_two_kv_heads_matches_tp1(tmp_path) -> None:
    spec = SPECS_BY_NAME["qwen3_g4_kv2"]
    model_dir, _ = build_model(spec, tmp_path / "m", load_oracle=False)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    ref = _run(model_dir, 1, prompts)
    ours = _run(model_dir, 4, prompts)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert list(a.token_ids) == list(b.token_ids), f"prompt {i}"
        for lp_a, lp_b in zip(a.logprobs, b.logprobs):
            assert lp_a.keys() == lp_b.keys()
            for tok in lp_a:
                assert abs(lp_a[tok].logprob - lp_b[tok].logprob) < 1e-4


def test_kv_head_replicas_and_rule() -> None:
    assert kv_head_replicas(8, 4) == 1
    assert kv_head_replicas(4, 8) == 2
    assert kv_head_replicas(1, 2) == 2
    with pytest.raises(ValueError, match=re.escape("num_key_value_heads (4)")):
        kv_head_replicas(4, 6)
    # 2 kv heads of 3 rows at TP=4: ranks 0, 1 hold head 0, ranks 2, 3 head 1
    rows = torch.arange(6)
    rule = ShardRule(0, (6,), replicas=2)
    assert rule.local_size(4) == 3
    assert [rule.slice(rows, r, 4).tolist() for r in range(4)] == [
        [0, 1, 2],
        [0, 1, 2],
        [3, 4, 5],
        [3, 4, 5],
    ]


def test_kv_heads_that_neither_divide_fail_at_start_up(tmp_path) -> None:
    from types import SimpleNamespace

    from deltaserve.distributed.sharding import check_tp_shapes

    with pytest.raises(ValueError, match=re.escape("num_key_value_heads (4)")):
        check_tp_shapes(SimpleNamespace(num_attention_heads=24, num_key_value_heads=4), 6)
    check_tp_shapes(SimpleNamespace(num_attention_heads=24, num_key_value_heads=4), 8)
