"""Speculative decoding end to end with stub proposers on the tiny parity models: the output is
token for token the output without speculation, acceptance is what the stub forces, and no block
or slot leaks. Hybrid (GDN) models exercise the state rollback; the attention-only model the KV
rollback alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS_DIR = Path(__file__).resolve().parents[1]
for extra in (_TESTS_DIR, _TESTS_DIR / "spec"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import stub_proposers  # noqa: E402,F401  (registers the stub methods)
from hf_models import SPECS_BY_NAME, build_model  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402

HYBRID, ATTN = "qwen3_5_r2_g3", "qwen3_g5"
K = 4
PROMPTS = [
    [5, 17, 3, 44, 9, 12, 31],
    [11, 4, 9, 33, 21, 6, 7, 19, 28, 40, 3],
    [8, 8, 21, 30, 2],  # exactly 1 + K tokens
]


def make_llm(model_dir, spec=None, **kw):
    args = dict(
        dtype="float32",
        device="cpu",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        block_size=4,  # drafts cross block edges
        skip_tokenizer_init=True,
        seed=0,
        speculative_config=spec,
    )
    args.update(kw)
    return LLM(str(model_dir), **args)


LONG = [(7 * i) % 90 + 3 for i in range(37)]
NGRAM_PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 9, 10, 9, 11, 9, 10]]
ALL_PROMPTS = PROMPTS + [LONG] + NGRAM_PROMPTS
MAX_TOKENS = 40


@pytest.fixture(scope="module", params=[HYBRID, ATTN])
def model(request, tmp_path_factory):
    """(name, dir, {prompt: greedy output of MAX_TOKENS tokens without speculation}); shorter
    max_tokens give prefixes of it (greedy)."""
    path, _ = build_model(
        SPECS_BY_NAME[request.param], tmp_path_factory.mktemp(request.param), load_oracle=False
    )
    outs = make_llm(path).generate(
        [{"prompt_token_ids": p} for p in ALL_PROMPTS], greedy(MAX_TOKENS), use_tqdm=False
    )
    ref = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(ALL_PROMPTS, outs, strict=True)}
    return request.param, path, ref


@pytest.fixture(scope="module")
def hybrid(model):
    if model[0] != HYBRID:
        pytest.skip("run on the hybrid model only (keeps the suite fast)")
    return model


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def reference(ref, prompts, max_tokens):
    return [ref[tuple(p)][: max_tokens[i]] for i, p in enumerate(prompts)]


def spec_config(method, prompts, want, **extra):
    return {
        "method": method,
        "num_speculative_tokens": K,
        "continuations": [(tuple(p), w) for p, w in zip(prompts, want, strict=True)],
        **extra,
    }


def assert_no_leak(llm):
    usage = llm.llm_engine.cache_usage()
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0, usage


@pytest.mark.parametrize(
    "method,extra,accepted",
    [
        ("oracle", {}, "all"),
        ("anti_oracle", {}, 0),
        ("truncated_oracle", {"j": 2}, 2),
    ],
)
def test_stub_proposers_give_the_plain_output(model, method, extra, accepted):
    name, path, ref = model
    if name == ATTN and method != "anti_oracle":
        pytest.skip("the attention-only model: KV rollback alone (fast suite)")
    params = [greedy(23), greedy(30), greedy(17)]
    want = reference(ref, PROMPTS, [23, 30, 17])
    llm = make_llm(path, spec_config(method, PROMPTS, want, **extra))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3
    stats = llm.llm_engine.spec.stats
    assert stats.num_verify_rows > 0
    if accepted == "all":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert stats.drafted[0] == stats.num_verify_rows
    else:
        assert stats.accepted[:accepted] == stats.drafted[:accepted]
        assert all(a == 0 for a in stats.accepted[accepted:])
    assert_no_leak(llm)


def test_oracle_accepts_k_every_step_and_takes_fewer_steps(hybrid):
    name, path, ref = hybrid
    params = greedy(30)
    want = reference(ref, PROMPTS[:1], [30])
    llm = make_llm(path, spec_config("oracle", PROMPTS[:1], want))
    engine = llm.llm_engine
    engine.add_request("0", {"prompt_token_ids": PROMPTS[0]}, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    stats = engine.spec.stats
    # 1 prefill step, then rows of 1 + K tokens (the last ones shorter near max_tokens)
    assert steps <= 1 + -(-29 // (K + 1)) + 1, steps
    assert stats.accepted[K - 1] == stats.drafted[K - 1] > 0


def test_stop_token_inside_an_accepted_block(hybrid):
    name, path, ref = hybrid
    want = reference(ref, PROMPTS[:2], [30, 30])
    stop_id = want[0][6]  # the 7th token: inside the second verify row
    first = want[0].index(stop_id)
    llm = make_llm(path, spec_config("oracle", PROMPTS[:2], want))
    params = [greedy(30, stop_token_ids=[stop_id]), greedy(30)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params)
    assert list(outs[0].outputs[0].token_ids) == want[0][: first + 1]
    assert outs[0].outputs[0].finish_reason == "stop"
    assert list(outs[1].outputs[0].token_ids) == want[1]
    assert_no_leak(llm)


def test_chunked_prefill_and_preemption_beside_verify_rows(hybrid):
    """A small budget chunks the prompts beside verify rows, and a KV cache too small for the
    batch preempts sequences that carry drafts."""
    name, path, ref = hybrid
    prompts = PROMPTS + [LONG]
    params = greedy(MAX_TOKENS)
    want = reference(ref, prompts, [MAX_TOKENS] * 4)
    llm = make_llm(
        path,
        spec_config("truncated_oracle", prompts, want, j=3),
        max_num_batched_tokens=16,
        num_gpu_blocks_override=30,
        max_model_len=96,
    )
    got = [
        list(o.outputs[0].token_ids)
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    assert got == want
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.spec.stats.num_verify_rows > 0
    assert_no_leak(llm)


def test_abort_between_steps_frees_everything(hybrid):
    name, path, ref = hybrid
    want = reference(ref, PROMPTS[:2], [30, 30])
    llm = make_llm(path, spec_config("oracle", PROMPTS[:2], want))
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(str(i), {"prompt_token_ids": p}, greedy(30))
    for _ in range(3):
        engine.step()
    engine.abort_request("0")
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert list(final.outputs[0].token_ids) == want[1]
    assert_no_leak(llm)


def test_ngram_output_equals_plain(hybrid):
    name, path, ref = hybrid
    # repetitive prompts: prompt lookup finds matches (right and wrong)
    prompts = NGRAM_PROMPTS
    params = greedy(24)
    want = reference(ref, prompts, [24, 24])
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
    llm = make_llm(path, spec)
    got = [
        list(o.outputs[0].token_ids)
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    assert got == want
    assert llm.llm_engine.spec.stats.num_draft_tokens > 0
    assert_no_leak(llm)
