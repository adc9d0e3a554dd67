"""Tensor parallelism on CPU over gloo: TP=2 gives TP=1's greedy tokens and logprobs.

Each TP=2 engine spawns one worker process (rank 1). The models are tiny parity checkpoints
whose head counts divide by 2, covering GQA group 3 and 5, GDN value/key head ratios 1 and 2,
tied embeddings and an odd vocabulary (263: the last rank's vocab shard is padded). Prompts of
mixed lengths run batched with chunked prefill (a 64-token budget splits the 130-token prompt).
Every test checks that the worker processes are gone afterwards (after `shutdown()` or garbage
collection: within SHUTDOWN_BOUND_S, exit code 0).
"""

from __future__ import annotations

import gc
import re
import time

import pytest
import torch
from hf_models import SPECS_BY_NAME, build_model, remove_tensor

from deltaserve import LLM, SamplingParams
from deltaserve.distributed.parallel_state import tp_size
from deltaserve.distributed.sharding import ShardRule, check_tp_shapes

PROMPT_LENS = (37, 5, 130, 16)
NEW_TOKENS = 12
LOGPROB_ATOL = 1e-4
SHUTDOWN_BOUND_S = 10.0


def _make_llm(model_dir, tp: int, **overrides) -> LLM:
    kwargs = dict(
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        enable_chunked_prefill=True,
        block_size=16,
        skip_tokenizer_init=True,
        seed=0,
        tensor_parallel_size=tp,
    )
    kwargs.update(overrides)
    return LLM(str(model_dir), **kwargs)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab - 4, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _run(llm: LLM, prompts: list[list[int]]):
    """Greedy tokens with their top-3 logprobs for every prompt (one batch), and the first
    prompt's prompt logprobs (top 3) in a second batch."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    plp_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=3)
    (plp,) = llm.generate([{"prompt_token_ids": prompts[0]}], plp_params)
    return [o.outputs[0] for o in outs], plp.prompt_logprobs


def _assert_close(ours: list[dict | None], ref: list[dict | None], what: str) -> None:
    assert len(ours) == len(ref), what
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a is None or b is None:
            assert a is None and b is None, (what, i)
            continue
        assert a.keys() == b.keys(), (what, i, a.keys(), b.keys())
        for tok, lp in a.items():
            assert abs(lp.logprob - b[tok].logprob) < LOGPROB_ATOL, (what, i, tok)


def _worker_processes(llm: LLM) -> list:
    return list(llm.llm_engine._tp_workers.processes)


@pytest.mark.parametrize(
    "spec_name, stop",
    [
        ("qwen3_g3_tied_sharded", "shutdown"),  # GQA group 3, tied embeddings
        ("qwen3_g5", "gc"),  # GQA group 5, vocab 263 (padded vocab shard), 3 layers
        ("qwen3_5_r2_g3", "shutdown"),  # GDN HV/HK = 2, attention GQA group 3
        ("qwen3_5_r1_g1_tied", "gc"),  # GDN HV/HK = 1, attention group 1, tied
    ],
)
def test_tp2_matches_tp1(tmp_path, spec_name: str, stop: str) -> None:
    spec = SPECS_BY_NAME[spec_name]
    model_dir, _ = build_model(spec, tmp_path / spec_name, load_oracle=False)
    prompts = _prompts(spec.config["vocab_size"])

    ref_llm = _make_llm(model_dir, 1)
    ref, ref_plp = _run(ref_llm, prompts)
    del ref_llm

    llm = _make_llm(model_dir, 2)
    assert tp_size() == 2
    procs = _worker_processes(llm)
    assert len(procs) == 1 and procs[0].is_alive()
    # every block leaves its sum over ranks to the norm after it (gloo: all-reduce, then norm)
    layers = llm.llm_engine.runner.instance.model.model.layers
    assert all(layer.mixer_partial and layer.ffn_partial for layer in layers)
    try:
        ours, plp = _run(llm, prompts)
    finally:
        start = time.monotonic()
        if stop == "shutdown":
            llm.shutdown()
            llm.shutdown()  # idempotent
        del llm
        gc.collect()  # "gc": the engine's finalizer stops the worker
        for p in procs:
            p.join(SHUTDOWN_BOUND_S)
        stop_s = time.monotonic() - start
    # a behaviour bound, not a speed figure: a stuck worker would take the 60 s join timeout
    assert stop_s < SHUTDOWN_BOUND_S, f"{stop} took {stop_s:.1f} s"
    assert all(not p.is_alive() and p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert tp_size() == 1

    for i, (a, b) in enumerate(zip(ours, ref)):
        assert list(a.token_ids) == list(b.token_ids), (
            f"{spec_name}, prompt len {PROMPT_LENS[i]}: TP=2 {list(a.token_ids)} "
            f"!= TP=1 {list(b.token_ids)}"
        )
        _assert_close(a.logprobs, b.logprobs, f"logprobs of prompt {i}")
    _assert_close(plp, ref_plp, "prompt logprobs")


@pytest.mark.parametrize(
    "spec_name, what",
    [
        ("qwen3_g1", "num_attention_heads (3)"),
        ("qwen3_5_r3_bf16_sharded", "num_attention_heads (3)"),
    ],
)
def test_indivisible_heads_fail_at_start_up(tmp_path, spec_name: str, what: str) -> None:
    import multiprocessing

    model_dir, _ = build_model(SPECS_BY_NAME[spec_name], tmp_path / "m", load_oracle=False)
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=re.escape(what)) as excinfo:
        _make_llm(model_dir, 2)
    assert "tensor_parallel_size=2" in str(excinfo.value)
    assert set(multiprocessing.active_children()) == before  # no worker was started
    assert tp_size() == 1


def test_load_error_on_every_rank_fails_start_up_cleanly(tmp_path) -> None:
    """A checkpoint error raises on rank 0 with the tensor's name; the worker, failing too,
    exits instead of waiting for steps, and the process group is left."""
    import multiprocessing

    model_dir, _ = build_model(SPECS_BY_NAME["qwen3_5_r2_g3"], tmp_path / "m", load_oracle=False)
    tensor = "model.layers.0.linear_attn.A_log"
    remove_tensor(model_dir, tensor)
    before = set(multiprocessing.active_children())
    with pytest.raises(Exception, match=re.escape(tensor)):
        _make_llm(model_dir, 2)
    gc.collect()
    assert set(multiprocessing.active_children()) == before
    assert tp_size() == 1


def test_shard_rule_splits_each_piece_by_rank() -> None:
    # rows [q0 q1 | k0 k1 | v0 v1 v2 v3]: rank r keeps its half of every piece
    t = torch.arange(8).unsqueeze(1)
    rule = ShardRule(0, (2, 2, 4))
    assert rule.local_size(2) == 4 and rule.global_size == 8
    assert rule.slice(t, 0, 2).flatten().tolist() == [0, 2, 4, 5]
    assert rule.slice(t, 1, 2).flatten().tolist() == [1, 3, 6, 7]
    assert rule.slice(t, 0, 1) is t
    # a padded vocabulary of 5 over 2 ranks: 3 rows each, rank 1 holds 2 real ones
    vocab = ShardRule(0, (5,), pad=True)
    assert vocab.local_size(2) == 3
    assert vocab.local_range(1, 2) == (3, 5)
    assert vocab.slice(t[:5], 1, 2).flatten().tolist() == [3, 4]
    # the input dimension of a row-parallel weight
    w = torch.arange(12).reshape(2, 6)
    assert ShardRule(1, (6,)).slice(w, 1, 3).tolist() == [[2, 3], [8, 9]]


def test_check_tp_shapes_names_the_count() -> None:
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        num_attention_heads=8,
        num_key_value_heads=2,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        intermediate_size=17408,
    )
    check_tp_shapes(cfg, 2)
    check_tp_shapes(cfg, 4)  # 2 kv heads at TP=4: each on 2 ranks
    with pytest.raises(ValueError, match=re.escape("num_attention_heads (8)")):
        check_tp_shapes(cfg, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be"):
        from deltaserve.config import _check_tensor_parallel

        _check_tensor_parallel(0, cfg, torch.device("cpu"))


def test_tp2_prefix_cache_hits_match_tp1(tmp_path) -> None:
    """Hybrid prefix caching under TP=2: the scheduler decides once (rank 0), every rank copies
    its own state shards between slots and snapshots (the cache ops travel with the step). A
    second turn that hits the first turn's answer-end snapshot gives TP=1's uncached tokens."""
    spec = SPECS_BY_NAME["qwen3_5_r2_g3"]
    model_dir, _ = build_model(spec, tmp_path / "m", load_oracle=False)
    # 41 tokens: turn 1 computes 41 + 12 - 1 = 52, so its slot does not hold the state at the
    # hit (48): a rank that skipped the restore would go wrong
    first = _prompts(spec.config["vocab_size"])[2][:41]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)

    ref_llm = _make_llm(model_dir, 1, enable_prefix_caching=False)
    (ref1,) = ref_llm.generate([{"prompt_token_ids": first}], params)
    second = first + list(ref1.outputs[0].token_ids) + [5, 6, 7, 8]
    (ref2,) = ref_llm.generate([{"prompt_token_ids": second}], params)
    # shares turn 1's first 35 tokens: hits at 32, the snapshot turn 1 took inside its one
    # prefill step (every rank copied its own state shards inside the forward)
    third = first[:35] + [9, 10, 11]
    (ref3,) = ref_llm.generate([{"prompt_token_ids": third}], params)
    del ref_llm

    llm = _make_llm(model_dir, 2, enable_prefix_caching=True)
    procs = _worker_processes(llm)
    try:
        (out1,) = llm.generate([{"prompt_token_ids": first}], params)
        (out2,) = llm.generate([{"prompt_token_ids": second}], params)
        stats = llm.llm_engine.prefix_cache_stats()
        (out3,) = llm.generate([{"prompt_token_ids": third}], params)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    assert all(not p.is_alive() and p.exitcode == 0 for p in procs)
    assert list(out1.outputs[0].token_ids) == list(ref1.outputs[0].token_ids)
    assert list(out2.outputs[0].token_ids) == list(ref2.outputs[0].token_ids)
    _assert_close(out2.outputs[0].logprobs, ref2.outputs[0].logprobs, "hit logprobs")
    # the hit: the last full block of turn 1's computed tokens
    assert stats["prefix_cache_hits"] == 1 and out2.num_cached_tokens == 48
    assert out3.num_cached_tokens == 32
    assert list(out3.outputs[0].token_ids) == list(ref3.outputs[0].token_ids)
    _assert_close(out3.outputs[0].logprobs, ref3.outputs[0].logprobs, "in-step snapshot hit")
