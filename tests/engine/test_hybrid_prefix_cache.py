"""Prefix caching on a hybrid (GDN + attention) model: a hit equals a miss.

The reference is the same engine with prefix caching off, each prompt alone and prefilled whole
(tests/engine/test_invariants.py pins that engine to HF). A hit restores a recurrent-state
snapshot and computes the rest; its greedy tokens must be the reference's, and its logprobs
(float32) equal within 1e-4 (a hit splits the GDN recurrence at another position, which only
reorders float32 sums). Every test proves the hit happened (the engine's counters), that no
KV block, state slot or snapshot stays in use, and that no cache op touched a row past the
snapshot pool's budget.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS_DIR = Path(__file__).resolve().parents[1]
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))

from hf_models import SPECS_BY_NAME, build_model  # noqa: E402
from test_invariants import BLOCK_SIZE, random_prompt  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.cache.ops import CopySlot  # noqa: E402

HYBRID = "qwen3_5_r2_g3"
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
LOGPROB_TOL = 1e-4


class Hybrid:
    def __init__(self, model_dir: Path, vocab: int) -> None:
        self.dir = model_dir
        self.vocab = vocab
        self.ref = make_llm(model_dir, enable_prefix_caching=False)
        self._want: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def want(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        """The reference's greedy tokens and their logprobs for `prompt` alone."""
        key = tuple(prompt)
        if key not in self._want:
            self._want[key] = run(self.ref, [prompt])[0]
        return self._want[key]

    def prompt(self, length: int, seed: int) -> list[int]:
        return random_prompt(length, self.vocab, seed)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> Hybrid:
    model_dir, oracle = build_model(SPECS_BY_NAME[HYBRID], tmp_path_factory.mktemp(HYBRID))
    return Hybrid(model_dir, oracle.config.get_text_config().vocab_size)


def make_llm(model_dir: Path, **overrides) -> LLM:
    kwargs = dict(
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        block_size=BLOCK_SIZE,
        skip_tokenizer_init=True,
        seed=0,
        prefix_snapshot_interval=0,
    )
    kwargs.update(overrides)
    llm = LLM(str(model_dir), **kwargs)
    if llm.llm_engine.scheduler.prefix_cache is not None:
        OpBounds(llm)
    return llm


def run(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = []
    for out, prompt in zip(outs, prompts, strict=True):
        assert list(out.prompt_token_ids) == prompt
        comp = out.outputs[0]
        assert len(comp.token_ids) == MAX_TOKENS
        lps = [pos[t].logprob for pos, t in zip(comp.logprobs, comp.token_ids, strict=True)]
        result.append((list(comp.token_ids), lps))
    return result


class OpBounds:
    """Checks every cache op the runner applies: copies stay inside the slots and the
    snapshot pool's rows (the budget is never exceeded), and counts them."""

    def __init__(self, llm: LLM) -> None:
        runner = llm.llm_engine.runner
        snaps = llm.llm_engine.scheduler.pool("snapshots")
        rows = runner.plan.num_slots + snaps.capacity
        assert runner.caches[0]["ssm_state"].shape[0] == rows  # allocated: slots + snapshots
        self.copies = 0
        apply = runner.apply_cache_ops

        def checked(ops):
            for op in ops:
                if isinstance(op, CopySlot):
                    assert 0 < op.src < rows and 0 < op.dst < rows, f"{op} outside {rows} rows"
                    # one end is a sequence's slot, the other a snapshot
                    assert (op.src < snaps.base) != (op.dst < snaps.base), op
                    self.copies += 1
            apply(ops)

        runner.apply_cache_ops = checked
        # in-step snapshots (checkpoints) write snapshot rows only, one per checkpointed row
        self.checkpoints = 0
        self.beside_decodes = 0  # steps with checkpoints and decode rows
        self.prefill_steps: list[int] = []  # per step with a prefill row: its checkpoints
        prepare = runner._prepare

        def prepared(batch):
            items, step = prepare(batch)
            checkpoints = getattr(step, "checkpoints", [])  # (absent before in-step snapshots)
            for b, head, dst in checkpoints:
                assert snaps.base <= dst < rows, f"checkpoint into row {dst}, outside snapshots"
                assert 0 < head < items[b][1] and not items[b].is_decode, (b, head, items[b])
            if any(not row.is_decode for row in items):
                self.prefill_steps.append(len(checkpoints))
            self.checkpoints += len(checkpoints)
            if checkpoints and step.num_decodes:
                self.beside_decodes += 1
            return items, step

        runner._prepare = prepared
        llm.op_bounds = self


def counters(llm: LLM) -> dict[str, int]:
    return llm.llm_engine.prefix_cache_stats()


def assert_pools_full(llm: LLM) -> None:
    """No KV block, slot or snapshot is held by anyone (cached ones count as free)."""
    sched = llm.llm_engine.scheduler
    assert not sched.running and not sched.waiting
    for pool in sched.pools:
        assert pool.num_used == 0, f"{pool.kind} pool: {pool.num_used} units leaked"
    snaps = sched.pool("snapshots")
    if snaps is not None:
        assert snaps.num_private == 0 and snaps.num_free == snaps.capacity
        assert snaps.num_held <= snaps.capacity
        cache = sched.prefix_cache
        assert not cache._restoring and not cache._trailing and not cache._plans
        assert not cache._pending


def assert_same(got, want, what: str) -> None:
    (g_tok, g_lp), (w_tok, w_lp) = got, want
    assert g_tok == w_tok, f"{what}: tokens differ\n got: {g_tok}\nwant: {w_tok}"
    worst = max(abs(a - b) for a, b in zip(g_lp, w_lp, strict=True))
    assert worst <= LOGPROB_TOL, f"{what}: logprobs differ by {worst:.2e}"


def generate_checked(hybrid: Hybrid, llm: LLM, prompts, what: str) -> None:
    for i, got in enumerate(run(llm, prompts)):
        assert_same(got, hybrid.want(prompts[i]), f"{what} [{i}]")


# ---------------------------------------------------------------------------------------------


def test_hit_at_prompt_end_and_shared_prefix(hybrid):
    llm = make_llm(hybrid.dir)
    prefix = hybrid.prompt(2 * BLOCK_SIZE + 13, seed=7)  # 45 tokens
    a = prefix + hybrid.prompt(7, seed=8)  # 52: snapshot at 48 (prompt end)
    generate_checked(hybrid, llm, [a], "cold")
    assert counters(llm)["prefix_cache_hits"] == 0
    # one prefill step: the snapshot at 48 is taken inside it
    assert llm.op_bounds.prefill_steps == [1]
    # the same prompt again: hits its prompt-end snapshot (48 of 52 tokens)
    generate_checked(hybrid, llm, [a], "repeat")
    c = counters(llm)
    assert (c["prefix_cache_hits"], c["prefix_cache_hit_tokens"]) == (1, 48)
    # B shares 45 tokens with A: KV blocks for 32 are cached, no snapshot there: a miss that
    # snapshots 32 inside its chunk (where traffic diverged) and ends the chunk at 48 ...
    b = prefix + hybrid.prompt(9, seed=9)
    llm.op_bounds.prefill_steps.clear()
    generate_checked(hybrid, llm, [b], "diverging")
    assert llm.op_bounds.prefill_steps == [1, 0]
    assert counters(llm)["prefix_cache_hit_tokens"] == 48
    # ... so C, sharing the same 45 tokens, hits at 32
    computed = counters(llm)["prompt_tokens_computed"]
    c_prompt = prefix + hybrid.prompt(11, seed=10)
    generate_checked(hybrid, llm, [c_prompt], "shared prefix")
    assert counters(llm)["prefix_cache_hit_tokens"] == 48 + 32
    assert counters(llm)["prompt_tokens_computed"] - computed == len(c_prompt) - 32
    assert_pools_full(llm)


def test_multi_turn_hits_at_answer_end(hybrid):
    """Each turn sends the conversation so far (prompt + answers) plus a new message: from
    turn 2 on it computes at most the new message plus one block."""
    llm = make_llm(hybrid.dir)
    history = hybrid.prompt(37, seed=20)
    for turn in range(5):
        new = hybrid.prompt(5 + 3 * turn, seed=21 + turn)
        prompt = history + new
        before = counters(llm)
        ((tokens, lps),) = run(llm, [prompt])
        assert_same((tokens, lps), hybrid.want(prompt), f"turn {turn + 1}")
        after = counters(llm)
        computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
        if turn == 0:
            assert computed == len(prompt)
        else:
            assert computed <= len(new) + BLOCK_SIZE, f"turn {turn + 1} computed {computed}"
            # the hit is the last full block of the previous turn's computed tokens
            prev_computed = len(history) - 1  # its last answer token was never computed
            hit = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
            assert hit == prev_computed // BLOCK_SIZE * BLOCK_SIZE
        history = prompt + tokens
        assert_pools_full(llm)


def test_hit_inside_a_long_prompt(hybrid):
    llm = make_llm(hybrid.dir, prefix_snapshot_interval=2 * BLOCK_SIZE)
    doc = hybrid.prompt(100, seed=30)
    generate_checked(hybrid, llm, [doc], "long prompt")
    # snapshots every 32 tokens: 32, 64 and the prompt's end at 96
    assert counters(llm)["prefix_snapshots_taken"] >= 3
    # chunks [0, 64) (checkpoint at 32, CopySlot at 64) and [64, 100) (checkpoint at 96)
    assert llm.op_bounds.prefill_steps == [1, 1]
    other = doc[:70] + hybrid.prompt(20, seed=31)  # shares 70 tokens: hits at 64
    generate_checked(hybrid, llm, [other], "shares 70 tokens")
    assert counters(llm)["prefix_cache_hit_tokens"] == 64
    third = doc[:40] + hybrid.prompt(9, seed=32)  # hits at 32, the first step's checkpoint
    generate_checked(hybrid, llm, [third], "shares 40 tokens")
    assert counters(llm)["prefix_cache_hit_tokens"] == 64 + 32
    assert_pools_full(llm)


def test_a_turn_crossing_an_interval_multiple_prefills_in_one_step(hybrid):
    """A hit at 48 whose new tokens cross the interval multiple 64 (less than an interval past
    the hit): the only target is the prompt's end, so the prefill takes one step with one
    checkpoint, not two steps (the multiple and the end, one checkpoint each)."""
    llm = make_llm(hybrid.dir, prefix_snapshot_interval=64)
    first = hybrid.prompt(50, seed=35)
    generate_checked(hybrid, llm, [first], "first")
    llm.op_bounds.prefill_steps.clear()
    second = first + hybrid.prompt(40, seed=36)  # 90 tokens: hits at 48, computes 48..90
    generate_checked(hybrid, llm, [second], "crosses 64")
    assert counters(llm)["prefix_cache_hit_tokens"] == 48
    assert llm.op_bounds.prefill_steps == [1]  # one step, its checkpoint at the end (80)
    assert_pools_full(llm)


def test_hit_after_eviction(hybrid):
    """A snapshot pool of 3 units: older snapshots are evicted (LRU) for new ones; an evicted
    prefix is a miss, recomputed exactly, and cached again."""
    slot_bytes = hybrid.ref.llm_engine.runner.plan.slot_bytes
    llm = make_llm(hybrid.dir, prefix_state_memory=3 * slot_bytes + 1)
    snaps = llm.llm_engine.scheduler.pool("snapshots")
    assert snaps.capacity == 3
    prompts = [hybrid.prompt(45, seed=40 + i) for i in range(4)]
    for p in prompts:
        generate_checked(hybrid, llm, [p], "filling")
    assert counters(llm)["prefix_snapshots_evicted"] > 0
    assert snaps.num_held <= 3
    # the first prompt's snapshots are gone: a miss, then a hit again
    hits = counters(llm)["prefix_cache_hits"]
    generate_checked(hybrid, llm, [prompts[0]], "evicted")
    assert counters(llm)["prefix_cache_hits"] == hits
    generate_checked(hybrid, llm, [prompts[0]], "cached again")
    assert counters(llm)["prefix_cache_hits"] == hits + 1
    assert_pools_full(llm)


def test_hits_under_preemption(hybrid):
    """A KV cache too small for the batch: sequences are preempted and recomputed (hitting
    the snapshot their decode left), outputs unchanged."""
    # 9 blocks for 4 sequences of 4 blocks each (2 shared by hits): decode preempts
    llm = make_llm(hybrid.dir, num_gpu_blocks_override=10, max_model_len=128)
    shared = hybrid.prompt(40, seed=50)
    prompts = [shared + hybrid.prompt(5 + i, seed=51 + i) for i in range(4)]
    generate_checked(hybrid, llm, prompts[:1], "warm")
    generate_checked(hybrid, llm, prompts, "preempted batch")
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert counters(llm)["prefix_cache_hits"] > 0
    assert_pools_full(llm)


@pytest.mark.parametrize("budget", [7, 16])
def test_hits_with_chunked_prefill(hybrid, budget):
    llm = make_llm(hybrid.dir, max_num_batched_tokens=budget, prefix_snapshot_interval=32)
    shared = hybrid.prompt(50, seed=60)
    first = shared + hybrid.prompt(6, seed=61)
    second = shared + hybrid.prompt(9, seed=62)
    generate_checked(hybrid, llm, [first], f"budget {budget}, cold")
    generate_checked(hybrid, llm, [second], f"budget {budget}, hit")
    assert counters(llm)["prefix_cache_hit_tokens"] == 48  # first's end (48) is shared
    generate_checked(hybrid, llm, [first, second], f"budget {budget}, both again")
    assert counters(llm)["prefix_cache_hits"] == 3
    if budget == 7:  # [28, 35) carries the snapshot at 32, [42, 49) the one at 48
        assert llm.op_bounds.checkpoints >= 2
    assert_pools_full(llm)


def test_hits_batched_with_misses(hybrid):
    llm = make_llm(hybrid.dir)
    cached = [hybrid.prompt(n, seed=70 + n) for n in (33, 47, 64)]
    generate_checked(hybrid, llm, cached, "warm")
    fresh = [hybrid.prompt(n, seed=80 + n) for n in (1, 17, 40)]
    mixed = [cached[0], fresh[0], cached[1], fresh[1], cached[2], fresh[2]]
    hits = counters(llm)["prefix_cache_hits"]
    generate_checked(hybrid, llm, mixed, "hits and misses")
    assert counters(llm)["prefix_cache_hits"] - hits == 3
    assert llm.op_bounds.copies > 0
    # one step: the misses of 17 and 40 tokens take their snapshots (16, 32) inside it
    assert llm.op_bounds.prefill_steps[-1] == 2
    assert_pools_full(llm)


def test_one_prefill_step_per_chat_turn(hybrid):
    """A chat turn whose new tokens fit the token budget runs ONE prefill step: the snapshot
    at its prompt's last full block is taken inside it (a checkpoint), not by ending the chunk
    there and running the tail in a second step."""
    llm = make_llm(hybrid.dir)
    bounds = llm.op_bounds
    history = hybrid.prompt(37, seed=120)
    for turn in range(4):
        prompt = history + hybrid.prompt(9 + 4 * turn, seed=121 + turn)
        bounds.prefill_steps.clear()
        before = counters(llm)
        ((tokens, lps),) = run(llm, [prompt])
        assert_same((tokens, lps), hybrid.want(prompt), f"turn {turn + 1}")
        assert bounds.prefill_steps == [1], f"turn {turn + 1}: {bounds.prefill_steps}"
        after = counters(llm)
        if turn:  # it hit the previous turn's answer end, and its own end is cached now
            assert after["prefix_cache_hits"] == before["prefix_cache_hits"] + 1
        assert after["prefix_snapshots_taken"] >= before["prefix_snapshots_taken"] + 1
        history = prompt + tokens
        # the same prompt again hits the snapshot taken inside that step
        end = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
        hit_tokens = counters(llm)["prefix_cache_hit_tokens"]
        assert_same(run(llm, [prompt])[0], hybrid.want(prompt), f"turn {turn + 1} again")
        assert counters(llm)["prefix_cache_hit_tokens"] - hit_tokens == end
        assert_pools_full(llm)


def test_checkpoints_beside_decode_rows(hybrid):
    """A long prompt chunked by the budget while a short one decodes: its chunk carrying the
    snapshot shares steps with decode rows; both equal the reference, and the snapshot hits."""
    llm = make_llm(hybrid.dir, max_num_batched_tokens=40)
    short, long = hybrid.prompt(10, seed=130), hybrid.prompt(75, seed=131)
    generate_checked(hybrid, llm, [short, long], "beside decodes")
    assert llm.op_bounds.beside_decodes >= 1
    again = long[:70] + hybrid.prompt(3, seed=132)  # hits at 64, the snapshot taken in-step
    generate_checked(hybrid, llm, [again], "hit")
    assert counters(llm)["prefix_cache_hit_tokens"] == 64
    assert_pools_full(llm)


def test_prompt_logprobs_skip_the_cache(hybrid):
    """Prompt logprobs need every prompt position computed: no hit, same result."""
    llm = make_llm(hybrid.dir)
    p = hybrid.prompt(40, seed=90)
    generate_checked(hybrid, llm, [p], "warm")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    params.prompt_logprobs = 0
    out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hybrid.want(p)[0]
    assert len(out.prompt_logprobs) == len(p)
    assert counters(llm)["prefix_cache_hits"] == 0
    assert_pools_full(llm)


def test_hits_with_overlapped_decode(hybrid):
    """Overlapped decode (async scheduling; on CPU its waits are no-ops): the trailing
    snapshot is taken between overlapped steps, and the next turn hits it."""
    llm = make_llm(hybrid.dir, async_scheduling=True)
    runner = llm.llm_engine.runner
    launched = []
    execute_async = runner.execute_async

    def counting(*args, **kwargs):
        launched.append(1)
        return execute_async(*args, **kwargs)

    runner.execute_async = counting
    plain = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)  # no logprobs

    def tokens_of(prompt):
        out = llm.generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids)

    first = hybrid.prompt(37, seed=95)
    tokens = tokens_of(first)
    assert tokens == hybrid.want(first)[0] and launched, "no overlapped step ran"
    second = first + tokens + hybrid.prompt(4, seed=96)
    assert tokens_of(second) == hybrid.want(second)[0], "next turn, overlapped"
    assert counters(llm)["prefix_cache_hit_tokens"] == (37 + MAX_TOKENS - 1) // 16 * 16
    assert_pools_full(llm)


@pytest.mark.parametrize(
    "interval,copies,hit", [(None, 3, 80), (2 * BLOCK_SIZE, 1, 64), (0, 0, 32)]
)
def test_decode_snapshot_interval(hybrid, interval, copies, hit):
    """prefix_snapshot_decode_interval: a 37-token prompt (its end snapshot at 32, inside the
    prefill) answered with 48 tokens passes the boundaries 48, 64 and 80 while decoding; the
    trailing snapshot is rewritten at each of them by default (three state copies), at the
    multiples of 32 only with an interval of 32 (one), never with 0. The next turn hits the
    last one taken (80, 64, or the prompt's end at 32) and still equals the reference."""
    long_answer = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0)

    def generate(llm, prompt):
        out = llm.generate([{"prompt_token_ids": prompt}], long_answer, use_tqdm=False)[0]
        comp = out.outputs[0]
        lps = [pos[t].logprob for pos, t in zip(comp.logprobs, comp.token_ids, strict=True)]
        return list(comp.token_ids), lps

    llm = make_llm(hybrid.dir, prefix_snapshot_decode_interval=interval)
    first = hybrid.prompt(37, seed=97)
    tokens, lps = generate(llm, first)
    assert_same((tokens, lps), generate(hybrid.ref, first), "first turn")
    assert llm.op_bounds.copies == copies
    second = first + tokens + hybrid.prompt(5, seed=98)
    assert_same(generate(llm, second), generate(hybrid.ref, second), "next turn")
    assert counters(llm)["prefix_cache_hit_tokens"] == hit
    assert_pools_full(llm)


def test_decode_snapshot_interval_must_be_whole_blocks(hybrid):
    for bad in (BLOCK_SIZE + 8, -BLOCK_SIZE, 1.5):
        with pytest.raises(ValueError, match="prefix_snapshot_decode_interval must be 0"):
            make_llm(hybrid.dir, prefix_snapshot_decode_interval=bad)
