"""Tensor parallelism of DeepSeek-V2 on CPU over gloo: TP=2 gives TP=1's greedy tokens and
logprobs. Each rank holds half the query heads (q_proj / q_b_proj and kv_b_proj split by heads,
o_proj row-parallel) and the whole latent path, so its latent cache holds every token's whole
latent; the MoE block splits the experts' and the shared experts' widths."""

from __future__ import annotations

import gc

import pytest
from hf_models import SPECS_BY_NAME, build_model
from test_tensor_parallel import _assert_close, _make_llm, _prompts, _run, _worker_processes

from deltaserve.cache.spec import MLASpec
from deltaserve.distributed.parallel_state import tp_size


@pytest.mark.parametrize(
    "spec_name, prefill",
    [
        ("deepseek_v2_qproj_greedy_yarn", "absorbed"),  # q_proj, 4 heads, dense layer 0, YaRN
        ("deepseek_v2_qlora_grouped_sharded", "absorbed"),  # q LoRA, 6 heads, grouped routing
        # TP=2 with the expanded MLA prefill (each rank rebuilds its heads' keys and values)
        # against TP=1 absorbed
        ("deepseek_v2_qlora_grouped_sharded", "expanded"),
    ],
)
def test_mla_tp2_matches_tp1(tmp_path, monkeypatch, spec_name: str, prefill: str) -> None:
    spec = SPECS_BY_NAME[spec_name]
    cfg = spec.config
    model_dir, _ = build_model(spec, tmp_path / spec_name, load_oracle=False)
    prompts = _prompts(cfg["vocab_size"])

    ref_llm = _make_llm(model_dir, 1)
    ref, ref_plp = _run(ref_llm, prompts)
    del ref_llm
    monkeypatch.setenv("DELTASERVE_MLA_PREFILL", prefill)  # the workers inherit it

    llm = _make_llm(model_dir, 2)
    assert tp_size() == 2
    procs = _worker_processes(llm)
    try:
        model = llm.llm_engine.runner.model
        want = MLASpec(
            cfg["num_attention_heads"] // 2, cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        )
        assert model.layer_specs() == [want] * cfg["num_hidden_layers"]
        attn = model.model.layers[0].self_attn
        assert attn.w_uk.shape[0] == cfg["num_attention_heads"] // 2
        assert all(layer.mixer_partial and layer.ffn_partial for layer in model.model.layers)
        assert attn.prefill_mode == prefill
        ours, plp = _run(llm, prompts)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    assert all(not p.is_alive() and p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert tp_size() == 1

    for i, (a, b) in enumerate(zip(ours, ref)):
        assert list(a.token_ids) == list(b.token_ids), (spec_name, i)
        _assert_close(a.logprobs, b.logprobs, f"{spec_name}: logprobs of prompt {i}")
    _assert_close(plp, ref_plp, f"{spec_name}: prompt logprobs")
