"""`deltaserve bench throughput`: floor arithmetic against hand-computed figures (generic over
cache specs), the ceilings the floors divide by, and tiny CPU runs of the whole command (real and
synthetic decode contexts)."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from deltaserve.bench import floors
from deltaserve.bench.throughput import format_table
from deltaserve.bench.timing import capacity_reason
from deltaserve.cache.spec import CacheSpec
from deltaserve.cli import main
from deltaserve.config import create_engine_config
from deltaserve.loader.random_model import random_model_config
from deltaserve.models.registry import get_model_class


def _costs(name: str, dtype=torch.bfloat16, state_dtype=torch.float32) -> floors.ModelCosts:
    hf, text, arch = random_model_config(name)
    with torch.device("meta"):
        model = get_model_class(arch)(text, tie_word_embeddings=hf.tie_word_embeddings)
    return floors.model_costs(model, model.layer_specs(), dtype, state_dtype)


def test_nine_b_floors_match_hand_computed_bytes() -> None:
    """Qwen3.5-9B shape, bf16, fp32 state: 24 GDN + 8 attention layers."""
    c = _costs("qwen3.5-9b")
    assert c.num_params == 8_953_803_264
    embed = 248_320 * 4096
    assert c.embedding_params == embed and not c.tied
    assert c.streamed_weight_bytes == (8_953_803_264 - embed) * 2 == 15_873_369_088
    assert c.kv_bytes_per_token == 8 * 2 * 4 * 256 * 2  # layers x (K, V) x kv heads x D x bf16
    assert c.ssm_state_bytes_per_seq == 24 * 32 * 128 * 128 * 4  # HV x V x K x fp32
    conv_dim = 2 * 16 * 128 + 32 * 128
    assert c.conv_state_bytes_per_seq == 24 * conv_dim * 3 * 2  # (kernel - 1) x bf16
    # batch 16 at context 512: weights + 16 x 512 tokens of KV + 16 states read and written
    expected = 15_873_369_088 + 16 * 512 * 32_768 + 16 * 2 * (50_331_648 + 1_179_648)
    assert floors.decode_step_bytes(c, 16, 512) == expected == 17_790_166_016
    assert floors.decode_floor_tok_s(c, 16, 512) == pytest.approx(16 * 4.27e12 / expected)
    # at the H200's 4.27 TB/s: ~267 tok/s at batch 1 and ~3,850 at batch 16, context 512
    assert round(floors.decode_floor_tok_s(c, 1, 512)) == 267
    assert 3800 < floors.decode_floor_tok_s(c, 16, 512) < 3900
    dense, attention = floors.prefill_flops(c, 512)
    assert dense == 2 * 8_953_803_264 * 512
    assert attention == 8 * 2 * (16 * 256) * 512 * 513  # QK^T + PV over the causal triangle
    assert floors.prefill_floor_tok_s(c, 512) == pytest.approx(512 / ((dense + attention) / 773e12))
    assert 42_000 < floors.prefill_floor_tok_s(c, 512) < 44_000  # at 773 TFLOP/s: ~42 k tok/s


def test_tied_embedding_is_streamed_and_bf16_state_halves_ssm_bytes() -> None:
    c = _costs("qwen3.5-0.8b", state_dtype=torch.bfloat16)
    assert c.tied
    assert c.streamed_weight_bytes == c.weight_bytes == 2 * c.num_params
    assert c.ssm_state_bytes_per_seq == 18 * 16 * 128 * 128 * 2
    q = _costs("qwen3-0.6b")
    assert q.state_bytes_per_seq == 0
    assert q.kv_bytes_per_token == 28 * 2 * 8 * 128 * 2
    assert floors.decode_step_bytes(q, 4, 100) == q.streamed_weight_bytes + 4 * 100 * 114_688


@dataclass(frozen=True)
class _LatentSpec(CacheSpec):
    """An MLA-like paged spec: one latent of `dim` per token, plus a rope key of `rope_dim`."""

    pool: ClassVar[str] = "paged"
    layer_kind: ClassVar[str] = "mla"
    num_heads: int
    head_dim: int
    dim: int
    rope_dim: int

    def tensors(self, num_units, block_size, dtype, state_dtype):
        return {
            "latent": ((num_units, block_size, self.dim), dtype),
            "k_rope": ((num_units, block_size, self.rope_dim), dtype),
        }


@dataclass(frozen=True)
class _SlotSpec(CacheSpec):
    """A per-sequence state under names the costs do not know: counted in the slot bytes only."""

    pool: ClassVar[str] = "slots"
    layer_kind: ClassVar[str] = "other"
    width: int

    def tensors(self, num_units, block_size, dtype, state_dtype):
        return {"h": ((num_units, self.width), state_dtype), "c": ((num_units, 3), dtype)}


@dataclass(frozen=True)
class _OddPoolSpec(CacheSpec):
    pool: ClassVar[str] = "ring"

    def tensors(self, num_units, block_size, dtype, state_dtype):
        return {"x": ((num_units, 1), dtype)}


def _tiny_lm() -> torch.nn.Module:
    lm = torch.nn.Module()
    lm.model = torch.nn.Module()
    lm.model.embed_tokens = torch.nn.Embedding(10, 4)
    lm.lm_head = torch.nn.Linear(4, 10, bias=False)
    return lm


def test_costs_follow_each_specs_pool_not_its_class() -> None:
    """Paged specs cost bytes per cached token, slot specs bytes per sequence, whatever their
    class and tensor names; query heads add attention FLOPs."""
    specs = [_LatentSpec(num_heads=3, head_dim=8, dim=16, rope_dim=4), _SlotSpec(width=5)]
    c = floors.model_costs(_tiny_lm(), specs, torch.bfloat16, torch.float32)
    assert c.num_params == 80 and c.streamed_weight_bytes == 40 * 2
    assert c.kv_bytes_per_token == (16 + 4) * 2
    assert c.state_bytes_per_seq == 5 * 4 + 3 * 2
    assert c.ssm_state_bytes_per_seq == c.conv_state_bytes_per_seq == 0
    assert c.attention_qd == (3 * 8,)
    expected = 80 + 2 * 7 * 40 + 2 * 2 * 26  # weights + 2 x 7 tokens + 2 states read, written
    assert floors.decode_step_bytes(c, 2, 7) == expected
    with pytest.raises(ValueError, match="unknown cache pool 'ring'"):
        floors.model_costs(_tiny_lm(), [_OddPoolSpec()], torch.bfloat16, torch.float32)


def test_ceilings_given_or_reference_without_cuda() -> None:
    given = floors.resolve_ceilings(False, 1e12, 2e14)
    assert (given.copy_bytes_per_s, given.matmul_flop_per_s, given.source) == (1e12, 2e14, "given")
    ref = floors.resolve_ceilings(False)
    assert (ref.copy_bytes_per_s, ref.matmul_flop_per_s) == (4.27e12, 773e12)
    assert ref.device_name == "cpu" and "not measured" in ref.source
    part = floors.resolve_ceilings(False, copy_bw=2e12)
    assert (part.copy_bytes_per_s, part.matmul_flop_per_s) == (2e12, 773e12)
    assert "partly given" in part.source
    assert part.as_dict()["copy_bytes_per_s"] == 2e12
    with pytest.raises(ValueError, match="CUDA"):
        floors.measure_ceilings("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measured_ceilings_are_plausible() -> None:
    """Any datacenter GPU copies at 0.3-10 TB/s and multiplies bf16 at 20-5000 TFLOP/s; a
    units slip (ms vs s, or bytes counted once) lands far outside."""
    c = floors.measure_ceilings(torch.device("cuda"), copy_bytes=1 << 28, matmul_size=4096, iters=5)
    assert 0.3e12 < c.copy_bytes_per_s < 10e12
    assert 20e12 < c.matmul_flop_per_s < 5000e12
    assert c.device_name == torch.cuda.get_device_name() and c.source == "measured"


def test_capacity_reasons() -> None:
    def engine(free_blocks: int, free_slots: int, max_running: int = 8):
        bm = SimpleNamespace(block_size=16, num_free_blocks=free_blocks, capacity=free_blocks)
        pool = SimpleNamespace(num_free=free_slots, capacity=free_slots)
        sched = SimpleNamespace(block_manager=bm, state_pool=pool, max_running=max_running)
        return SimpleNamespace(scheduler=sched)

    assert capacity_reason(engine(8, 4), 4, 32) is None  # 4 x 2 blocks
    assert "KV needs 12 blocks" in capacity_reason(engine(8, 4), 4, 33)
    assert "state slots" in capacity_reason(engine(100, 2), 4, 32)
    assert "runs at once" in capacity_reason(engine(100, 100, max_running=2), 4, 32)


def test_format_table_labels_synthetic_rows() -> None:
    rows = [
        dict(kind="decode", batch=16, length=512, tok_s=1000.0, floor_tok_s=4000.0,
             pct_of_floor=25.0, synthetic_context=True),
    ]  # fmt: skip
    table = format_table(rows)
    assert "| decode | 16 | 512 | 1,000.0 | 4,000.0 | 25.0% | synthetic context |" in table


def _run(tmp_path, capsys, *extra: str) -> tuple[str, dict]:
    out = tmp_path / "bench.json"
    argv = ["bench", "throughput", "--device", "cpu", "--dtype", "float32", "--prefill-lens",
            "8", "--decode-batches", "2", "--contexts", "8", "--decode-steps", "2",
            "--warmup-steps", "1", "--repeats", "1", "--json", str(out), *extra]  # fmt: skip
    assert main(argv) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


@pytest.mark.parametrize("synthetic", [False, True])
def test_end_to_end_on_the_demo_model(tmp_path, capsys, synthetic: bool) -> None:
    from deltaserve.loader.demo import ensure_demo_model

    extra = ["--model", str(ensure_demo_model())]
    if synthetic:
        extra.append("--skip-prefill-context")
    text, result = _run(tmp_path, capsys, *extra)
    assert "| kind | B | prompt/context | tok/s | floor tok/s | % of floor | notes |" in text
    assert result["architecture"] == "Qwen3_5ForCausalLM"
    assert result["costs"]["kv_bytes_per_token"] > 0
    assert result["costs"]["state_bytes_per_seq"] > 0
    prefill, decode = result["rows"]
    assert (prefill["kind"], prefill["batch"], prefill["length"]) == ("prefill", 1, 8)
    assert (decode["kind"], decode["batch"], decode["length"]) == ("decode", 2, 8)
    assert decode["steps"] == 2 and decode["synthetic_context"] is synthetic
    assert prefill["synthetic_context"] is False
    for row in result["rows"]:
        assert row["tok_s"] > 0 and row["floor_tok_s"] > 0
        assert row["pct_of_floor"] == pytest.approx(100 * row["tok_s"] / row["floor_tok_s"])
    # context at the timed steps: the prompt, the warm-up tokens, half the timed ones
    assert decode["context_mean"] >= 8 + 1
    assert ("synthetic context" in text) is synthetic
    assert result["skipped"] == []


@pytest.mark.skipif(
    "random_model" not in inspect.signature(create_engine_config).parameters,
    reason="LLM(random_model=...) is not wired into create_engine_config yet",
)
def test_end_to_end_on_a_random_preset(tmp_path, capsys) -> None:
    text, result = _run(tmp_path, capsys, "--random-model", "tiny-qwen3.5")
    assert result["model"] == "random:tiny-qwen3.5"
    assert [r["kind"] for r in result["rows"]] == ["prefill", "decode"]
    assert "random:tiny-qwen3.5" in text


def test_given_ceilings_set_the_floors_and_are_saved(tmp_path, capsys) -> None:
    from deltaserve.loader.demo import ensure_demo_model

    extra = ["--model", str(ensure_demo_model()), "--copy-bw", "1e9", "--matmul-flops", "1e11"]
    text, result = _run(tmp_path, capsys, *extra)
    assert result["ceilings"] == {
        "copy_bytes_per_s": 1e9,
        "matmul_flop_per_s": 1e11,
        "device_name": "cpu",
        "source": "given",
    }
    assert "command" in result and "commit" in result
    prefill, decode = result["rows"]
    flops = prefill["flops_params"] + prefill["flops_attention"]
    assert prefill["floor_tok_s"] == pytest.approx(8 / (flops / 1e11))
    assert decode["floor_tok_s"] == pytest.approx(2 / (decode["step_bytes"] / 1e9))
    assert "ceilings: cpu: copy 0.00 TB/s" in text


def test_ceiling_timings_take_the_fastest_after_a_timed_warm_up(monkeypatch) -> None:
    """`_best_ms` keeps calling for its warm-up time before timing, and returns the fastest
    timing (a ceiling is the best the device does), not the median."""
    import itertools

    from deltaserve.bench import floors

    timings = itertools.cycle([3.0, 1.5, 2.0, 9.0])

    class FakeEvent:
        def __init__(self, enable_timing: bool) -> None:
            pass

        def record(self) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end) -> float:  # noqa: ANN001
            return next(timings)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls = []
    assert floors._best_ms(lambda: calls.append(1), warmup=3, iters=4, warmup_s=0.05) == 1.5
    assert len(calls) > 3 + 4  # the warm-up ran for its time, past its 3 calls
