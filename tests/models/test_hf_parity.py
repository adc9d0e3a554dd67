"""Parity with HF transformers' own modeling code, on tiny random checkpoints (float32, CPU).

For every variant of `tests/hf_models.py`:
- prefill: our prompt_logprobs=-1 (the whole vocabulary at every prompt position) equals HF's
  `log_softmax(model(input_ids).logits)` within 1e-4, every position and every vocab entry;
  the logprobs of the first generated token (last prompt position) too;
- greedy decode: 24 tokens (ignore_eos) equal HF `generate(do_sample=False)` token for token,
  for prompts of different lengths, alone and submitted together in one batch.
Plus load errors: a missing, mis-shaped or unexpected tensor and an unsupported architecture fail
`LLM(...)` with a message that names them.
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

from hf_models import (  # noqa: E402
    ALL_SPECS,
    SPECS_BY_NAME,
    add_tensor,
    build_model,
    remove_tensor,
    replace_tensor,
    set_architectures,
    tensor_names,
)

from deltaserve import LLM, SamplingParams  # noqa: E402

LOGPROB_ATOL = 1e-4
NUM_NEW_TOKENS = 24
PREFILL_LEN = 37  # odd, spans several 16-token blocks
GREEDY_PROMPT_LENS = (37, 5, 130)  # 130: three 64-token GDN chunks, nine KV blocks


def _vocab_size(oracle) -> int:
    return oracle.config.get_text_config().vocab_size


def _random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    # Ids 3 .. vocab-5: no pad/bos/eos and none of the multimodal special tokens (the last 4).
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


@torch.no_grad()
def _hf_greedy(oracle, prompt: list[int], max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt])
    out = oracle.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    new = out[0, len(prompt) :].tolist()
    assert len(new) == max_new_tokens, "HF oracle stopped early (eos not disabled?)"
    return new


@pytest.fixture(scope="module", params=ALL_SPECS, ids=[s.name for s in ALL_SPECS])
def variant(request, tmp_path_factory):
    """(spec, checkpoint dir, HF oracle in fp32, our LLM loaded in fp32) per model variant."""
    spec = request.param
    model_dir, oracle = build_model(spec, tmp_path_factory.mktemp(spec.name))
    # Disable eos in the oracle's generation config: our side runs with ignore_eos=True.
    oracle.generation_config.eos_token_id = None
    llm = _make_llm(model_dir)
    yield spec, model_dir, oracle, llm
    del llm


def test_checkpoint_layout(variant):
    """The factory wrote what the variant claims (guards the other tests' coverage)."""
    spec, model_dir, oracle, _ = variant
    names = tensor_names(model_dir)
    if spec.max_shard_size is not None:
        assert (model_dir / "model.safetensors.index.json").exists()
        assert len(list(model_dir.glob("*.safetensors"))) > 1
    assert ("lm_head.weight" in names) != spec.tie_word_embeddings
    if spec.family == "qwen3_5_vl":
        assert any(n.startswith("model.language_model.") for n in names)
        assert any(n.startswith("model.visual.") for n in names)
        assert "mtp.fc.weight" in names
    if spec.dtype == "bfloat16":
        assert oracle.dtype == torch.float32  # the oracle runs fp32 on the bf16-rounded weights


@torch.no_grad()
def test_prefill_logprobs_match_hf(variant):
    spec, _, oracle, llm = variant
    vocab = _vocab_size(oracle)
    prompt = _random_prompt(PREFILL_LEN, vocab, seed=11)
    ref = torch.log_softmax(oracle(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [L, V]

    params = SamplingParams(
        temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=-1, logprobs=5
    )
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
    assert out.prompt_token_ids == prompt
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == PREFILL_LEN
    assert plp[0] is None
    ours = torch.full((PREFILL_LEN - 1, vocab), float("nan"))
    for p in range(1, PREFILL_LEN):
        entry = plp[p]
        assert len(entry) == vocab, f"position {p}: {len(entry)} entries, want the whole vocab"
        assert prompt[p] in entry
        ids = torch.tensor(list(entry.keys()))
        ours[p - 1, ids] = torch.tensor([lp.logprob for lp in entry.values()])
    # prompt_logprobs[p] is the distribution at position p - 1 (predicting token p).
    diff = (ours - ref[: PREFILL_LEN - 1]).abs()
    assert not diff.isnan().any()
    worst = int(diff.argmax())
    pos, tok = divmod(worst, vocab)
    assert diff.max().item() < LOGPROB_ATOL, (
        f"{spec.name}: max |logprob diff| {diff.max().item():.3e} at prompt position {pos + 1} "
        f"(logits of position {pos}), token {tok}; per-position max: "
        f"{[round(v, 6) for v in diff.max(dim=1).values.tolist()]}"
    )

    # The last prompt position: the first generated token and its top logprobs.
    comp = out.outputs[0]
    assert comp.token_ids == [int(ref[-1].argmax())]
    assert comp.logprobs is not None and len(comp.logprobs) == 1
    last = comp.logprobs[0]
    assert comp.token_ids[0] in last and len(last) >= 5
    for tok_id, lp in last.items():
        assert abs(lp.logprob - ref[-1, tok_id].item()) < LOGPROB_ATOL, (spec.name, tok_id)


def test_greedy_matches_hf_generate(variant):
    spec, _, oracle, llm = variant
    vocab = _vocab_size(oracle)
    prompts = [_random_prompt(n, vocab, seed=100 + n) for n in GREEDY_PROMPT_LENS]
    expected = [_hf_greedy(oracle, p, NUM_NEW_TOKENS) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)

    def check(outs, idx):
        for out, i in zip(outs, idx, strict=True):
            comp = out.outputs[0]
            assert out.prompt_token_ids == prompts[i]
            assert comp.finish_reason == "length"
            got = list(comp.token_ids)
            if got != expected[i]:
                first = next(
                    (k for k, (a, b) in enumerate(zip(got, expected[i], strict=False)) if a != b),
                    min(len(got), len(expected[i])),
                )
                pytest.fail(
                    f"{spec.name}, prompt len {len(prompts[i])}: first mismatch at generated "
                    f"token {first}\n ours: {got}\n   hf: {expected[i]}"
                )

    for i, prompt in enumerate(prompts):  # one at a time
        check(llm.generate([{"prompt_token_ids": prompt}], params), [i])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)  # one batch
    check(outs, range(len(prompts)))


# ---------------------------------------------------------------------------------------------
# Load errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec_name, tensor",
    [
        ("qwen3_g1", "model.layers.1.self_attn.k_proj.weight"),
        ("qwen3_g1", "model.norm.weight"),
        ("qwen3_5_r3_bf16_sharded", "model.layers.2.linear_attn.A_log"),  # sharded + index
        ("qwen3_5_vl", "model.language_model.layers.1.self_attn.q_norm.weight"),
    ],
)
def test_missing_tensor_is_named(tmp_path, spec_name, tensor):
    model_dir, _ = build_model(SPECS_BY_NAME[spec_name], tmp_path / "m", load_oracle=False)
    remove_tensor(model_dir, tensor)
    assert tensor not in tensor_names(model_dir)
    with pytest.raises(Exception, match=re.escape(tensor)):
        _make_llm(model_dir)


@pytest.mark.parametrize(
    "spec_name, tensor",
    [
        ("qwen3_g1", "model.layers.0.mlp.up_proj.weight"),
        ("qwen3_5_r2_g3", "model.layers.0.linear_attn.in_proj_qkv.weight"),
    ],
)
def test_misshaped_tensor_is_named_with_both_shapes(tmp_path, spec_name, tensor):
    model_dir, oracle = build_model(SPECS_BY_NAME[spec_name], tmp_path / "m")
    good = dict(oracle.named_parameters())[tensor]
    rows, cols = good.shape
    replace_tensor(model_dir, tensor, torch.zeros(rows, cols - 1))
    with pytest.raises(Exception, match=re.escape(tensor)) as excinfo:
        _make_llm(model_dir)
    msg = str(excinfo.value)
    assert re.search(rf"\b{rows},\s*{cols}\b", msg), f"expected shape ({rows}, {cols}) in: {msg}"
    assert re.search(rf"\b{rows},\s*{cols - 1}\b", msg), f"checkpoint shape missing in: {msg}"


def test_unexpected_tensor_is_named(tmp_path):
    model_dir, _ = build_model(SPECS_BY_NAME["qwen3_g1"], tmp_path / "m", load_oracle=False)
    extra = "model.layers.0.mlp.extra_proj.weight"
    add_tensor(model_dir, extra, torch.zeros(4, 4))
    with pytest.raises(Exception, match=re.escape(extra)):
        _make_llm(model_dir)


def test_unsupported_architecture_lists_supported(tmp_path):
    model_dir, _ = build_model(SPECS_BY_NAME["qwen3_g1"], tmp_path / "m", load_oracle=False)
    set_architectures(model_dir, ["LlamaForCausalLM"])
    with pytest.raises(Exception, match="LlamaForCausalLM") as excinfo:
        _make_llm(model_dir)
    msg = str(excinfo.value)
    for arch in ("Qwen3ForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"):
        assert arch in msg, f"{arch} not listed as supported in: {msg}"
