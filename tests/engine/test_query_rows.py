"""Rows of q tokens: feeding 1 + k tokens per row in one step equals feeding them one by one.

Verifying k drafts runs a decode row of q = 1 + k tokens from the sequence's pool slot (GDN
recurrent kernel and conv state) over its paged KV. Two engines hold the same model; engine A
feeds a continuation one token per step, engine B in decode rows of q = 2..16 tokens mixed with
q = 1 steps and with another sequence's prefill in the same step. Every logits row, the KV of
every position and the GDN recurrent and conv states must agree (CPU, float32, torch reference
kernels).
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

from deltaserve import LLM  # noqa: E402
from deltaserve.engine.sequence import Sequence  # noqa: E402
from deltaserve.engine.step_prep import build_step_input  # noqa: E402
from deltaserve.sampling_params import SamplingParams  # noqa: E402

# chunk sizes of the continuation in engine B: q = 2..16, with q = 1 steps between
CHUNKS = [1, 2, 1, 3, 4, 1, 5, 6, 7, 1, 8, 9, 10, 11, 12, 13, 14, 15, 16]
PROMPT = [5, 17, 3, 44, 9, 12, 31, 8, 22, 60, 7]  # odd length, crosses no block edge
OTHER = [11, 4, 9, 33, 21, 6, 7, 19, 28]  # the second sequence's prompt


def make_llm(model_dir: Path) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
        block_size=16,
        skip_tokenizer_init=True,
        seed=0,
        async_scheduling=False,
    )


def run_step(llm: LLM) -> dict[int, torch.Tensor]:
    """Schedule one step, run the forward, return every token row's logits per seq_id and
    advance the scheduler (all drafts accepted)."""
    engine = llm.llm_engine
    runner = engine.runner
    batch = engine.scheduler.schedule()
    assert batch, "nothing scheduled"
    items = batch.decodes_first()
    step = build_step_input(items, engine.config.cache.block_size, "paged" in runner.instance.pools)
    input_ids, positions, meta = runner.stager.tensors(step)
    with torch.inference_mode():
        logits = runner.instance.compute_logits(runner.forward_hidden(input_ids, positions, meta))
    out = {}
    for b, (seq, _n) in enumerate(items):
        out[seq.seq_id] = logits[step.query_start_loc[b] : step.query_start_loc[b + 1]].clone()
    engine.scheduler.advance(batch)
    return out


def add(llm: LLM, rid: str, prompt: list[int]) -> Sequence:
    engine = llm.llm_engine
    engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=200))
    return engine.requests[rid].seqs[0]


def feed(seq: Sequence, tokens: list[int]) -> None:
    """Append `tokens` after the computed context: the first as the sampled token, the rest as
    drafts of the same row."""
    assert seq.num_computed_tokens == seq.num_tokens
    seq.token_ids.extend(tokens)
    seq.num_draft_tokens = len(tokens) - 1


def seq_caches(llm: LLM, seq: Sequence, length: int) -> list[dict[str, torch.Tensor]]:
    """Per layer: the KV of the sequence's first `length` positions, or its state slot."""
    runner = llm.llm_engine.runner
    out = []
    for spec, cache in zip(runner.specs, runner.caches, strict=True):
        got = {}
        for name, t in cache.items():
            if spec.pool == "paged":
                flat = t[torch.tensor(seq.block_ids)].reshape(-1, *t.shape[2:])
                got[name] = flat[:length].clone()
            else:
                got[name] = t[seq.state_slot].clone()
        out.append(got)
    return out


@pytest.mark.parametrize("name", ["qwen3_5_r2_g3", "qwen3_g5"])
def test_rows_of_q_tokens_equal_one_by_one(name, tmp_path):
    model_dir, _ = build_model(SPECS_BY_NAME[name], tmp_path / name, load_oracle=False)
    a, b = make_llm(model_dir), make_llm(model_dir)
    gen = torch.Generator().manual_seed(3)
    cont = torch.randint(3, 90, (sum(CHUNKS),), generator=gen).tolist()

    # engine A: prefill, then one token per step; the other sequence alone at the end
    sa = add(a, "s", PROMPT)
    run_step(a)
    want = []
    for tok in cont:
        feed(sa, [tok])
        want.append(run_step(a)[sa.seq_id])
    want = torch.cat(want)  # [len(cont), vocab]
    caches_a = seq_caches(a, sa, len(PROMPT) + len(cont))
    oa = add(a, "o", OTHER)
    other_a = run_step(a)[oa.seq_id]
    other_caches_a = seq_caches(a, oa, len(OTHER))

    # engine B: prefill, then rows of q tokens; the other sequence's prefill shares a q = 5 step
    sb = add(b, "s", PROMPT)
    run_step(b)
    got, pos, ob, other_b = [], 0, None, None
    for q in CHUNKS:
        feed(sb, cont[pos : pos + q])
        if q == 5:
            ob = add(b, "o", OTHER)
        rows = run_step(b)
        assert rows[sb.seq_id].shape[0] == q
        got.append(rows[sb.seq_id])
        if q == 5:
            other_b = rows[ob.seq_id][-1:]
        pos += q
    got = torch.cat(got)
    caches_b = seq_caches(b, sb, len(PROMPT) + len(cont))
    other_caches_b = seq_caches(b, ob, len(OTHER))

    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(other_b, other_a[-1:], rtol=1e-4, atol=1e-4)
    for layer, (ca, cb) in enumerate(zip(caches_a, caches_b, strict=True)):
        for key in ca:
            torch.testing.assert_close(cb[key], ca[key], rtol=1e-4, atol=1e-5, msg=f"{layer} {key}")
    for ca, cb in zip(other_caches_a, other_caches_b, strict=True):
        for key in ca:
            torch.testing.assert_close(cb[key], ca[key], rtol=1e-4, atol=1e-5)


def test_decode_rows_of_one_q_lead_the_batch(tmp_path):
    """A step with rows of q = 4 (drafts) and a plain decode row: decode rows are grouped by q,
    smallest first; the first group is the decode part (one q per step), the other rows go
    through the prefill kernels, which serve any row."""
    model_dir, _ = build_model(SPECS_BY_NAME["qwen3_5_r2_g3"], tmp_path / "m", load_oracle=False)
    llm = make_llm(model_dir)
    s1, s2, s3 = (add(llm, r, PROMPT) for r in ("a", "b", "c"))
    run_step(llm)
    feed(s1, [4, 5, 6, 7])
    feed(s2, [8])
    feed(s3, [9, 10, 11, 12])
    engine = llm.llm_engine
    batch = engine.scheduler.schedule()
    items = batch.decodes_first()
    step = build_step_input(items, 16, True)
    assert (step.num_decodes, step.decode_query_len) == (1, 1)
    assert items[0][0] is s2
    assert {items[1][0].seq_id, items[2][0].seq_id} == {s1.seq_id, s3.seq_id}
    assert [n for _, n in items] == [1, 4, 4]
    engine.scheduler.advance(batch)
