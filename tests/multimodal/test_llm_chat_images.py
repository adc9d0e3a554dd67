"""LLM.chat with image content parts (image_pil, data:, http and file:// URLs) on a tiny random
Qwen3.5 vision-language checkpoint: greedy tokens equal HF's uncached forward on the prompt the
chat template renders, with the images in part order; the same as llm.generate with the
images given as multi_modal_data; bad images raise MediaError naming the part."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest
from image_server import VL_CHAT_TEMPLATE, image_server, png_of

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vl_models import (  # noqa: E402
    PROCESSOR,
    build_vl_model,
    float64_oracle,
    greedy_mismatch,
    hf_logprobs,
    image,
)

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.multimodal.media import MediaError  # noqa: E402

NUM_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    model_dir, oracle = build_vl_model("qwen3_5_vl", tmp_path_factory.mktemp("vl"))
    oracle = float64_oracle(oracle)
    media = tmp_path_factory.mktemp("media")
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        max_model_len=256,
        seed=0,
        chat_template=VL_CHAT_TEMPLATE,
        allowed_local_media_path=str(media),
    )
    return llm, oracle, media


def expand(ids: list[int], images: list, image_token_id: int) -> list[int]:
    """ids with each image placeholder repeated grid_t*grid_h*grid_w / merge^2 times, as HF's
    Qwen processor expands it."""
    from transformers import Qwen2VLImageProcessor

    grids = Qwen2VLImageProcessor(**PROCESSOR)(images=images, return_tensors="pt")
    counts = iter(int(g.prod()) // PROCESSOR["merge_size"] ** 2 for g in grids["image_grid_thw"])
    out: list[int] = []
    for t in ids:
        out += [t] * next(counts) if t == image_token_id else [t]
    return out


def test_chat_image_parts_match_hf(vl):
    llm, oracle, media = vl
    pil, from_data, from_file, from_http = (
        image(37, 53, seed=1),
        image(21, 70, seed=2),
        image(45, 29, seed=3),
        image(16, 24, seed=4),
    )
    (media / "a.png").write_bytes(png_of(from_file))
    data_url = "data:image/png;base64," + base64.b64encode(png_of(from_data)).decode()
    with image_server({"/red.png": png_of(from_http)}) as srv:
        conversation = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "t5 t6"},
                    {"type": "image_pil", "image_pil": pil},
                    {"type": "text", "text": "t7"},
                    {"type": "image_url", "image_url": {"url": data_url}},
                ],
            },
            {"role": "assistant", "content": "t9 t10"},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"file://{media}/a.png"}},
                    {"type": "image_url", "image_url": {"url": f"{srv.url}/red.png"}},
                    {"type": "text", "text": "t11"},
                ],
            },
        ]
        text_only = [{"role": "user", "content": [{"type": "text", "text": "t12 t13"}]}]
        params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
        outs = llm.chat([conversation, text_only], params, use_tqdm=False)

    tokenizer = llm.get_tokenizer()
    images = [pil, from_data, from_file, from_http]
    rendered = tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "t5 t6"}, {"type": "image"}]
                + [{"type": "text", "text": "t7"}, {"type": "image"}],
            },
            {"role": "assistant", "content": "t9 t10"},
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "image"}]
                + [{"type": "text", "text": "t11"}],
            },
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered.count("<|image_pad|>") == 4
    assert outs[0].prompt == rendered
    ids = expand(
        tokenizer.encode(rendered, add_special_tokens=False), images, oracle.config.image_token_id
    )
    assert outs[0].prompt_token_ids == ids
    assert_hf_greedy(oracle, ids, images, outs[0].outputs[0].token_ids)
    # the same as generate with the images given directly
    again = llm.generate(
        {
            "prompt_token_ids": tokenizer.encode(rendered, add_special_tokens=False),
            "multi_modal_data": {"image": images},
        },
        params,
        use_tqdm=False,
    )
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    # the text-only conversation in the same batch: its text parts kept as the template's parts
    plain = tokenizer.apply_chat_template(text_only, tokenize=False, add_generation_prompt=True)
    assert outs[1].prompt == plain
    plain_ids = tokenizer.encode(plain, add_special_tokens=False)
    assert_hf_greedy(oracle, plain_ids, [], outs[1].outputs[0].token_ids)


def assert_hf_greedy(oracle, ids: list[int], images: list, generated: list[int]) -> None:
    """`generated` is HF's greedy continuation of `ids` (teacher-forced: each token is the
    argmax of HF's uncached forward at the position before it)."""
    assert len(generated) == NUM_NEW_TOKENS
    ref = hf_logprobs(oracle, _processor(), ids + generated, images)
    assert greedy_mismatch(ref, len(ids), generated) is None


def _processor():
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(**PROCESSOR)


def test_chat_bad_images_raise_media_error(vl, tmp_path):
    llm, _, media = vl
    (tmp_path / "outside.png").write_bytes(png_of(image(8, 8, seed=5)))
    cases = [
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            "cannot be decoded",
        ),
        (
            {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/outside.png"}},
            "outside the allowed directory",
        ),
        ({"type": "image_pil", "image_pil": "not an image"}, "expected a PIL.Image.Image"),
    ]
    for part, message in cases:
        messages = [{"role": "user", "content": [{"type": "text", "text": "t1"}, part]}]
        with pytest.raises(MediaError, match=rf"^messages\[0\]\.content\[1\]: .*{message}"):
            llm.chat(messages, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
