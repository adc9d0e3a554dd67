"""Eager forwards over token rows padded to a bucket (engine/row_buckets.py) compute what the
unpadded forward computes.

On CUDA every eager forward pads its rows (cuBLAS then sees a few GEMM shapes); on CPU the
padding is off unless DELTASERVE_ROW_BUCKETS=1, which these tests set to run the padded path
against the unpadded one on tiny float32 models of every mixer kind: gated attention + GDN
(Qwen3.5), ungated attention (Qwen3), routed experts (Qwen3.5-MoE) and MLA absorbed and
expanded (DeepSeek-V2). Each run proves that padding happened (a hook on the model sees more
rows than the step's tokens) and that no cache block or state slot stays in use.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_TESTS_DIR = Path(__file__).resolve().parents[1]
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))

from hf_models import SPECS_BY_NAME, build_model  # noqa: E402
from test_invariants import random_prompt  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.engine.row_buckets import (  # noqa: E402
    MIN_PADDED,
    bucket_sizes,
    padded_rows,
    prime_gemms,
)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
LOGPROB_TOL = 1e-4


def test_buckets_cover_every_count_with_bounded_padding() -> None:
    sizes = bucket_sizes(8192)
    assert sizes == sorted(set(sizes)) and sizes[-1] == 8192
    assert len(sizes) == 95
    for n in range(1, 8193):
        b = padded_rows(n)
        assert b >= n
        if n <= MIN_PADDED:
            assert b == n
            continue
        assert b in sizes and b % 16 == 0
        assert padded_rows(b) == b  # a bucket is its own bucket
        if n > 256:
            assert (b - n) * 16 <= n  # at most 1/16 more rows


def test_prime_gemms_runs_each_bucket_of_each_weight_shape() -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 24, bias=False),
        torch.nn.Linear(24, 8, bias=False),
        torch.nn.Linear(8, 24, bias=False),  # a shape seen before: primed once
    )
    assert prime_gemms(model, 100, torch.device("cpu")) == 2 * len(bucket_sizes(100))
    assert bucket_sizes(100) == [32, 48, 64, 80, 96, 112]


class RowSpy:
    """Records (rows the model ran, the step's tokens) of every eager forward."""

    def __init__(self, llm: LLM) -> None:
        self.calls: list[tuple[int, int]] = []
        model = llm.llm_engine.runner.instance.model
        model.register_forward_pre_hook(self.hook, with_kwargs=False)

    def hook(self, module, args) -> None:
        input_ids, _, ctx = args
        self.calls.append((input_ids.shape[0], ctx.token_rows(input_ids.shape[0])))

    @property
    def padded(self) -> int:
        return sum(rows > tokens for rows, tokens in self.calls)


def run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    result = []
    for out in outs:
        c = out.outputs[0]
        lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)]
        result.append((list(c.token_ids), lps))
    return result


def make_llm(model_dir, **overrides) -> LLM:
    """A float32 CPU engine of the tiny model in `model_dir` (no tokenizer)."""
    kwargs = dict(
        dtype="float32", device="cpu", max_model_len=256, skip_tokenizer_init=True, seed=0
    )
    return LLM(str(model_dir), **(kwargs | overrides))


MODELS = [
    ("qwen3_5_r2_g3", {}),
    ("qwen3_g4_kv2", {}),
    ("qwen3_5_moe_e10k3_g3", {}),
    ("deepseek_v2_qproj_greedy_yarn", {}),
    ("deepseek_v2_qproj_greedy_yarn", {"DELTASERVE_MLA_PREFILL": "expanded"}),
]


@pytest.mark.parametrize(
    "name,env", MODELS, ids=[n + ("-expanded" if e else "") for n, e in MODELS]
)
def test_padded_rows_equal_unpadded(name, env, tmp_path, monkeypatch) -> None:
    model_dir, oracle = build_model(SPECS_BY_NAME[name], tmp_path / "m")
    vocab = oracle.config.get_text_config().vocab_size
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # 17..77-token prompts, several at once and one split by chunked prefill (41-token chunks)
    prompts = [random_prompt(n, vocab, seed) for seed, n in enumerate((17, 33, 77, 50))]
    outs = {}
    for buckets in ("0", "1"):
        monkeypatch.setenv("DELTASERVE_ROW_BUCKETS", buckets)
        llm = make_llm(model_dir, max_num_seqs=4, max_num_batched_tokens=41, block_size=8)
        spy = RowSpy(llm)
        outs[buckets] = run(llm, prompts[:3]) + run(llm, prompts[3:])
        if buckets == "1":
            assert spy.padded > 0, spy.calls
            assert all(rows == padded_rows(tokens) for rows, tokens in spy.calls), spy.calls
        else:
            assert spy.padded == 0 and spy.calls
        sched = llm.llm_engine.scheduler
        assert not sched.running and not sched.waiting
        for pool in sched.pools:
            assert pool.num_used == 0, pool
    for (want_ids, want_lps), (got_ids, got_lps) in zip(outs["0"], outs["1"], strict=True):
        assert got_ids == want_ids
        assert max(abs(a - b) for a, b in zip(want_lps, got_lps)) < LOGPROB_TOL


def test_warm_up_primes_every_bucket_of_every_projection(tmp_path, monkeypatch) -> None:
    """With row buckets on, the start-up warm-up runs each bucket up to the token budget through
    each distinct projection shape (cuBLAS picks their algorithms before serving)."""
    import deltaserve.engine.warmup as warmup

    model_dir, _ = build_model(SPECS_BY_NAME["qwen3_5_r2_g3"], tmp_path / "m", load_oracle=False)
    primed = []
    real = warmup.prime_instance
    monkeypatch.setattr(warmup, "prime_instance", lambda i, c: primed.append(real(i, c)))
    monkeypatch.setenv("DELTASERVE_ROW_BUCKETS", "1")
    llm = make_llm(model_dir, max_num_batched_tokens=100, warmup=True)
    model = llm.llm_engine.runner.instance.model
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert primed == [len(bucket_sizes(100)) * len(shapes)] and len(shapes) >= 4
    monkeypatch.setenv("DELTASERVE_ROW_BUCKETS", "0")
    off = make_llm(model_dir, max_num_batched_tokens=100, warmup=True)
    assert primed[1:] == [0] and not off.llm_engine.runner.instance.row_buckets
