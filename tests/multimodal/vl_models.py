"""Tiny Qwen3.5 vision-language checkpoints for the image tests, in the released layout: the
weights of tests/hf_models.py's `qwen3_5_vl` / `qwen3_5_moe_vl_fused` (model.language_model.*,
model.visual.* with a randomised tower, lm_head, an extra mtp.* tensor), plus the image
processor's preprocessor_config.json and a tokenizer whose last four ids are Qwen3.5's special
tokens (<|image_pad|>, <|video_pad|>, <|vision_start|>, <|vision_end|>, as the config says).

The oracle is HF's Qwen3_5(Moe)ForConditionalGeneration, run uncached on the whole sequence
with the processor's pixel_values and image_grid_thw (`hf_logprobs`, `hf_greedy`), in float64
(`float64_oracle`)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

_TESTS_DIR = Path(__file__).resolve().parents[1]
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))

from hf_models import SPECS_BY_NAME, build_model  # noqa: E402

# patch 4, merge 2: images snap to multiples of 8 pixels; at most 64 x 64 pixels
PROCESSOR = dict(
    patch_size=4,
    temporal_patch_size=2,
    merge_size=2,
    size={"shortest_edge": 64, "longest_edge": 64 * 64},
)
SPECIAL = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Word-level tokenizer: "t{i}" is id i below vocab - 4, then the four special tokens."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    n = vocab_size - len(SPECIAL)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(n)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", pad_token="t0")
    fast.save_pretrained(out_dir)
    assert fast.convert_tokens_to_ids("<|image_pad|>") == vocab_size - 4


def build_vl_model(name: str, out_dir: Path, load_oracle: bool = True):
    """(checkpoint dir, HF oracle or None) of tiny VL spec `name` with processor + tokenizer."""
    from transformers import Qwen2VLImageProcessor

    model_dir, oracle = build_model(SPECS_BY_NAME[name], out_dir, load_oracle=load_oracle)
    if oracle is not None and hasattr(oracle, "set_experts_implementation"):
        oracle.set_experts_implementation("eager")  # as tests/models/test_moe_parity.py
    Qwen2VLImageProcessor(**PROCESSOR).save_pretrained(model_dir)
    vocab = SPECS_BY_NAME[name].config["vocab_size"]
    write_tokenizer(model_dir, vocab)
    return model_dir, oracle


def image(height: int, width: int, seed: int):
    """A random RGB PIL image of the given size."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


def image_prompt(config, parts: list) -> list[int]:
    """Token ids from parts: lists of text ids, or "IMG" for one image placeholder group
    <|vision_start|><|image_pad|><|vision_end|> (as the chat template writes an image)."""
    ids: list[int] = []
    for part in parts:
        if part == "IMG":
            ids += [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
        else:
            ids += list(part)
    return ids


def _pixels(processor, images):
    if not images:
        return {}
    out = processor(images=images, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def float64_oracle(oracle):
    """The oracle in float64: the exact math, against which fp32 rounding of ours and of HF's
    own fp32 forward both show (on these MoE models HF fp32 strays up to ~2e-4 from it)."""
    return oracle.double()


@torch.no_grad()
def hf_logprobs(oracle, processor, ids: list[int], images: list) -> torch.Tensor:
    """log_softmax of HF's uncached forward over `ids` (placeholders expanded) [L, V]."""
    x = torch.tensor([ids])
    kwargs = _pixels(processor, images)
    if "pixel_values" in kwargs:
        kwargs["pixel_values"] = kwargs["pixel_values"].to(oracle.dtype)
    if images:
        kwargs["mm_token_type_ids"] = (x == oracle.config.image_token_id).int()
    logits = oracle(input_ids=x, use_cache=False, **kwargs).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def greedy_mismatch(ref: torch.Tensor, prompt_len: int, tokens: list[int]) -> int | None:
    """Teacher-forced greedy check: `ref` [L + n, V] are HF's logprobs over prompt + our n
    generated tokens; our tokens are HF's greedy output iff each is the argmax at the position
    before it. The first index where it is not, or None."""
    for i, t in enumerate(tokens):
        if int(ref[prompt_len - 1 + i].argmax()) != t:
            return i
    return None
