"""The MoE routing recorder on a GPU: it never syncs the device (CUDA sync debug mode set to
error around the recording), and a bench decode step's recorded routing on CUDA counts the
forced experts, as on CPU (tests/bench/test_moe_floors.py)."""

from __future__ import annotations

import pytest
import torch
from test_moe_floors import _decoding, _force

from deltaserve import LLM
from deltaserve.bench import floors
from deltaserve.bench.routing import RoutingRecorder, record_decode_routing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _cuda_llm() -> LLM:
    return LLM(
        random_model="tiny-qwen3.5-moe",
        device="cuda",
        dtype="bfloat16",
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        gpu_memory_utilization=0.3,
        seed=0,
    )


def test_recorder_does_not_sync() -> None:
    model = _cuda_llm().llm_engine.runner.model
    _force(model, [(0, 1)])
    blocks = floors.moe_blocks(model)
    x = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)
    for sets in ([(0, 1)], [(2, 3), (4, 5)]):  # the forced logits are built (synced) once here
        for b in blocks:
            b.gate.sets = sets
            b.gate(x)
    with RoutingRecorder(model) as rec:
        torch.cuda.set_sync_debug_mode("error")
        try:
            for sets in ([(0, 1)], [(2, 3), (4, 5)]):
                for b in blocks:
                    b.gate.sets = sets
                    b.gate(x)
                rec.end_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert rec.mean_distinct() == [(2 + 4) / 2] * len(blocks)


def test_bench_routing_on_cuda_counts_the_forced_experts() -> None:
    llm = _cuda_llm()
    _force(llm.llm_engine.runner.model, [(0, 1), (1, 2), (0, 2)])
    seqs = _decoding(llm, 4)
    assert record_decode_routing(llm.llm_engine, seqs, steps=3) == [3.0] * 4
