"""Qwen3-Next: parity with HF transformers' own modeling code (modeling_qwen3_next) on tiny
random checkpoints (float32, CPU).

The variants (tests/hf_models.py, QWEN3_NEXT_SPECS): GDN value / key head ratios 2 and 3 with
K != V (both K > V and K < V); 10 experts top-3 (norm_topk_prob true), 12 experts top-4 and 10
experts top-4 (norm_topk_prob false); decoder_sparse_step 2 (dense layers 0 and 2) and
mlp_only_layers [0, 2]; per-expert and fused expert tensors; layer_types given and derived from
full_attention_interval. The GDN in_proj_qkvz / in_proj_ba rows are interleaved per key head:
a contiguous split gives wrong logits (test_contiguous_in_proj_split_is_caught). Routers are
peaky (gain 4) and every expert is used (checked on the oracle).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

_TESTS_DIR = Path(__file__).resolve().parents[1]
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))

from hf_models import QWEN3_NEXT_SPECS, build_model, tensor_names  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402

LOGPROB_ATOL = 1e-4
NUM_NEW_TOKENS = 24
PREFILL_LEN = 37
GREEDY_PROMPT_LENS = (37, 5, 130)


def _random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab - 4, (length,), generator=gen).tolist()


def _make_llm(model_dir: Path, **overrides) -> LLM:
    kwargs = dict(
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enable_chunked_prefill=True,
        block_size=16,
        skip_tokenizer_init=True,
        seed=0,
    )
    kwargs.update(overrides)
    return LLM(str(model_dir), **kwargs)


@pytest.fixture(scope="module", params=QWEN3_NEXT_SPECS, ids=[s.name for s in QWEN3_NEXT_SPECS])
def variant(request, tmp_path_factory):
    spec = request.param
    model_dir, oracle = build_model(spec, tmp_path_factory.mktemp(spec.name))
    oracle.set_experts_implementation("eager")
    oracle.generation_config.eos_token_id = None
    yield spec, model_dir, oracle, _make_llm(model_dir)


def _vocab(oracle) -> int:
    return oracle.config.get_text_config().vocab_size


def test_checkpoint_layout_and_routing(variant):
    """The checkpoint has the layout the variant claims, and on the parity prompt every layer's
    router uses every expert with many distinct top-k sets."""
    spec, model_dir, oracle, _ = variant
    names = tensor_names(model_dir)
    fused = [n for n in names if n.endswith("mlp.experts.gate_up_proj")]
    per_expert = [n for n in names if re.search(r"mlp\.experts\.\d+\.gate_proj\.weight$", n)]
    text = oracle.config.get_text_config()
    sparse = sum(
        type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in oracle.model.layers
    )
    if spec.fused_experts:
        assert len(fused) == sparse and not per_expert
    else:
        assert not fused and len(per_expert) == sparse * text.num_experts
    assert any(n.endswith("linear_attn.in_proj_qkvz.weight") for n in names)
    routes: list[torch.Tensor] = []
    routers = [m for m in oracle.modules() if type(m).__name__.endswith("TopKRouter")]
    hooks = [r.register_forward_hook(lambda m, i, out: routes.append(out[2])) for r in routers]
    try:
        with torch.no_grad():
            oracle(torch.tensor([_random_prompt(PREFILL_LEN, _vocab(oracle), seed=11)]))
    finally:
        for h in hooks:
            h.remove()
    assert len(routes) == sparse
    for ids in routes:
        assert ids.unique().numel() == text.num_experts
        assert len({tuple(sorted(r)) for r in ids.tolist()}) >= PREFILL_LEN // 2


def _prefill_max_diff(oracle, llm) -> tuple[float, torch.Tensor, list[int]]:
    vocab = _vocab(oracle)
    prompt = _random_prompt(PREFILL_LEN, vocab, seed=11)
    ref = torch.log_softmax(oracle(torch.tensor([prompt])).logits[0].float(), dim=-1)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=-1)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
    plp = out.prompt_logprobs
    ours = torch.full((PREFILL_LEN - 1, vocab), float("nan"))
    for p in range(1, PREFILL_LEN):
        ids = torch.tensor(list(plp[p].keys()))
        ours[p - 1, ids] = torch.tensor([lp.logprob for lp in plp[p].values()])
    diff = (ours - ref[: PREFILL_LEN - 1]).abs()
    assert not diff.isnan().any()
    return diff.max().item(), ref, list(out.outputs[0].token_ids)


@torch.no_grad()
def test_prefill_logprobs_match_hf(variant):
    spec, _, oracle, llm = variant
    diff, ref, tokens = _prefill_max_diff(oracle, llm)
    assert diff < LOGPROB_ATOL, f"{spec.name}: max |diff| {diff:.3e}"
    assert tokens == [int(ref[-1].argmax())]


@torch.no_grad()
def _hf_greedy(oracle, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = oracle.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=NUM_NEW_TOKENS,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_hf_generate(variant):
    """24 greedy tokens equal HF's: one prompt at a time, the three in one batch, and the batch
    again under a 32-token budget (chunked prefill: the 130-token prompt in five chunks, mixed
    with the others' decodes)."""
    spec, model_dir, oracle, llm = variant
    prompts = [_random_prompt(n, _vocab(oracle), seed=100 + n) for n in GREEDY_PROMPT_LENS]
    expected = [_hf_greedy(oracle, p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
        assert list(out.outputs[0].token_ids) == expected[i], (spec.name, "alone", i)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected, (spec.name, "batched")
    chunked = _make_llm(model_dir, max_num_batched_tokens=32)
    outs = chunked.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected, (spec.name, "chunked")


@torch.no_grad()
def test_contiguous_in_proj_split_is_caught(variant, monkeypatch):
    """Loading in_proj_qkvz / in_proj_ba by contiguous slicing (the classic bug) is far off."""
    from deltaserve.layers.gdn import InterleavedGDNInProj

    spec, model_dir, oracle, _ = variant

    def contiguous(self, shard, tensor):
        hk, hv, k, v = self.heads
        if shard == "in_proj_qkvz":
            qkv, z = tensor.split([2 * hk * k + hv * v, hv * v])
            return {"in_proj_qkv": qkv, "in_proj_z": z}
        b, a = tensor.split([hv, hv])
        return {"in_proj_b": b, "in_proj_a": a}

    monkeypatch.setattr(InterleavedGDNInProj, "deinterleave", contiguous)
    diff, _, _ = _prefill_max_diff(oracle, _make_llm(model_dir))
    assert diff > 1e-2, f"{spec.name}: contiguous slicing went unseen (max |diff| {diff:.3e})"


def test_registry_knows_qwen3_next():
    from deltaserve.models.registry import architecture_for_model_type, get_model_class

    assert architecture_for_model_type("qwen3_next") == "Qwen3NextForCausalLM"
    assert get_model_class("Qwen3NextForCausalLM").__name__ == "Qwen3NextForCausalLM"
