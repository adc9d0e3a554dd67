"""MoE floors of `deltaserve bench throughput`: a decode step's floor counts exactly the bytes of
the distinct experts the step selected, per MoE layer, from its real routing (recorded on the
device), plus the dense weights, KV and state; the prefill floor counts the active parameters.

The routing is forced: each MoE block's router is replaced by one that returns fixed logits
whose top-k sets over the batch's rows cover exactly the chosen experts, so the expected bytes
are known in advance and written out here from the preset's shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from deltaserve import LLM, SamplingParams
from deltaserve.bench import floors
from deltaserve.bench.routing import RoutingRecorder, record_decode_routing
from deltaserve.cli import main
from deltaserve.loader.random_model import random_model_config

PRESET = "tiny-qwen3.5-moe"  # 4 layers, hidden 64, 8 experts top-2, expert width 32


class ForcedRouter(nn.Module):
    """Router logits [T, E] that put row t's top-k on `sets[t % len(sets)]`."""

    def __init__(self, num_experts: int, sets: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.num_experts, self.sets = num_experts, sets

        self._made: dict[tuple, torch.Tensor] = {}  # built once per shape: no syncs after that

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = (tuple(self.sets), x.shape[0], x.dtype, x.device)
        if key not in self._made:
            logits = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype)
            for t in range(x.shape[0]):
                for rank, e in enumerate(self.sets[t % len(self.sets)]):
                    logits[t, e] = 10.0 - rank  # distinct, far above the others
            self._made[key] = logits.to(x.device)
        return self._made[key]


def _llm() -> LLM:
    return LLM(
        random_model=PRESET,
        device="cpu",
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        seed=0,
    )


def _force(model: nn.Module, sets: list[tuple[int, ...]]) -> None:
    for block in floors.moe_blocks(model):
        block.gate = ForcedRouter(block.op_spec.num_experts, sets)


def _decoding(llm: LLM, batch: int) -> list:
    """`batch` sequences, prefilled and decoding, alone in the engine."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, detokenize=False)
    for i in range(batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(3, 10 + i))}, params)
    seqs = [engine.requests[f"r{i}"].seqs[0] for i in range(batch)]
    while not all(s.num_output_tokens >= 2 for s in seqs):
        engine.step()
    return seqs


def test_costs_split_dense_and_expert_bytes() -> None:
    llm = _llm()
    _, text, _ = random_model_config(PRESET)
    runner = llm.llm_engine.runner
    costs = floors.model_costs(runner.model, runner.specs, torch.float32, torch.float32)
    h, i, e, k, layers = 64, 32, 8, 2, 4
    assert (text.hidden_size, text.moe_intermediate_size, text.num_experts) == (h, i, e)
    assert costs.expert_bytes == (3 * h * i * 4,) * layers
    assert costs.num_experts == (e,) * layers and costs.top_k == (k,) * layers
    routed = layers * e * 3 * h * i
    assert costs.dense_streamed_weight_bytes == costs.streamed_weight_bytes - routed * 4
    assert costs.active_params == costs.num_params - layers * (e - k) * 3 * h * i
    dense, _ = floors.prefill_flops(costs, 100)
    assert dense == 2.0 * costs.active_params * 100
    with pytest.raises(ValueError, match="distinct experts"):
        floors.decode_step_bytes(costs, 4, 50.0)
    with pytest.raises(ValueError, match="9 distinct experts selected in a layer of 8"):
        floors.decode_step_bytes(costs, 4, 50.0, [9, 1, 1, 1])


@pytest.mark.parametrize(
    "sets, distinct",
    [
        ([(0, 1)], 2),  # every row the same pair
        ([(0, 1), (1, 2), (0, 2)], 3),
        ([(0, 1), (2, 3), (4, 5), (6, 7)], 8),  # every expert
    ],
)
def test_decode_floor_counts_the_selected_experts(sets, distinct: int) -> None:
    llm = _llm()
    runner = llm.llm_engine.runner
    _force(runner.model, sets)
    batch = 4
    seqs = _decoding(llm, batch)
    means = record_decode_routing(llm.llm_engine, seqs, steps=3)
    assert means == [float(distinct)] * 4

    costs = floors.model_costs(runner.model, runner.specs, torch.float32, torch.float32)
    context = 20.0
    one_expert = 3 * 64 * 32 * 4  # w13 [2I, H] + w2 [H, I], float32
    want = (
        costs.dense_streamed_weight_bytes
        + 4 * distinct * one_expert
        + batch * context * costs.kv_bytes_per_token
        + batch * 2 * costs.state_bytes_per_seq
    )
    assert floors.decode_step_bytes(costs, batch, context, means) == want
    floor = floors.decode_floor_tok_s(costs, batch, context, 1e9, means)
    assert floor == pytest.approx(batch / (want / 1e9))


def test_recorder_counts_each_step_apart() -> None:
    """Two steps selecting different experts: the mean of their counts, not their union."""
    model = _llm().llm_engine.runner.model
    _force(model, [(0, 1)])
    blocks = floors.moe_blocks(model)
    x = torch.randn(3, 64)
    with RoutingRecorder(model) as rec:
        for sets in ([(0, 1)], [(2, 3), (4, 5), (6, 7)]):
            for b in blocks:
                b.gate.sets = sets
                b.gate(x)
            rec.end_step()
    assert rec.mean_distinct() == [(2 + 6) / 2] * 4


def test_bench_throughput_reports_moe_floors(tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "throughput", "--random-model", PRESET, "--device", "cpu",
            "--prefill-lens", "16", "--decode-batches", "3", "--contexts", "8",
            "--decode-steps", "2", "--warmup-steps", "1", "--repeats", "1",
            "--routing-steps", "2", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    prefill, decode = result["rows"]
    costs = result["costs"]
    assert prefill["flops_params"] == 2.0 * costs["active_params"] * 16
    distinct = decode["distinct_experts"]
    assert len(distinct) == 4 and all(2 <= n <= 6 for n in distinct)  # 3 tokens, top-2 of 8
    weights = costs["dense_streamed_weight_bytes"] + sum(
        n * b for n, b in zip(distinct, costs["expert_bytes"])
    )
    assert decode["weight_bytes_streamed"] == pytest.approx(weights)
    assert decode["step_bytes"] > weights
    assert decode["floor_tok_s"] == pytest.approx(
        3 / (decode["step_bytes"] / result["ceilings"]["copy_bytes_per_s"])
    )
    stdout = capsys.readouterr().out
    assert "distinct experts/layer" in stdout and "MoE decode floor" in stdout


def test_recording_runs_outside_every_cuda_graph(monkeypatch) -> None:
    """A graph replay would hide the routers' calls from the recorder: while it records, the
    runner has neither its decode graphs nor the piecewise graphs of short eager steps (emulated
    on CPU), and both are back after."""
    monkeypatch.setenv("DELTASERVE_EMULATE_CUDA_GRAPHS", "1")
    monkeypatch.setenv("DELTASERVE_PIECEWISE_GRAPH_TOKENS", "32")
    llm = _llm()
    instance = llm.llm_engine.runner.instance
    graphs, piecewise = instance.graphs, instance.piecewise
    assert graphs is not None and piecewise is not None
    _force(llm.llm_engine.runner.model, [(0, 1), (1, 2), (0, 2)])
    seqs = _decoding(llm, 4)
    seen: list[tuple] = []
    step = llm.llm_engine.step

    def step_and_look():
        seen.append((instance.graphs, instance.piecewise))
        return step()

    monkeypatch.setattr(llm.llm_engine, "step", step_and_look)
    assert record_decode_routing(llm.llm_engine, seqs, steps=2) == [3.0] * 4
    assert seen == [(None, None)] * 2
    assert instance.graphs is graphs and instance.piecewise is piecewise
