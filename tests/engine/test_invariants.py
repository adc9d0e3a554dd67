"""Engine invariants (docs/architecture.md, "Testing"), on one attention-only model (Qwen3)
and one hybrid GDN + attention model (Qwen3.5), greedy unless stated, ignore_eos, float32 on CPU.

The reference for every invariant is the engine itself run on each prompt alone with a budget
large enough to prefill it whole (and `test_solo_reference_matches_hf` pins that reference to HF):
- a batch of mixed-length prompts gives each prompt's solo output;
- chunked prefill (budgets 7 and 16; 1 and 7 for the hybrid, token by token) equals whole prefill;
- preemption (a KV cache too small for the batch) and max_num_seqs=1 change nothing;
- a prefix-cache hit (partial and full) equals a miss;
- seeded sampling is reproducible, batch or not; different seeds differ; n=2 gives 2 completions;
- after every run, no KV block and no state slot stays in use;
- bad input fails that request with a ValueError naming the problem; the engine keeps serving.
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

MODELS = ["qwen3_g5", "qwen3_5_r2_g3"]  # attention-only (GQA 5), hybrid (GDN ratio 2, GQA 3)
HYBRID = "qwen3_5_r2_g3"
ATTN_ONLY = "qwen3_g5"
PROMPT_LENS = (1, 5, 17, 33, 64, 100)  # 100 > 64: two GDN prefill chunks
MAX_TOKENS = 16
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


# ---------------------------------------------------------------------------------------------
# helpers and fixtures
# ---------------------------------------------------------------------------------------------


def make_llm(model_dir: Path, **overrides) -> LLM:
    kwargs = dict(
        dtype="float32",
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        max_num_batched_tokens=512,  # >= every prompt: whole prefill
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        block_size=BLOCK_SIZE,
        skip_tokenizer_init=True,
        seed=0,
    )
    kwargs.update(overrides)
    return LLM(str(model_dir), **kwargs)


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab - 4, (length,), generator=gen).tolist()


def generate(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    """Token ids of each prompt's (first) completion, checking output order and length."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert len(outs) == len(prompts)
    result = []
    for out, prompt in zip(outs, prompts, strict=True):
        assert list(out.prompt_token_ids) == prompt, "outputs out of order"
        for comp in out.outputs:
            if params.ignore_eos and not params.stop_token_ids:
                assert len(comp.token_ids) == params.max_tokens
                assert comp.finish_reason == "length"
        result.append(list(out.outputs[0].token_ids))
    return result


class StepSizes:
    """Records the tokens and sequences of every scheduled step, to prove the condition under
    test happened (chunked prefill must not pass because the engine ignored the budget)."""

    def __init__(self, llm: LLM) -> None:
        self.sizes: list[int] = []
        self.num_seqs: list[int] = []
        scheduler = llm.llm_engine.scheduler
        schedule = scheduler.schedule

        def recording_schedule():
            batch = schedule()
            if batch:
                self.sizes.append(batch.num_tokens)
                self.num_seqs.append(len(batch.items))
            return batch

        scheduler.schedule = recording_schedule


def assert_no_leak(llm: LLM) -> None:
    usage = llm.llm_engine.cache_usage()
    assert usage["kv_blocks_used"] == 0, f"KV blocks leaked: {usage}"
    assert usage["state_slots_used"] == 0, f"state slots leaked: {usage}"


def assert_same(got: list[list[int]], want: list[list[int]], prompts, what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            k = next(
                (j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b),
                min(len(g), len(w)),
            )
            pytest.fail(
                f"{what}: prompt {i} (len {len(prompts[i])}) differs from its reference at "
                f"generated token {k}\n  got: {g}\n want: {w}"
            )


class ModelUnderTest:
    def __init__(self, name: str, model_dir: Path, oracle, llm: LLM) -> None:
        self.name = name
        self.dir = model_dir
        self.oracle = oracle
        self.llm = llm  # whole-prefill, no prefix caching: the reference engine
        self.vocab = oracle.config.get_text_config().vocab_size
        self.prompts = [random_prompt(n, self.vocab, seed=1000 + n) for n in PROMPT_LENS]
        # Each prompt alone.
        self.solo = [generate(llm, [p])[0] for p in self.prompts]


@pytest.fixture(scope="module", params=MODELS)
def model(request, tmp_path_factory) -> ModelUnderTest:
    name = request.param
    model_dir, oracle = build_model(SPECS_BY_NAME[name], tmp_path_factory.mktemp(name))
    oracle.generation_config.eos_token_id = None
    m = ModelUnderTest(name, model_dir, oracle, make_llm(model_dir))
    assert_no_leak(m.llm)
    return m


@pytest.fixture(scope="module")
def attn_model(tmp_path_factory) -> ModelUnderTest:
    model_dir, oracle = build_model(SPECS_BY_NAME[ATTN_ONLY], tmp_path_factory.mktemp("attn"))
    return ModelUnderTest(ATTN_ONLY, model_dir, oracle, make_llm(model_dir))


# ---------------------------------------------------------------------------------------------
# greedy invariants
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def test_solo_reference_matches_hf(model):
    """The reference the other tests compare with is itself right (HF greedy, no cache)."""
    for prompt, ours in zip(model.prompts, model.solo, strict=True):
        seq = torch.tensor([prompt])
        for _ in range(MAX_TOKENS):
            nxt = model.oracle(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
        assert ours == seq[0, len(prompt) :].tolist(), f"{model.name}, prompt len {len(prompt)}"


def test_mixed_batch_equals_solo(model):
    llm = make_llm(model.dir)
    steps = StepSizes(llm)
    got = generate(llm, model.prompts)
    assert_same(got, model.solo, model.prompts, f"{model.name} mixed batch")
    assert max(steps.num_seqs) == len(PROMPT_LENS), "the prompts never ran in one batch"
    assert_no_leak(llm)
    # Reversed order: each request lands in a different batch row.
    rev = generate(llm, model.prompts[::-1])
    assert_same(rev, model.solo[::-1], model.prompts[::-1], f"{model.name} reversed batch")
    assert_no_leak(llm)


def _chunk_budgets(name: str) -> list[int]:
    # Budget 1 forces token-by-token prefill: for the hybrid, GDN chunked == token by token.
    return [1, 7] if name == HYBRID else [7, 16]


@pytest.mark.parametrize("budget_idx", [0, 1], ids=["smaller_budget", "larger_budget"])
def test_chunked_prefill_equals_whole(model, budget_idx):
    budget = _chunk_budgets(model.name)[budget_idx]
    llm = make_llm(model.dir, max_num_batched_tokens=budget)
    steps = StepSizes(llm)
    # Each prompt alone (pure chunked prefill, then decode) ...
    for prompt, want in zip(model.prompts, model.solo, strict=True):
        got = generate(llm, [prompt])
        assert_same(got, [want], [prompt], f"{model.name} budget {budget} solo")
    assert_no_leak(llm)
    assert max(steps.sizes) == budget, f"steps of {sorted(set(steps.sizes))} tokens"
    num_prompt_tokens = sum(PROMPT_LENS)
    assert len(steps.sizes) >= -(-num_prompt_tokens // budget) + len(PROMPT_LENS) * (MAX_TOKENS - 1)
    # ... and all together (chunks of one prompt beside decodes of others).
    got = generate(llm, model.prompts)
    assert_same(got, model.solo, model.prompts, f"{model.name} budget {budget} batch")
    assert_no_leak(llm)


def test_preemption_changes_nothing(model):
    # 40 new tokens: every sequence grows by 2-3 blocks after admission, so the running ones run
    # out of blocks (admission alone would just queue them). 9 usable blocks (block 0 is the null
    # block) = 144 tokens: the longest sequence (100 + 39 cached tokens) needs 9, the batch 31.
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [generate(model.llm, [p], params)[0] for p in model.prompts]
    for budget in (512, 16):  # whole prefill; chunked prefill and preemption together
        llm = make_llm(
            model.dir, num_gpu_blocks_override=10, max_model_len=144, max_num_batched_tokens=budget
        )
        got = generate(llm, model.prompts, params)
        preemptions = llm.llm_engine.scheduler.num_preemptions
        assert preemptions > 0, "the KV cache was meant to be too small for the batch"
        what = f"{model.name}, budget {budget}, {preemptions} preemptions"
        assert_same(got, want, model.prompts, what)
        assert_no_leak(llm)


def test_one_seq_at_a_time_changes_nothing(model):
    llm = make_llm(model.dir, max_num_seqs=1)
    got = generate(llm, model.prompts)
    assert_same(got, model.solo, model.prompts, f"{model.name} max_num_seqs=1")
    assert_no_leak(llm)


# ---------------------------------------------------------------------------------------------
# prefix caching (attention-only model)
# ---------------------------------------------------------------------------------------------


def _hit_tokens(llm: LLM) -> int:
    """Prompt tokens served by the prefix cache so far."""
    return llm.llm_engine.scheduler.block_manager.num_hit_tokens


def test_prefix_cache_hit_equals_miss(attn_model):
    m = attn_model
    prefix = random_prompt(2 * BLOCK_SIZE + 13, m.vocab, seed=7)  # 45 tokens: 2 full blocks + 13
    prompt_a = prefix + random_prompt(7, m.vocab, seed=8)
    prompt_b = prefix + random_prompt(9, m.vocab, seed=9)
    prompt_c = random_prompt(3 * BLOCK_SIZE, m.vocab, seed=10)  # exactly 3 blocks
    prompts = [prompt_a, prompt_b, prompt_c]
    want = [generate(m.llm, [p])[0] for p in prompts]  # caching off

    llm = make_llm(m.dir, enable_prefix_caching=True)
    assert_same(generate(llm, [prompt_a]), want[:1], [prompt_a], "first (cold) prompt")
    assert_no_leak(llm)
    # B shares 45 tokens with A: its first 2 full blocks can come from the cache.
    before = _hit_tokens(llm)
    assert_same(generate(llm, [prompt_b]), want[1:2], [prompt_b], "shared-prefix prompt")
    assert _hit_tokens(llm) - before >= 2 * BLOCK_SIZE, "prompt B did not hit the prefix cache"
    assert_no_leak(llm)
    assert_same(generate(llm, [prompt_c]), want[2:], [prompt_c], "block-aligned prompt, cold")
    # The same prompts again, one at a time: fully cached (all full blocks of each prompt are in
    # the cache; at least the last prompt token is still computed to give the first logits).
    for i, p in enumerate(prompts):
        before = _hit_tokens(llm)
        assert_same(generate(llm, [p]), want[i : i + 1], [p], f"repeated prompt {i}")
        assert _hit_tokens(llm) - before >= (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE, (
            f"repeated prompt {i} did not hit the prefix cache"
        )
        assert_no_leak(llm)
    # Hits and misses in one batch.
    assert_same(generate(llm, prompts + m.prompts), want + m.solo, prompts + m.prompts, "batch")
    assert_no_leak(llm)


# ---------------------------------------------------------------------------------------------
# seeded sampling
# ---------------------------------------------------------------------------------------------


def _sampling(seed: int | None, n: int = 1) -> SamplingParams:
    return SamplingParams(
        temperature=0.8, top_p=0.9, seed=seed, n=n, max_tokens=24, ignore_eos=True
    )


def test_seeded_sampling_reproducible(model):
    llm = model.llm
    prompt = model.prompts[2]
    first = generate(llm, [prompt], _sampling(1234))[0]
    again = generate(llm, [prompt], _sampling(1234))[0]
    assert first == again, "same seed, different tokens"
    assert first[:MAX_TOKENS] != model.solo[2], "seeded sampling looks greedy"

    # In a batch with other requests (seeded differently, unseeded, greedy) and in another row.
    others = [model.prompts[0], model.prompts[4], model.prompts[1]]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in [others[0], prompt, others[1], others[2]]],
        [_sampling(99), _sampling(1234), _sampling(None), GREEDY],
    )
    assert list(outs[1].outputs[0].token_ids) == first, "seeded output changed inside a batch"
    assert list(outs[3].outputs[0].token_ids) == model.solo[1], "greedy changed beside sampling"

    other_seed = generate(llm, [prompt], _sampling(4321))[0]
    assert other_seed != first, "different seeds gave identical 24-token samples"
    assert_no_leak(llm)


def test_n2_with_seed(model):
    llm = model.llm
    prompt = model.prompts[3]
    (out,) = llm.generate([{"prompt_token_ids": prompt}], _sampling(7, n=2))
    assert len(out.outputs) == 2
    assert sorted(c.index for c in out.outputs) == [0, 1]
    comps = [list(c.token_ids) for c in sorted(out.outputs, key=lambda c: c.index)]
    assert all(len(c) == 24 for c in comps)
    assert comps[0] != comps[1], "n=2 gave two identical samples"
    (again,) = llm.generate([{"prompt_token_ids": prompt}], _sampling(7, n=2))
    assert [list(c.token_ids) for c in sorted(again.outputs, key=lambda c: c.index)] == comps
    assert_no_leak(llm)


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


def _still_serves(m: ModelUnderTest) -> None:
    assert not m.llm.llm_engine.has_unfinished_requests(), "a failed call left requests queued"
    assert_no_leak(m.llm)
    got = generate(m.llm, [m.prompts[1], m.prompts[3]])
    assert_same(got, [m.solo[1], m.solo[3]], [m.prompts[1], m.prompts[3]], "after bad input")
    assert_no_leak(m.llm)


def test_prompt_longer_than_max_model_len(model):
    too_long = random_prompt(MAX_MODEL_LEN + 44, model.vocab, seed=3)
    with pytest.raises(ValueError, match=str(MAX_MODEL_LEN + 44)) as excinfo:
        model.llm.generate([{"prompt_token_ids": too_long}], GREEDY)
    assert str(MAX_MODEL_LEN) in str(excinfo.value), "message should state max_model_len"
    _still_serves(model)
    # Beside a good request in the same call: fails, and leaves nothing behind.
    with pytest.raises(ValueError, match=str(MAX_MODEL_LEN + 44)):
        model.llm.generate(
            [{"prompt_token_ids": model.prompts[2]}, {"prompt_token_ids": too_long}], GREEDY
        )
    _still_serves(model)


def test_empty_prompt(model):
    with pytest.raises(ValueError, match="(?i)empty"):
        model.llm.generate([{"prompt_token_ids": []}], GREEDY)
    _still_serves(model)
    with pytest.raises(ValueError, match="(?i)empty"):
        model.llm.generate([{"prompt_token_ids": model.prompts[2]}, {"prompt_token_ids": []}])
    _still_serves(model)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=1.5), "top_p"),
        (dict(stop=123), "stop"),
    ],
    ids=["max_tokens=0", "top_p=1.5", "stop=123"],
)
def test_bad_sampling_params(model, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        model.llm.generate([{"prompt_token_ids": model.prompts[1]}], SamplingParams(**kwargs))
    _still_serves(model)
