"""Images through the engine equal HF's uncached Qwen3_5(Moe)ForConditionalGeneration forward
on tiny random checkpoints with a randomised vision tower (tests/multimodal/vl_models.py), CPU:
prompt logprobs at every position (image tokens included) within 1e-4 and 24 greedy tokens
(teacher-forced: each is HF's argmax after the ones before it), for one and two images of odd
sizes interleaved with text, batched with a text-only request, whole and with chunked prefill
of 16 tokens splitting the images.

Ours runs in float32, the oracle in float64: HF's own float32 forward strays up to ~2e-4 from
float64 at single positions of the MoE model, so 1e-4 against it would test HF's rounding.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vl_models import (  # noqa: E402
    build_vl_model,
    float64_oracle,
    greedy_mismatch,
    hf_logprobs,
    image,
    image_prompt,
)

from deltaserve import LLM, SamplingParams  # noqa: E402

LOGPROB_ATOL = 1e-4
NUM_NEW_TOKENS = 24


def _llm(model_dir: Path, **overrides) -> LLM:
    kwargs = dict(
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_seqs=8,
        block_size=16,
        seed=0,
    )
    kwargs.update(overrides)
    return LLM(str(model_dir), **kwargs)


@pytest.fixture(scope="module", params=["qwen3_5_vl", "qwen3_5_moe_vl_fused"])
def vl(request, tmp_path_factory):
    model_dir, oracle = build_vl_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, model_dir, float64_oracle(oracle)


def _cases(config):
    """(ids with one placeholder per image, images): one image, two images, text only."""
    one = image_prompt(config, [[5, 6, 7], "IMG", [9, 10, 11, 12, 13]])
    two = image_prompt(config, [[8], "IMG", [20, 21, 22], "IMG", [30, 31]])
    text = [40 + i for i in range(29)]
    return [
        (one, [image(37, 53, seed=6)]),  # grid 10 x 14: 35 tokens
        (two, [image(21, 70, seed=7), image(45, 29, seed=8)]),  # 27 and 24 tokens
        (text, []),
    ]


def _prompt(ids, images):
    if not images:
        return {"prompt_token_ids": ids}
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked16"])
def test_images_match_hf(vl, chunk):
    name, model_dir, oracle = vl
    overrides = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = _llm(model_dir, skip_tokenizer_init=True, **overrides)
    processor = llm.llm_engine.image_processor.image_processor
    cases = _cases(oracle.config)
    params = SamplingParams(
        temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, prompt_logprobs=-1
    )
    outs = llm.generate([_prompt(ids, ims) for ids, ims in cases], params, use_tqdm=False)
    if chunk:  # the images really were split across steps
        assert max(len(o.prompt_token_ids) for o in outs) > 3 * chunk
    for (_, ims), out in zip(cases, outs, strict=True):
        expanded = out.prompt_token_ids
        n_img = sum(t == oracle.config.image_token_id for t in expanded)
        assert n_img == (0 if not ims else {1: 35, 2: 51}[len(ims)])
        generated = list(out.outputs[0].token_ids)
        # one uncached HF forward over prompt + our tokens (teacher-forced greedy check)
        ref = hf_logprobs(oracle, processor, expanded + generated[:-1], ims)  # [L + n - 1, V]
        L, V = len(expanded), ref.shape[1]
        ours = torch.full((L - 1, V), float("nan"))
        for p in range(1, L):
            entry = out.prompt_logprobs[p]
            keys = torch.tensor(list(entry.keys()))
            ours[p - 1, keys] = torch.tensor([lp.logprob for lp in entry.values()])
        diff = (ours.double() - ref[: L - 1]).abs()
        assert not diff.isnan().any()
        assert diff.max().item() < LOGPROB_ATOL, f"{name}: prompt logprobs off by {diff.max()}"
        assert len(generated) == NUM_NEW_TOKENS
        bad = greedy_mismatch(ref, L, generated)
        assert bad is None, f"{name}: generated token {bad} is not HF's greedy choice"


def test_text_prompt_with_image(vl):
    """A text prompt with the chat template's placeholder group, through the tokenizer."""
    name, model_dir, oracle = vl
    llm = _llm(model_dir)
    processor = llm.llm_engine.image_processor.image_processor
    text = "t5 t6 <|vision_start|><|image_pad|><|vision_end|> t9 t10"
    img = image(30, 41, seed=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate(
        {"prompt": text, "multi_modal_data": {"image": img}}, params, use_tqdm=False
    )
    ids = out.prompt_token_ids
    assert ids[:3] == [5, 6, oracle.config.vision_start_token_id]
    generated = list(out.outputs[0].token_ids)
    ref = hf_logprobs(oracle, processor, ids + generated[:-1], [img])
    assert greedy_mismatch(ref, len(ids), generated) is None
