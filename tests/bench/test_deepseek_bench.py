"""`bench throughput` on a DeepSeek-V2 model (`tiny-deepseek-v2`: MLA layers, group-limited
routing, 8 experts in 4 groups, 2 groups kept, top-3): it runs, its KV bytes per token are the
latent's, and the routing recorder routes by the block's own rule (group-limited), not greedy."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from deltaserve import LLM
from deltaserve.bench import floors
from deltaserve.bench.routing import RoutingRecorder
from deltaserve.cli import main

PRESET = "tiny-deepseek-v2"  # 3 layers (layer 0 dense), 8 experts top-3, 4 groups, 2 kept


class FixedLogits(nn.Module):
    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits


def test_recorder_routes_group_limited() -> None:
    """Row 0's best experts 0, 2, 4 lie in groups 0, 1, 2: group-limited keeps groups 0 and 1
    and takes {0, 2, 1}; row 1 likewise {0, 2, 3}. Distinct: 4 (greedy would count 3)."""
    llm = LLM(random_model=PRESET, device="cpu", dtype="float32", max_model_len=64, seed=0)
    model = llm.llm_engine.runner.model
    blocks = floors.moe_blocks(model)
    assert len(blocks) == 2
    logits = torch.zeros(2, 8)
    logits[:, [0, 2, 4]] = torch.tensor([10.0, 9.0, 8.0])
    logits[0, 1] = logits[1, 3] = 1.0
    for b in blocks:
        b.gate = FixedLogits(logits)
    with RoutingRecorder(model) as rec:
        for b in blocks:
            b.gate(torch.zeros(2, 64))
        rec.end_step()
    assert rec.mean_distinct() == [4.0, 4.0]


def test_bench_throughput_runs_on_mla(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "throughput", "--random-model", PRESET, "--device", "cpu",
            "--prefill-lens", "16", "--decode-batches", "3", "--contexts", "8",
            "--decode-steps", "2", "--warmup-steps", "1", "--repeats", "1",
            "--routing-steps", "2", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    costs = result["costs"]
    assert costs["kv_bytes_per_token"] == 3 * (32 + 8) * 4  # float32 latents, 3 layers
    _, decode = result["rows"]
    assert len(decode["distinct_experts"]) == 2
    assert all(3 <= n <= 8 for n in decode["distinct_experts"])
