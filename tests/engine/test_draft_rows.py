"""Rows with drafts end to end: the runner samples every position of a row, accepts drafts while
they match, the engine appends several tokens (stopping part-way when one ends the sequence)
and the scheduler rolls the rejected drafts back. Greedy output must equal decoding without
drafts, token for token, and nothing may leak.

Drafts here are injected by the test between steps (right and wrong ones). Rolling back a
recurrent state is the speculative-decoding issue's work, so rejected drafts are tested on an
attention-only model and the hybrid model gets drafts that are all accepted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS_DIR = Path(__file__).resolve().parents[1]
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))

from hf_models import SPECS_BY_NAME, build_model  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402

PROMPTS = [[5, 17, 3, 44, 9, 12, 31], [11, 4, 9, 33, 21, 6, 7, 19, 28, 40, 3]]


def make_llm(model_dir: Path) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        block_size=4,  # drafts cross block edges
        skip_tokenizer_init=True,
        seed=0,
        async_scheduling=False,
    )


def run_with_drafts(llm: LLM, params: list[SamplingParams], want: list[list[int]], wrong_every):
    """Generate with drafts injected before each step: up to 5 tokens of the known greedy
    continuation, the j-th replaced by a wrong token when wrong_every(step) says so."""
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    seqs = {str(i): engine.requests[str(i)].seqs[0] for i in range(len(PROMPTS))}
    final, drafted, step = {}, 0, 0
    while engine.has_unfinished_requests():
        for rid, seq in seqs.items():
            if seq.is_finished or seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            done = seq.num_output_tokens
            drafts = list(want[int(rid)][done : done + 1 + step % 5])
            bad = wrong_every(step)
            if bad is not None and bad < len(drafts):
                drafts[bad] = (drafts[bad] + 1) % 90 + 3  # a token greedy would not pick
            seq.token_ids.extend(drafts)
            seq.num_draft_tokens = len(drafts)
            drafted += len(drafts)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        step += 1
        assert step < 200
    usage = engine.cache_usage()
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0, usage
    assert drafted > 0
    return [final[str(i)].outputs[0] for i in range(len(PROMPTS))], step


@pytest.mark.parametrize(
    "name,wrong_every",
    [
        ("qwen3_g5", lambda step: None),  # every draft right
        ("qwen3_g5", lambda step: step % 3),  # a wrong draft at varying places
        ("qwen3_5_r2_g3", lambda step: None),  # hybrid: all accepted (no rollback needed)
    ],
)
def test_greedy_with_drafts_equals_without(name, wrong_every, tmp_path):
    model_dir, _ = build_model(SPECS_BY_NAME[name], tmp_path / name, load_oracle=False)
    plain, drafted = make_llm(model_dir), make_llm(model_dir)
    params = [
        SamplingParams(temperature=0, max_tokens=23, ignore_eos=True),  # ends mid-row
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    ]
    ref = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    want = [list(o.outputs[0].token_ids) for o in ref]
    got, steps = run_with_drafts(drafted, params, want, wrong_every)
    assert [list(c.token_ids) for c in got] == want
    assert [c.finish_reason for c in got] == ["length", "length"]
    if wrong_every(1) is None:
        assert steps < 40, "drafts were not accepted several at a time"


def test_a_stop_token_inside_accepted_drafts_ends_the_sequence_there(tmp_path):
    model_dir, _ = build_model(SPECS_BY_NAME["qwen3_g5"], tmp_path / "m", load_oracle=False)
    plain, drafted = make_llm(model_dir), make_llm(model_dir)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], [greedy] * 2, use_tqdm=False)
    want = [list(o.outputs[0].token_ids) for o in ref]
    # stop at the 8th token of the first request: with 5-token drafts it falls inside a row
    stop_id = want[0][7]
    first = want[0].index(stop_id)
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]),
        greedy,
    ]
    got, _ = run_with_drafts(drafted, params, want, lambda step: None)
    assert list(got[0].token_ids) == want[0][: first + 1]
    assert (got[0].finish_reason, got[0].stop_reason) == ("stop", stop_id)
    assert list(got[1].token_ids) == want[1]


def test_seeded_sampling_with_drafts_keeps_the_distribution_support(tmp_path):
    """Sampled rows with drafts: every emitted token is one the target could sample (top_k=1
    makes sampling deterministic, so the output must equal greedy)."""
    model_dir, _ = build_model(SPECS_BY_NAME["qwen3_g5"], tmp_path / "m", load_oracle=False)
    plain, drafted = make_llm(model_dir), make_llm(model_dir)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], [greedy] * 2, use_tqdm=False)
    want = [list(o.outputs[0].token_ids) for o in ref]
    top1 = SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=20, ignore_eos=True)
    got, _ = run_with_drafts(drafted, [top1, top1], want, lambda step: step % 2)
    assert [list(c.token_ids) for c in got] == want
