"""DeepSeek-V2 (MLA + DeepSeek MoE): parity with HF transformers' own modeling code on tiny
random checkpoints (float32, CPU), and the layer math of the absorbed latent attention.

The variants (tests/hf_models.py, DEEPSEEK_V2_SPECS): q_proj with greedy routing scaled by 1.7,
YaRN with mscale != mscale_all_dim, a dense first layer and 2 shared experts; q LoRA with
group-limited routing (4 groups, 2 kept) scaled by 2.5, 1 shared expert, default rope, sharded.
Both have nope 16 != v 12. Routers are peaky (gain 4): every expert is used and the top-k sets
vary (checked on the oracle). The oracle runs HF's eager experts loop.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

_TESTS_DIR = Path(__file__).resolve().parents[1]
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))

from hf_models import DEEPSEEK_V2_SPECS, build_model, remove_tensor, tensor_names  # noqa: E402
from moe_parity import (  # noqa: E402
    GREEDY_PROMPT_LENS,
    LOGPROB_ATOL,
    NUM_NEW_TOKENS,
    PREFILL_LEN,
    make_llm,
    prefill_max_diff,
    random_prompt,
    record_rows,
    vocab_of,
)

from deltaserve import SamplingParams  # noqa: E402


@pytest.fixture(scope="module", params=DEEPSEEK_V2_SPECS, ids=[s.name for s in DEEPSEEK_V2_SPECS])
def variant(request, tmp_path_factory):
    spec = request.param
    model_dir, oracle = build_model(spec, tmp_path_factory.mktemp(spec.name))
    oracle.set_experts_implementation("eager")
    oracle.generation_config.eos_token_id = None
    yield spec, model_dir, oracle, make_llm(model_dir)


_GREEDY: dict[tuple[int, tuple[int, ...]], list[int]] = {}


@torch.no_grad()
def hf_greedy(oracle, prompt: list[int]) -> list[int]:
    """HF's greedy continuation from its uncached forward: the whole sequence each step
    (memoised per oracle and prompt: several tests share prompts)."""
    key = (id(oracle), tuple(prompt))
    if key not in _GREEDY:
        ids = list(prompt)
        for _ in range(NUM_NEW_TOKENS):
            logits = oracle(torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
        _GREEDY[key] = ids[len(prompt) :]
    return _GREEDY[key]


def _oracle_routes(oracle) -> list[torch.Tensor]:
    """The top-k expert ids [T, k] of every router of the oracle on the parity prompt."""
    routes: list[torch.Tensor] = []
    routers = [m for m in oracle.modules() if type(m).__name__ == "DeepseekV2TopkRouter"]
    hooks = [r.register_forward_hook(lambda m, i, out: routes.append(out[2])) for r in routers]
    try:
        with torch.no_grad():
            oracle(torch.tensor([random_prompt(PREFILL_LEN, vocab_of(oracle), seed=11)]))
    finally:
        for h in hooks:
            h.remove()
    return routes


def test_checkpoint_layout_and_routing(variant):
    """Per-expert tensors as released; every MoE layer's router uses every expert with many
    distinct top-k sets; a dense layer where first_k_dense_replace says."""
    spec, model_dir, oracle, _ = variant
    cfg = oracle.config
    names = tensor_names(model_dir)
    per_expert = [n for n in names if re.search(r"mlp\.experts\.\d+\.gate_proj\.weight$", n)]
    num_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert len(per_expert) == num_moe * cfg.n_routed_experts
    assert ("model.layers.0.mlp.gate_proj.weight" in names) == (cfg.first_k_dense_replace > 0)
    assert ("model.layers.0.self_attn.q_a_proj.weight" in names) == (cfg.q_lora_rank is not None)
    routes = _oracle_routes(oracle)
    assert len(routes) == num_moe
    for ids in routes:
        assert ids.unique().numel() == cfg.n_routed_experts
        assert len({tuple(sorted(r)) for r in ids.tolist()}) >= PREFILL_LEN // 2


def test_prefill_logprobs_match_hf(variant):
    spec, _, oracle, llm = variant
    diff, ref, tokens = prefill_max_diff(oracle, llm)
    assert diff < LOGPROB_ATOL, f"{spec.name}: max |diff| {diff:.3e}"
    assert tokens == [int(ref[-1].argmax())]


def test_greedy_matches_hf(variant):
    """24 greedy tokens equal HF's uncached greedy: one prompt at a time, the three in one
    batch, and the batch again under a 32-token budget (the 130-token prompt in chunks, mixed
    with the others' decodes)."""
    spec, model_dir, oracle, llm = variant
    prompts = [random_prompt(n, vocab_of(oracle), seed=100 + n) for n in GREEDY_PROMPT_LENS]
    expected = [hf_greedy(oracle, p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
        assert list(out.outputs[0].token_ids) == expected[i], (spec.name, "alone", i)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected, (spec.name, "batched")
    chunked = make_llm(model_dir, max_num_batched_tokens=32)
    outs = chunked.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected, (spec.name, "chunked")


@pytest.mark.parametrize("budget", [7, 16])
def test_chunked_prefill_matches_hf(variant, budget):
    """Chunks of 7 and 16 tokens (a 130-token prompt over many steps, batched with a short
    one's prefill and decodes)."""
    spec, model_dir, oracle, _ = variant
    prompts = [random_prompt(n, vocab_of(oracle), seed=100 + n) for n in (130, 5)]
    expected = [hf_greedy(oracle, p) for p in prompts]
    llm = make_llm(model_dir, max_num_batched_tokens=budget, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected, (spec.name, budget)


def test_prefix_cache_hit_equals_miss(variant):
    """A second request sharing a 35-token prefix (two full blocks) hits the prefix cache and
    gives the tokens and logprobs of a cold engine."""
    spec, model_dir, oracle, _ = variant
    vocab = vocab_of(oracle)
    shared = random_prompt(35, vocab, seed=300)
    first, second = shared + random_prompt(4, vocab, 301), shared + random_prompt(6, vocab, 302)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    warm = make_llm(model_dir)
    warm.generate([{"prompt_token_ids": first}], params)
    (hit,) = warm.generate([{"prompt_token_ids": second}], params)
    (miss,) = make_llm(model_dir).generate([{"prompt_token_ids": second}], params)
    assert hit.num_cached_tokens >= 32, hit.num_cached_tokens
    assert miss.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    for a, b in zip(hit.outputs[0].logprobs, miss.outputs[0].logprobs, strict=True):
        for tok, lp in a.items():
            assert abs(lp.logprob - b[tok].logprob) < 1e-4


def test_expanded_prefill_matches_hf(variant, monkeypatch):
    """DELTASERVE_MLA_PREFILL=expanded (keys and values rebuilt from the latents in prefill
    steps, deltaserve.ops.mla.expanded): prompt logprobs as HF's, greedy tokens as HF's with the
    prompt in chunks of 7 (each chunk attends its cached context) batched with a short prompt,
    and a prefix-cache hit (its context comes only from the cache) as a cold run."""
    spec, model_dir, oracle, _ = variant
    monkeypatch.setenv("DELTASERVE_MLA_PREFILL", "expanded")
    llm = make_llm(model_dir)
    layers = llm.llm_engine.runner.model.model.layers
    assert all(layer.self_attn.prefill_mode == "expanded" for layer in layers)
    diff, ref, tokens = prefill_max_diff(oracle, llm)
    assert diff < LOGPROB_ATOL, f"{spec.name}: max |diff| {diff:.3e}"
    assert tokens == [int(ref[-1].argmax())]
    prompts = [random_prompt(n, vocab_of(oracle), seed=100 + n) for n in (130, 5)]
    expected = [hf_greedy(oracle, p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    chunked = make_llm(model_dir, max_num_batched_tokens=7, max_num_seqs=2)
    outs = chunked.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected, spec.name
    (again,) = chunked.generate([{"prompt_token_ids": prompts[0]}], params)
    assert again.num_cached_tokens >= 128  # the whole prompt but its last block from the cache
    assert list(again.outputs[0].token_ids) == expected[0]


def test_auto_prefill_expands_long_queries_only(variant, monkeypatch):
    """DELTASERVE_MLA_PREFILL unset (`auto`): a step's prefill rows run expanded when its
    longest prefill query has at least the backend's `expanded_min_query` tokens (16 here, on
    the torch backend these runs use; the Triton backend's is 4096): the 130-token prompt in
    one step expands in every layer, in chunks of 7 no step does; beside a 5-token prompt in
    steps of 64 tokens, the step after the first mixes that prompt's decode row (absorbed,
    `decode_rows`) with 63 expanded prefill rows. All give HF's greedy tokens."""
    import deltaserve.layers.mla as mla_layer
    from deltaserve.ops.mla.reference import TorchMLABackend

    spec, model_dir, oracle, _ = variant
    monkeypatch.delenv("DELTASERVE_MLA_PREFILL", raising=False)
    monkeypatch.setattr(TorchMLABackend, "expanded_min_query", 16)
    expanded_rows = record_rows(monkeypatch, mla_layer, "expanded_prefill")
    decode_rows = record_rows(monkeypatch, TorchMLABackend, "decode_rows")
    prompt = random_prompt(130, vocab_of(oracle), seed=230)
    expected = hf_greedy(oracle, prompt)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    whole = make_llm(model_dir)
    assert whole.llm_engine.runner.model.model.layers[0].self_attn.prefill_mode == "auto"
    (out,) = whole.generate([{"prompt_token_ids": prompt}], params)
    assert list(out.outputs[0].token_ids) == expected, spec.name
    assert expanded_rows == [130] * spec.config["num_hidden_layers"]
    expanded_rows.clear()
    chunked = make_llm(model_dir, max_num_batched_tokens=7, max_num_seqs=1)
    (out,) = chunked.generate([{"prompt_token_ids": prompt}], params)
    assert list(out.outputs[0].token_ids) == expected, spec.name
    assert expanded_rows == []
    short = random_prompt(5, vocab_of(oracle), seed=235)
    mixed = make_llm(
        model_dir, max_num_batched_tokens=64, max_num_seqs=2, enable_prefix_caching=False
    )
    outs = mixed.generate([{"prompt_token_ids": p} for p in (short, prompt)], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(oracle, short), expected]
    layers = spec.config["num_hidden_layers"]
    # step 1: 5 + 59 prefill rows; step 2: one decode row beside 63 prefill rows; step 3's 8
    # prefill rows (below 16) run absorbed with the decode row
    assert expanded_rows == [64] * layers + [63] * layers, spec.name
    assert decode_rows == [1] * layers


def test_legacy_rope_scaling_config(variant, tmp_path):
    """config.json in the released layout (`rope_scaling: {type: yarn, ...}` and top-level
    rope_theta, no rope_parameters) gives the same logprobs."""
    spec, model_dir, oracle, _ = variant
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for f in model_dir.iterdir():
        (legacy / f.name).symlink_to(f)
    (legacy / "config.json").unlink()
    cfg = json.loads((model_dir / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        params["type"] = params.pop("rope_type")
        cfg["rope_scaling"] = params
    (legacy / "config.json").write_text(json.dumps(cfg))
    diff, _, _ = prefill_max_diff(oracle, make_llm(legacy))
    assert diff < LOGPROB_ATOL, f"{spec.name}: max |diff| {diff:.3e}"


@pytest.mark.parametrize(
    "tensor",
    [
        "model.layers.2.mlp.experts.7.up_proj.weight",
        "model.layers.1.self_attn.kv_b_proj.weight",
        "model.layers.1.mlp.shared_experts.down_proj.weight",
    ],
)
def test_missing_tensor_is_named(tmp_path, tensor):
    model_dir, _ = build_model(DEEPSEEK_V2_SPECS[0], tmp_path / "m", load_oracle=False)
    remove_tensor(model_dir, tensor)
    with pytest.raises(Exception, match=re.escape(tensor)):
        make_llm(model_dir)
