"""Overlapped decode (engine/async_step.py) changes no output: the same requests with
async_scheduling on and off give the same tokens, finish reasons and stop reasons, on an
attention-only model and a hybrid GDN model (CPU, float32: the overlap logic is the same as on
the GPU; only the waits become no-ops).

Each test also proves the overlap happened (steps launched by `execute_async`) and that no KV
block, state slot or placeholder token is left behind.
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

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.engine.async_step import PLACEHOLDER  # noqa: E402

MODELS = ["qwen3_g5", "qwen3_5_r2_g3"]
PROMPT_LENS = (3, 17, 40, 9)


def make_llm(model_dir: Path, async_on: bool, **overrides) -> LLM:
    kwargs = dict(
        dtype="float32",
        device="cpu",
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
        block_size=16,
        skip_tokenizer_init=True,
        seed=0,
        async_scheduling=async_on,
    )
    kwargs.update(overrides)
    return LLM(str(model_dir), **kwargs)


class LaunchCounter:
    """Counts the steps the runner launched without waiting for them."""

    def __init__(self, llm: LLM) -> None:
        self.count = 0
        runner = llm.llm_engine.runner
        launch = runner.execute_async

        def counting(*args, **kwargs):
            self.count += 1
            return launch(*args, **kwargs)

        runner.execute_async = counting


def prompts_for(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab - 4, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def summary(outs) -> list[list[tuple]]:
    """Per request, per completion: (token ids, finish reason, stop reason)."""
    return [[(list(c.token_ids), c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def assert_clean(llm: LLM) -> None:
    engine = llm.llm_engine
    usage = engine.cache_usage()
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0, usage
    assert engine._in_flight is None
    assert not engine.requests


@pytest.fixture(scope="module", params=MODELS)
def model(request, tmp_path_factory):
    name = request.param
    model_dir, oracle = build_model(SPECS_BY_NAME[name], tmp_path_factory.mktemp(name))
    vocab = oracle.config.get_text_config().vocab_size
    sync_llm = make_llm(model_dir, False)
    async_llm = make_llm(model_dir, True)
    return name, model_dir, vocab, sync_llm, async_llm


def run_both(model, params, prompts=None):
    _, _, vocab, sync_llm, async_llm = model
    prompts = prompts or prompts_for(vocab)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    counter = LaunchCounter(async_llm)
    want = summary(sync_llm.generate(reqs, params, use_tqdm=False))
    got = summary(async_llm.generate(reqs, params, use_tqdm=False))
    assert counter.count > 0, "no decode step was overlapped"
    for outs in got:
        for ids, _, _ in outs:
            assert PLACEHOLDER not in ids
    assert_clean(async_llm)
    assert_clean(sync_llm)
    return got, want


def test_greedy_mixed_lengths(model):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 12, 30)]
    got, want = run_both(model, params)
    assert got == want
    assert [len(o[0][0]) for o in got] == [1, 2, 12, 30]


def test_stop_tokens_end_sequences_mid_flight(model):
    """Each request stops on a token the greedy run produces at a different step: the step in
    flight already computed one more token for it, which must be dropped."""
    _, _, vocab, sync_llm, _ = model
    prompts = prompts_for(vocab)
    free = sync_llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        use_tqdm=False,
    )
    params = []
    for i, out in enumerate(free):
        ids = out.outputs[0].token_ids
        params.append(
            SamplingParams(
                temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[ids[3 + 4 * i]]
            )
        )
    got, want = run_both(model, params, prompts)
    assert got == want
    assert all(o[0][1] == "stop" for o in got)


def test_seeded_sampling_and_n2(model):
    params = SamplingParams(
        temperature=0.9,
        top_p=0.9,
        top_k=40,
        min_p=0.01,
        max_tokens=20,
        seed=123,
        n=2,
        ignore_eos=True,
    )
    got, want = run_both(model, params)
    assert got == want
    assert all(o[0][0] != o[1][0] for o in got), "n=2 gave identical completions"


def test_min_tokens_bans_until_reached(model):
    """min_tokens counts the tokens still on the device: the bans must end at the same step."""
    _, _, vocab, sync_llm, _ = model
    prompts = prompts_for(vocab)
    free = sync_llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    stop = [out.outputs[0].token_ids[1] for out in free]  # would stop at token 2
    params = [
        SamplingParams(temperature=0, max_tokens=16, min_tokens=6, stop_token_ids=[s]) for s in stop
    ]
    got, want = run_both(model, params, prompts)
    assert got == want
    assert all(len(o[0][0]) >= 6 for o in got)


def test_preemption_and_sync_only_requests(model):
    """A cache too small for the batch (preemption by recompute) and requests that cannot
    overlap (penalties, logprobs) in the same run: the engine drains and falls back, and
    overlaps again when it can."""
    name, model_dir, vocab, _, _ = model
    prompts = prompts_for(vocab)
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    ]
    reqs = [{"prompt_token_ids": p} for p in prompts]
    small = dict(num_gpu_blocks_override=9, max_num_seqs=4)
    sync_llm, async_llm = make_llm(model_dir, False, **small), make_llm(model_dir, True, **small)
    counter = LaunchCounter(async_llm)
    want = sync_llm.generate(reqs, params, use_tqdm=False)
    got = async_llm.generate(reqs, params, use_tqdm=False)
    assert summary(got) == summary(want)
    assert got[2].outputs[0].logprobs == want[2].outputs[0].logprobs
    assert counter.count > 0
    assert async_llm.llm_engine.scheduler.num_preemptions > 0, "the cache never ran out"
    assert_clean(async_llm)


def test_arrivals_and_abort_while_in_flight(model):
    """Requests added and aborted between overlapped steps: the others' tokens are those of
    each prompt run alone; the aborted one leaves nothing behind."""
    _, _, vocab, sync_llm, async_llm = model
    prompts = prompts_for(vocab)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    solo = [
        summary(sync_llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False))[0]
        for p in prompts
    ]
    engine = async_llm.llm_engine
    counter = LaunchCounter(async_llm)
    engine.add_request("a0", {"prompt_token_ids": prompts[0]}, greedy)
    engine.add_request("a1", {"prompt_token_ids": prompts[1]}, greedy)
    final = {}
    for step in range(200):
        if step == 5:
            engine.add_request("a2", {"prompt_token_ids": prompts[2]}, greedy)
            engine.add_request("gone", {"prompt_token_ids": prompts[3]}, greedy)
        if step == 9:
            assert engine._in_flight is not None, "expected a step in flight"
            seq = engine.requests["gone"].seqs[0]
            engine.abort_request("gone")
            assert PLACEHOLDER not in seq.token_ids
        if step == 12:
            engine.add_request("a3", {"prompt_token_ids": prompts[3]}, greedy)
        for out in engine.step():
            assert out.request_id != "gone" or step < 9
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished_requests() and step > 12:
            break
    assert sorted(final) == ["a0", "a1", "a2", "a3"]
    for i in range(4):
        assert summary([final[f"a{i}"]])[0] == solo[i], f"request a{i}"
    assert counter.count > 0
    assert_clean(async_llm)


def test_length_limit_by_max_model_len(model):
    """Sequences that end at max_model_len (not max_tokens) stop where the sync engine does."""
    _, model_dir, vocab, _, _ = model
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab - 4, (n,), generator=gen).tolist() for n in (50, 58)]
    params = SamplingParams(temperature=0, ignore_eos=True)  # max_tokens: up to the limit
    reqs = [{"prompt_token_ids": p} for p in prompts]
    sync_llm = make_llm(model_dir, False, max_model_len=64)
    async_llm = make_llm(model_dir, True, max_model_len=64)
    want = summary(sync_llm.generate(reqs, params, use_tqdm=False))
    got = summary(async_llm.generate(reqs, params, use_tqdm=False))
    assert got == want
    assert [len(o[0][0]) for o in got] == [14, 6]
    assert_clean(async_llm)


def test_async_scheduling_config():
    from deltaserve.config import create_engine_config

    cfg = create_engine_config(None, random_model="tiny-qwen3.5", device="cpu")
    assert cfg.async_scheduling is False  # auto: off without a GPU
    cfg = create_engine_config(
        None, random_model="tiny-qwen3.5", device="cpu", async_scheduling=True
    )
    assert cfg.async_scheduling is True
    cfg = create_engine_config(  # overlap under TP: tests/distributed/test_tp_graphs_async.py
        None,
        random_model="tiny-qwen3.5",
        device="cpu",
        async_scheduling=True,
        tensor_parallel_size=2,
    )
    assert cfg.async_scheduling is True
