"""Engine-level speculative sampling (attention-only tiny model: its prefill is the cheapest on
CPU): a drafter with its own distribution q (the target at
another temperature and top-k, so q differs from p and has zeros where p > 0) and top-k
sampling; the joint distribution of the first 3 generated tokens over many seeded requests
matches the exact one enumerated from HF forwards of the target (chi-square)."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import torch

_TESTS_DIR = Path(__file__).resolve().parents[1]
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))

from hf_models import SPECS_BY_NAME, build_model  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.spec.proposer import Draft, Proposer  # noqa: E402
from deltaserve.spec.registry import ProposerMethod, register_proposer  # noqa: E402

PROMPT = [5, 17, 3, 44, 9, 12, 31]
TOP_K, TEMPERATURE = 3, 1.3
SAMPLES = 200


def filtered_probs(logits: torch.Tensor, top_k: int, temperature: float) -> torch.Tensor:
    work = logits.float() / temperature
    kth = work.topk(top_k).values[-1]
    return torch.softmax(work.masked_fill(work < kth, float("-inf")), dim=-1)


class HFLogits:
    """Last-position logits of the HF oracle, cached by prefix."""

    def __init__(self, oracle) -> None:
        self.oracle, self.cache = oracle, {}

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self.cache:
            with torch.no_grad():
                out = self.oracle(torch.tensor([list(prefix)]))
            self.cache[prefix] = out.logits[0, -1].float()
        return self.cache[prefix]


class SampledDrafter(Proposer):
    """Drafts one token from q = the target's distribution at top-k 2, temperature 0.7."""

    def __init__(self, spec, config) -> None:
        super().__init__(spec, config)
        self.logits = spec.options["logits"]
        self.gen = torch.Generator().manual_seed(0)

    def propose(self, seqs, max_drafts):
        out = []
        for seq in seqs:
            q = filtered_probs(self.logits(tuple(seq.token_ids)), 2, 0.7)
            d = int(torch.multinomial(q, 1, generator=self.gen))
            out.append(Draft([d], q[None]))
        return out


register_proposer(ProposerMethod("sampled_drafter", SampledDrafter, keys=("logits",)))


def test_speculative_sampling_in_the_engine_has_the_targets_distribution(tmp_path):
    path, oracle = build_model(SPECS_BY_NAME["qwen3_g5"], tmp_path / "m")
    logits = HFLogits(oracle)
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        max_model_len=64,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
        skip_tokenizer_init=True,
        seed=0,
        speculative_config={
            "method": "sampled_drafter",
            "num_speculative_tokens": 1,
            "logits": logits,
        },
    )
    params = [
        SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=3, ignore_eos=True, seed=s)
        for s in range(SAMPLES)
    ]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * SAMPLES, params, use_tqdm=False)
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        t = tuple(o.outputs[0].token_ids)
        counts[t] = counts.get(t, 0) + 1
    stats = llm.llm_engine.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepts and rejects

    # the exact joint distribution from the target's forwards
    exact: dict[tuple[int, ...], float] = {}
    p1 = filtered_probs(logits(tuple(PROMPT)), TOP_K, TEMPERATURE)
    for t1 in p1.nonzero().flatten().tolist():
        p2 = filtered_probs(logits(tuple(PROMPT + [t1])), TOP_K, TEMPERATURE)
        for t2 in p2.nonzero().flatten().tolist():
            p3 = filtered_probs(logits(tuple(PROMPT + [t1, t2])), TOP_K, TEMPERATURE)
            for t3 in p3.nonzero().flatten().tolist():
                exact[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    assert set(counts) <= set(exact), "a token the target cannot sample"
    # chi-square over cells with >= 5 expected samples, the rest pooled
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, prob in exact.items():
        e = prob * SAMPLES
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
