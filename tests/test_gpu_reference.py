"""The reference path on a CUDA device: the engine's greedy tokens on GPU in float32 equal its
CPU tokens on the tiny parity models; bf16 runs end to end. Run with `pytest -m gpu`."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_models import ALL_SPECS, build_model  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[(7 * i + 3) % 97 + 1 for i in range(n)] for n in (1, 9, 37, 70)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _run(model_dir: Path, device: str, dtype: str, **kw):
    llm = LLM(
        str(model_dir),
        device=device,
        dtype=dtype,
        max_model_len=256,
        skip_tokenizer_init=True,
        **{"max_num_seqs": 8, **kw},  # few graph buckets: quick start-up
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    usage = llm.llm_engine.cache_usage()
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_gpu_float32_equals_cpu(spec, tmp_path):
    model_dir, _ = build_model(spec, tmp_path / spec.name, load_oracle=False)
    cpu = _run(model_dir, "cpu", "float32")
    gpu = _run(model_dir, "cuda", "float32")
    assert gpu == cpu
    chunked = _run(model_dir, "cuda", "float32", max_num_batched_tokens=16)
    assert chunked == cpu


@pytest.mark.parametrize("spec", ALL_SPECS[:1] + ALL_SPECS[-2:], ids=lambda s: s.name)
def test_gpu_bfloat16_runs(spec, tmp_path):
    model_dir, _ = build_model(spec, tmp_path / spec.name, load_oracle=False)
    llm = LLM(
        str(model_dir),
        device="cuda",
        dtype="bfloat16",
        max_model_len=256,
        skip_tokenizer_init=True,
        max_num_seqs=8,
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 8
        assert all(math.isfinite(lp.logprob) for pos in c.logprobs for lp in pos.values())


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_cuda_graph_decode_equals_eager_and_cpu(spec, tmp_path):
    """Decode steps replayed from CUDA graphs give the eager tokens (and the CPU ones), with
    batches that need padding rows (4 prompts -> bucket 4, then 3, 2, 1 as they finish)."""
    model_dir, _ = build_model(spec, tmp_path / spec.name, load_oracle=False)
    cpu = _run(model_dir, "cpu", "float32")
    llm = LLM(
        str(model_dir),
        device="cuda",
        dtype="float32",
        max_model_len=256,
        skip_tokenizer_init=True,
        max_num_seqs=6,
    )
    runner = llm.llm_engine.runner
    reason = runner._no_graph_reason()
    if reason is None:
        assert runner.graphs is not None and runner.graphs.buckets == [1, 2, 4, 6]
    else:  # e.g. head dim 24: torch attention, which cannot be captured; say so, run eagerly
        assert runner.graphs is None and "cannot be captured" in reason
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 20, 13, 5)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [c[: len(g)] for c, g in zip(cpu, got)]
    eager = _run(model_dir, "cuda", "float32", enforce_eager=True)
    assert eager == cpu
    assert llm.llm_engine.async_scheduling  # the default on CUDA: the graphs ran overlapped
    not_overlapped = _run(model_dir, "cuda", "float32", async_scheduling=False)
    assert not_overlapped == cpu
    usage = llm.llm_engine.cache_usage()
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0


@pytest.mark.parametrize(
    "forced",
    [
        {"attention_backend": "torch"},
        {"gdn_decode_backend": "torch", "conv1d_backend": "torch"},
        {"gdn_prefill_backend": "torch"},
    ],
)
def test_forced_reference_backends_agree(forced, tmp_path):
    spec = ALL_SPECS[-2]
    model_dir, _ = build_model(spec, tmp_path / spec.name, load_oracle=False)
    assert _run(model_dir, "cuda", "float32", **forced) == _run(model_dir, "cpu", "float32")


@pytest.mark.parametrize("spec", ALL_SPECS[-2:], ids=lambda s: s.name)
def test_overlapped_decode_equals_sync_on_gpu(spec, tmp_path):
    """Overlapped decode with CUDA graphs (engine/async_step.py) against the synchronous
    engine: seeded sampling, stop tokens hit at different steps, varied max_tokens."""
    model_dir, _ = build_model(spec, tmp_path / spec.name, load_oracle=False)
    free = _run(model_dir, "cuda", "float32", async_scheduling=False)
    params = [
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[free[0][5]], ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[free[2][11]], ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=30, seed=9, max_tokens=24, n=2, ignore_eos=True),
    ]
    results = []
    for on in (False, True):
        llm = LLM(
            str(model_dir),
            device="cuda",
            dtype="float32",
            max_model_len=256,
            skip_tokenizer_init=True,
            max_num_seqs=8,
            async_scheduling=on,
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        results.append(
            [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]
        )
        usage = llm.llm_engine.cache_usage()
        assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0
    assert results[1] == results[0]
    assert results[0][0][0][1] == "stop" and results[0][2][0][1] == "stop"
