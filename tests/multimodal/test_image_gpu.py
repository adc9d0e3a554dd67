"""Images on the GPU (`pytest -m gpu`): the vision tower in bf16 against its float32 CPU run,
and the engine with images (fast backends, decode CUDA graphs, overlapped decode) in float32
against HF's float64 uncached forward: greedy tokens equal (teacher-forced) and logprobs within
1e-3, whole and chunked, with a text-only request in the batch."""

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

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@torch.no_grad()
def test_tower_bf16_on_gpu_matches_float32():
    from transformers import Qwen3_5VisionConfig

    from deltaserve.models.qwen3_5_vision import Qwen3_5VisionTower

    vc = Qwen3_5VisionConfig(depth=4, out_hidden_size=256)  # the released block shape
    torch.manual_seed(0)
    ref = Qwen3_5VisionTower(vc)
    for name, p in ref.named_parameters():
        mean = 1.0 if "norm" in name and name.endswith("weight") else 0.0
        fan_in = p.shape[-1] if p.dim() == 2 else (p[0].numel() if p.dim() > 2 else 1)
        p.copy_(torch.randn(p.shape) * (fan_in**-0.5 if p.dim() >= 2 else 0.02) + mean)
    gpu = Qwen3_5VisionTower(vc).to("cuda", torch.bfloat16)
    gpu.load_state_dict(ref.state_dict())
    grids = [[1, 28, 28], [1, 64, 64], [1, 22, 46]]  # 448^2, 1024^2 and an odd image
    n = sum(t * h * w for t, h, w in grids)
    patches = torch.randn(n, 3 * 2 * 16 * 16)
    want = ref(patches, grids)
    got = gpu(patches.cuda(), grids).float().cpu()
    rel = (got - want).norm() / want.norm()
    assert rel < 2e-2, f"bf16 tower relative error {rel:.3e}"


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked16"])
def test_engine_images_on_gpu(tmp_path, chunk):
    model_dir, oracle = build_vl_model("qwen3_5_vl", tmp_path / "vl")
    oracle = float64_oracle(oracle)
    kw = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(
        str(model_dir),
        device="cuda",
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        skip_tokenizer_init=True,
        # fla's chunked GDN prefill (picked on the GPU where installed) rounds float32 through
        # TF32, ~1e-2 in logprobs: the torch prefill keeps the comparison about the image path
        gdn_prefill_backend="torch",
        **kw,
    )
    processor = llm.llm_engine.image_processor.image_processor
    cfg = oracle.config
    cases = [
        (image_prompt(cfg, [[5, 6], "IMG", [9, 10, 11]]), [image(37, 53, seed=6)]),
        (
            image_prompt(cfg, [[8], "IMG", [20, 21], "IMG", [30]]),
            [image(21, 70, 7), image(45, 29, 8)],
        ),
        ([40 + i for i in range(29)], []),
    ]
    prompts = [
        {"prompt_token_ids": ids, **({"multi_modal_data": {"image": ims}} if ims else {})}
        for ids, ims in cases
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for (_, ims), out in zip(cases, outs, strict=True):
        ids = out.prompt_token_ids
        toks = list(out.outputs[0].token_ids)
        ref = hf_logprobs(oracle, processor, ids + toks[:-1], ims)
        assert greedy_mismatch(ref, len(ids), toks) is None
        for i, (t, lp) in enumerate(zip(toks, out.outputs[0].logprobs, strict=True)):
            assert abs(lp[t].logprob - float(ref[len(ids) - 1 + i, t])) < 1e-3
