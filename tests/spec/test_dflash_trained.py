"""Real drafting: a tiny target and a tiny DFlash drafter trained here (CPU, seeded, about a
minute) on a low-entropy language (a random segment repeated: every token after the first
period is determined by the context, not by the last token; tests/spec/dflash_training.py),
then greedy speculative decoding through `DFlashProposer` with the target verifying.

- the trained drafter: mean acceptance length (accepted drafts + the bonus token) >= 3 at
  block 8 (7 drafts per step), and the output equals the target's plain greedy decoding;
- taps offset by one layer (config.json names the wrong layer): the context the drafter reads
  is not what it was trained on, and acceptance falls to about 1;
- every layer made causal: acceptance must stay high. A causal block hides only the MASK
  positions after each query, which carry no information at inference, while the whole context
  must stay visible (a causal mask built on block-relative positions would hide it and collapse
  acceptance); the flag must still change the drafter's logits.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dflash_training import (
    BLOCK,
    KV_BLOCK,
    PERIOD,
    TargetRunner,
    drafter_raw_config,
    language,
    load_target,
    make_proposer,
    save_drafter,
    speculative_greedy,
    train_drafter,
    train_target,
)

NEW_TOKENS = 40


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These ops are tiny: intra-op threads only add synchronisation (measured: 40x the CPU
    time with 2 threads on a busy 2-core machine), so this module runs on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("dflash_trained")
    gen = torch.Generator().manual_seed(0)
    hf_target, _ = train_target(root / "target", gen)
    raw = drafter_raw_config(num_layers=1)
    weights, _ = train_drafter(hf_target, raw, gen)
    target = load_target(root / "target")
    prompts = language(6, PERIOD + 3, torch.Generator().manual_seed(5)).tolist()
    return root, target, raw, weights, prompts


def _plain_greedy(target, prompt: list[int], n: int) -> list[int]:
    runner = TargetRunner(target)
    tokens = list(prompt)
    greedy, _ = runner.forward(tokens, 0, ())
    tokens.append(int(greedy[-1]))
    while len(tokens) - len(prompt) < n:
        greedy, _ = runner.forward(tokens[-1:], len(tokens) - 1, ())
        tokens.append(int(greedy[-1]))
    return tokens[len(prompt) :]


def _run(trained, raw: dict, name: str) -> tuple[float, list[list[int]]]:
    root, target, _, weights, prompts = trained
    proposer = make_proposer(save_drafter(root / name, raw, weights), target, BLOCK - 1)
    lengths, outputs = [], []
    for prompt in prompts:
        out, per_step = speculative_greedy(target, proposer, prompt, NEW_TOKENS)
        lengths += per_step
        outputs.append(out)
    return sum(lengths) / len(lengths), outputs


def test_trained_drafter_accepts_several_tokens_per_step(trained):
    _, target, raw, _, prompts = trained
    mean_len, outputs = _run(trained, raw, "drafter")
    assert mean_len >= 3.0, f"mean acceptance length {mean_len:.2f} at block {BLOCK}"
    for prompt, out in zip(prompts, outputs):
        assert out == _plain_greedy(target, prompt, NEW_TOKENS)


def test_taps_offset_by_one_layer_fall_to_one(trained):
    raw = copy.deepcopy(trained[2])
    taps = raw["dflash_config"]["target_layer_ids"]
    raw["dflash_config"]["target_layer_ids"] = [t + 1 for t in taps]
    mean_len, _ = _run(trained, raw, "offset")
    assert mean_len < 1.5, f"mean acceptance length {mean_len:.2f} with taps {taps} + 1"


def test_causal_block_keeps_the_context(trained):
    root, target, raw, weights, prompts = trained
    causal = {**copy.deepcopy(raw), "is_causal": True}
    mean_len, _ = _run(trained, causal, "causal")
    assert mean_len >= 3.0, f"mean acceptance length {mean_len:.2f} with a causal block"
    # the flag is read: the same context gives different block logits
    logits = []
    for name, cfg in (("drafter", raw), ("causal", causal)):
        proposer = make_proposer(save_drafter(root / name, cfg, weights), target, BLOCK - 1)
        runner = TargetRunner(target)
        _, hidden = runner.forward(prompts[0], 0, proposer.tap_layer_ids)
        drafter = proposer.drafter
        drafter.insert_context(
            torch.stack([hidden[i] for i in proposer.tap_layer_ids], dim=1),
            torch.arange(len(prompts[0])),
            torch.arange(16, 16 + len(prompts[0])),
        )
        logits.append(
            drafter.draft_logits(
                torch.tensor([prompts[0][-1]]),
                torch.tensor([len(prompts[0])], dtype=torch.int32),
                torch.tensor([[1, 2]], dtype=torch.int32),
                BLOCK - 1,
            )
        )
    assert (logits[0] - logits[1]).abs().max() > 1e-3


def test_trained_drafter_through_the_engine_with_graphs(trained, monkeypatch):
    """The trained pair through LLM with the decode-graph path (emulated on CPU): verify
    steps replay graphs that keep the taps the drafter reads (wrong or stale taps collapse
    acceptance, as the offset test shows), the drafter's block forward replays its graphs,
    and the output is the target's plain greedy output."""
    from deltaserve import LLM, SamplingParams

    root, _, raw, weights, prompts = trained
    drafter = save_drafter(root / "engine", raw, weights)
    monkeypatch.setenv("DELTASERVE_EMULATE_CUDA_GRAPHS", "1")
    common = dict(
        dtype="float32",
        device="cpu",
        max_model_len=128,
        max_num_seqs=4,
        block_size=KV_BLOCK,
        skip_tokenizer_init=True,
        seed=0,
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    plain = LLM(str(root / "target"), enforce_eager=True, **common)
    want = [list(o.outputs[0].token_ids) for o in plain.generate(requests, params)]
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": BLOCK - 1}
    llm = LLM(str(root / "target"), speculative_config=spec, **common)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(requests, params)]
    assert got == want
    engine = llm.llm_engine
    verify = sum(n for (_, q), n in engine.runner.graphs.replays.items() if q == BLOCK)
    assert verify > 0
    assert sum(engine.spec.proposer.graphs.replays.values()) > 0
    mean_len = engine.spec.stats.snapshot().mean_acceptance_length
    assert mean_len >= 3.0, f"mean acceptance length {mean_len:.2f} through the engine"
