"""Tensor parallelism with NCCL on 2 (or 4) GPUs: TP greedy output equals TP=1 (float32 weights,
so the comparison is not at the mercy of bf16 rounding), with decode CUDA graphs captured on
every rank (the all-reduces inside) and overlapped decode on, as a CUDA engine runs by default;
the eager path once; replicated kv heads (1 kv head at TP=2; 2 kv heads at TP=4 where 4 GPUs
are visible); MoE layers; NVLink multicast off; and a prompt, clean shutdown (every worker
exits with code 0 within SHUTDOWN_BOUND_S: a hang would be the 60 s join timeout)."""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch
from hf_models import SPECS_BY_NAME, build_model

from deltaserve import LLM, SamplingParams
from deltaserve.distributed.collective_bench import (
    AllReduceAgreement,
    ReduceNormAgreement,
    run_on_all_ranks,
)
from deltaserve.distributed.parallel_state import (
    MULTICAST_OFF_ENV,
    all_reduce_path,
    fused_norm_installed,
    small_all_reduce_installed,
    tp_size,
)
from deltaserve.distributed.symm_all_reduce import unavailable_reason

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs 2 CUDA devices",
    ),
]

PROMPT_LENS = (37, 5, 130)
SHUTDOWN_BOUND_S = 10.0


def _check_small_all_reduce(engine, tp: int) -> None:
    """Where every GPU reaches its peers, decode's all-reduces run in the one-shot kernel over
    symmetric memory (in the first TP engine of the process: the first test here; the TP check
    script runs each test in its own process), and its sums equal NCCL's exactly (two ranks:
    a + b either way); by default (not with DELTASERVE_TP_ALL_REDUCE=oneshot, which the TP
    check script runs the first test with too) so does the all-reduce fused with the residual
    add and RMSNorm, whose normed rows match NCCL + the reference norm to float32 rounding (the
    engine's run above went through it: every layer's blocks leave their sums to the norms)."""
    device = engine.runner.device
    if unavailable_reason(device, "nccl", tp) is not None:
        return
    if not small_all_reduce_installed():  # only the first TP engine of a process sets it up
        assert "an earlier tensor-parallel engine in this process" in all_reduce_path()
        return
    hidden = engine.config.model.text_config.hidden_size
    for rows in (1, 7, 64):
        task = AllReduceAgreement(rows, hidden, engine.config.model.dtype)
        diff = run_on_all_ranks(task, device)
        assert diff == 0.0 if tp == 2 else diff < 1e-5, (rows, diff)
    assert all(layer.mixer_partial for layer in engine.runner.instance.model.model.layers)
    fused = os.environ.get("DELTASERVE_TP_ALL_REDUCE", "auto") == "auto"
    assert fused_norm_installed() == fused, all_reduce_path()
    if not fused:
        return
    for rows in (1, 7, 64):
        task = ReduceNormAgreement(rows, hidden, engine.config.model.dtype)
        residual_diff, normed_diff = run_on_all_ranks(task, device)
        assert residual_diff == 0.0 if tp == 2 else residual_diff < 1e-5, (rows, residual_diff)
        assert normed_diff < 1e-4, (rows, normed_diff)


def _generate(model_dir, tp: int, prompts: list[list[int]], eager: bool = False) -> list[list[int]]:
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
        enforce_eager=eager,
        # the torch GDN prefill: fla's chunked kernels cost minutes of first-use autotuning on a
        # fresh machine (the whole part's limit on two H100s), and round float32 through TF32
        gdn_prefill_backend="torch",
    )
    procs = list(llm.llm_engine._tp_workers.processes) if tp > 1 else []
    try:
        engine = llm.llm_engine
        assert engine.config.async_scheduling  # on by default on CUDA, TP included
        if tp > 1:
            assert tp_size() == tp
            for name, value in MULTICAST_OFF_ENV.items():
                assert os.environ.get(name) == value, name
        graphs = engine.runner.graphs
        if eager:
            assert graphs is None
        else:
            assert graphs is not None and not graphs.emulate
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        if not eager:
            assert sum(graphs.replays.values()) > 0  # decode steps replayed graphs
        if tp > 1:
            _check_small_all_reduce(engine, tp)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        start = time.monotonic()
        llm.shutdown()
        for p in procs:
            p.join(max(0.0, SHUTDOWN_BOUND_S - (time.monotonic() - start)))
        elapsed = time.monotonic() - start
        del llm
        gc.collect()
        assert [p.exitcode for p in procs] == [0] * len(procs), [p.exitcode for p in procs]
        assert elapsed < SHUTDOWN_BOUND_S, f"shutdown took {elapsed:.1f} s"
        assert tp_size() == 1


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab - 4, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize(
    "spec_name",
    [
        # NOTE: not qwen3_g5: its head dim 24 leaves attention to the torch backend, which has
        # no CUDA graphs at any TP size (seen on 2 H200s: graphs None at TP=2 for that reason)
        "qwen3_5_r2_g3",
        "qwen3_g4_kv1",  # 1 kv head: replicated on both ranks
        "qwen3_5_moe_e12k4_g5_fused",  # MoE: expert slices per rank, one all-reduce per block
        "qwen3_next_e12k4_r3_step2_nonorm",  # MoE + dense layers, per-expert tensors
    ],
)
def test_tp2_nccl_graphs_and_overlap_match_tp1(tmp_path, spec_name: str) -> None:
    spec = SPECS_BY_NAME[spec_name]
    model_dir, _ = build_model(spec, tmp_path / spec_name, load_oracle=False)
    prompts = _prompts(spec.config["vocab_size"])
    assert _generate(model_dir, 2, prompts) == _generate(model_dir, 1, prompts)


def test_tp2_nccl_eager_matches_tp1(tmp_path) -> None:
    spec = SPECS_BY_NAME["qwen3_5_r2_g3"]
    model_dir, _ = build_model(spec, tmp_path / "m", load_oracle=False)
    prompts = _prompts(spec.config["vocab_size"])
    assert _generate(model_dir, 2, prompts, eager=True) == _generate(model_dir, 1, prompts)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
def test_tp4_replicated_kv_heads_match_tp1(tmp_path) -> None:
    spec = SPECS_BY_NAME["qwen3_g4_kv2"]  # 2 kv heads, each on 2 of the 4 ranks
    model_dir, _ = build_model(spec, tmp_path / "kv2", load_oracle=False)
    prompts = _prompts(spec.config["vocab_size"])
    assert _generate(model_dir, 4, prompts) == _generate(model_dir, 1, prompts)
