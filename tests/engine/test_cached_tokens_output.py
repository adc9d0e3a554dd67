"""RequestOutput.num_cached_tokens reports prefix-cache hits (attention-only model)."""

from hf_models import build_model

from deltaserve import LLM, SamplingParams


def test_num_cached_tokens_reported(tmp_path):
    path, _ = build_model("qwen3_g1", tmp_path / "m", load_oracle=False)
    llm = LLM(
        str(path),
        device="cpu",
        max_model_len=128,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        block_size=16,
    )
    prompt = {"prompt_token_ids": [(5 * i) % 90 + 3 for i in range(40)]}
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = llm.generate(prompt, params)[0]
    second = llm.generate(prompt, params)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 32  # two full blocks; the last 8 tokens are recomputed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
