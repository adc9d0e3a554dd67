"""Real MTP drafting: a tiny hybrid Qwen3.5 target and its MTP head trained here (CPU, seeded,
about 20 s; tests/spec/mtp_training.py: a language where t_{p+2} depends on a key only the
context holds), then greedy speculative decoding through the engine with
`speculative_config={"method": "mtp"}`:

- k = 2: mean acceptance length (accepted drafts + the bonus token) >= 1.8 and the output equals
  plain greedy decoding, for a batch of prompts beside chunked prefill; the same head left
  untrained drafts badly (the threshold means something);
- a stop token inside an accepted block ends the output there, as without speculation;
- the decode-graph path (emulated on CPU): verify steps replay graphs that keep the final-hidden
  tap the head reads (a stale or wrong tap would collapse acceptance), with the same output;
- sampling (temperature and top-k, seeded requests): the joint distribution of the first three
  tokens with MTP drafts (deterministic drafts, accepted while they equal the sampled token)
  is the target's exact one, enumerated from HF forwards (chi-square, as
  test_spec_sampling_engine.py).
"""

from __future__ import annotations

import itertools
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

_TESTS_DIR = Path(__file__).resolve().parents[1]
for extra in (_TESTS_DIR, _TESTS_DIR / "spec"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from mtp_helpers import add_mtp_head  # noqa: E402
from mtp_training import (  # noqa: E402
    KV_BLOCK,
    language,
    permutations,
    train_head,
    train_target,
)

from deltaserve import LLM, SamplingParams  # noqa: E402

NEW_TOKENS = 30


@pytest.fixture(scope="module")
def one_thread():
    """Tiny ops: intra-op threads only add synchronisation on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_thread):
    """(target dir with the trained head, plain greedy outputs, prompts)."""
    root = tmp_path_factory.mktemp("mtp_trained")
    gen = torch.Generator().manual_seed(0)
    table = permutations()
    hf_target, _ = train_target(root / "target", gen, table)
    train_head(hf_target, root / "target", gen, table)
    prompts = language(6, 9, torch.Generator().manual_seed(5), table).tolist()
    want = generate(make_llm(root / "target"), prompts, greedy())
    return root, want, prompts, hf_target


def make_llm(path: Path, k: int | None = None, **kw) -> LLM:
    args = dict(
        dtype="float32",
        device="cpu",
        max_model_len=128,
        max_num_seqs=4,
        block_size=KV_BLOCK,
        skip_tokenizer_init=True,
        seed=0,
        enforce_eager=True,
    )
    if k is not None:
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    args.update(kw)
    return LLM(str(path), **args)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **kw)


def generate(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def mean_length(llm: LLM) -> float:
    return llm.llm_engine.spec.stats.snapshot().mean_acceptance_length


def test_trained_head_accepts_and_keeps_the_output(trained):
    root, want, prompts, _ = trained
    # a budget of 8 tokens chunks the 9-token prompts beside verify rows
    llm = make_llm(root / "target", 2, max_num_batched_tokens=8)
    assert generate(llm, prompts, greedy()) == want
    assert mean_length(llm) >= 1.8, f"mean acceptance length {mean_length(llm):.2f} at k = 2"


def test_untrained_head_drafts_badly(trained, tmp_path):
    root, want, prompts, _ = trained
    untrained = tmp_path / "untrained"
    shutil.copytree(root / "target", untrained)
    add_mtp_head(untrained, seed=9)  # random mtp.* in place of the trained ones
    llm = make_llm(untrained, 2)
    assert generate(llm, prompts, greedy()) == want
    assert mean_length(llm) < 1.5, f"mean acceptance length {mean_length(llm):.2f} untrained"


def test_stop_token_inside_an_accepted_block(trained):
    root, want, prompts, _ = trained
    stop_id = want[0][4]  # inside the second verify row (k = 2: rows of up to 3 tokens)
    first = want[0].index(stop_id)
    llm = make_llm(root / "target", 2)
    params = [greedy(stop_token_ids=[stop_id]), greedy()]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
    assert list(outs[0].outputs[0].token_ids) == want[0][: first + 1]
    assert outs[0].outputs[0].finish_reason == "stop"
    assert list(outs[1].outputs[0].token_ids) == want[1]
    assert mean_length(llm) >= 1.8
    usage = llm.llm_engine.cache_usage()
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0, usage


def test_trained_head_with_verify_graphs(trained, monkeypatch):
    root, want, prompts, _ = trained
    monkeypatch.setenv("DELTASERVE_EMULATE_CUDA_GRAPHS", "1")
    llm = make_llm(root / "target", 2, enforce_eager=False)
    assert generate(llm, prompts, greedy()) == want
    graphs = llm.llm_engine.runner.graphs
    assert sum(n for (_, q), n in graphs.replays.items() if q == 3) > 0
    assert sum(llm.llm_engine.spec.proposer.graphs.replays.values()) > 0  # chain graphs
    assert mean_length(llm) >= 1.8, f"mean acceptance length {mean_length(llm):.2f} (graphs)"


def test_sampled_output_has_the_targets_distribution(trained):
    from test_spec_sampling_engine import HFLogits, filtered_probs

    root, _, prompts, hf_target = trained
    top_k, temperature, samples = 3, 6.0, 200
    prompt = prompts[0]
    llm = make_llm(root / "target", 2, max_num_seqs=256, max_num_batched_tokens=4096)
    params = [
        SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3, ignore_eos=True, seed=s)
        for s in range(samples)
    ]
    counts: dict[tuple[int, ...], int] = {}
    for t in generate(llm, [prompt] * samples, params):
        counts[tuple(t)] = counts.get(tuple(t), 0) + 1
    stats = llm.llm_engine.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepts and rejects
    logits = HFLogits(hf_target)
    exact: dict[tuple[int, ...], float] = {}
    p1 = filtered_probs(logits(tuple(prompt)), top_k, temperature)
    for t1 in p1.nonzero().flatten().tolist():
        p2 = filtered_probs(logits(tuple(prompt + [t1])), top_k, temperature)
        for t2 in p2.nonzero().flatten().tolist():
            p3 = filtered_probs(logits(tuple(prompt + [t1, t2])), top_k, temperature)
            for t3 in p3.nonzero().flatten().tolist():
                exact[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    assert set(counts) <= set(exact), "a token the target cannot sample"
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, prob in exact.items():
        e = prob * samples
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(cell, 0), pooled_exp + e
            continue
        stat += (counts.get(cell, 0) - e) ** 2 / e
        df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        df += 1
    critical = df * (1 - 2 / (9 * df) + 4.26 * math.sqrt(2 / (9 * df))) ** 3  # p ~ 1e-5
    assert stat < critical, (stat, df)
    assert len(list(itertools.islice(counts, 2))) == 2
