"""Prompts in, validated token ids out: tokenizing, vocabulary and length checks, and image
placeholders expanded. The engine owns one; the server's front of an engine in another process
(deltaserve/server/engine_client.py) builds its own from what that engine reports, so prompts
are checked and preprocessed beside the HTTP handlers, not in the engine's process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deltaserve.config import EngineConfig
from deltaserve.loader.tokenizer import load_tokenizer


@dataclass(frozen=True)
class ProcessedPrompt:
    """A validated prompt: its text (if any), token ids (image placeholders expanded) and its
    images' record (deltaserve.multimodal.inputs.MultiModalRecord) or None."""

    text: str | None
    token_ids: list[int]
    mm: Any = None

    def __iter__(self):  # unpacks as (text, ids, mm)
        return iter((self.text, self.token_ids, self.mm))


def load_engine_tokenizer(config: EngineConfig) -> Any:
    """The model's tokenizer with the configured chat template, or None (skip_tokenizer_init)."""
    mc = config.model
    tokenizer = load_tokenizer(mc.tokenizer) if mc.tokenizer else None
    if tokenizer is not None and mc.chat_template is not None:
        tokenizer.chat_template = mc.chat_template
    return tokenizer


def build_image_processor(config: EngineConfig) -> Any:
    """The image input processor of a model whose vision tower is loaded (prompt + images ->
    ids with placeholders expanded + the images' record)."""
    from deltaserve.multimodal.processor import ImageInputProcessor, load_image_processor

    mc = config.model
    hf = mc.hf_config
    path = None if mc.random_model is not None else mc.path
    return ImageInputProcessor(
        load_image_processor(path, hf.vision_config), hf, config.limit_mm_per_prompt["image"]
    )


class PromptProcessor:
    """Validates prompts in vLLM's shapes; ValueError names what is wrong."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        image_processor: Any = None,
        no_image_reason: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.image_processor = image_processor
        self.no_image_reason = no_image_reason

    def process(self, prompt: str | dict | ProcessedPrompt) -> ProcessedPrompt:
        """(text, token ids, images' record or None), validated: vLLM's prompt shapes, with
        `{"multi_modal_data": {"image": PIL image or list}}` beside "prompt" or
        "prompt_token_ids" (one `<|image_pad|>` placeholder per image, expanded here)."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        text, ids = self.tokenize(prompt)
        record = None
        if mm_data is not None:
            if not isinstance(mm_data, dict) or set(mm_data) - {"image"}:
                raise ValueError(
                    "multi_modal_data must be {'image': PIL image or list of them}, got "
                    f"{sorted(mm_data) if isinstance(mm_data, dict) else type(mm_data)}"
                )
            if self.image_processor is None:
                raise ValueError(f"this engine takes no images: {self.no_image_reason}")
            ids, record = self.image_processor.process(ids, mm_data.get("image", []))
            self.check_length(ids)
        elif self.image_processor is not None:
            self.image_processor.check_no_placeholders(ids)
        return ProcessedPrompt(text, ids, record)

    def check_length(self, ids: list[int]) -> None:
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt ({len(ids)} tokens) is longer than the model allows: prompt plus "
                f"at least one generated token must fit max_model_len={self.max_model_len}"
            )

    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a text or token-id prompt (images not expanded)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass {'prompt_token_ids': [...]}")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            return self.tokenize(prompt["prompt"])
        else:
            raise ValueError(
                f"a prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt)}"
            )
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})"
            )
        self.check_length(ids)
        return text, ids
