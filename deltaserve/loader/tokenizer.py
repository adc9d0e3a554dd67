"""Tokenizer, chat template and end-of-sequence ids of a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's HF tokenizer (local files only)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises several types for a missing tokenizer
        raise ValueError(
            f"could not load a tokenizer from {path} ({type(e).__name__}: {e}); "
            "pass skip_tokenizer_init=True to run on token ids only"
        ) from e


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def eos_token_ids(path: str | Path, text_config: Any, tokenizer: Any | None) -> set[int]:
    """End-of-sequence ids: generation_config.json's, the config's and the tokenizer's."""
    ids = set(_as_list(getattr(text_config, "eos_token_id", None)))
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        ids |= set(_as_list(json.loads(gen.read_text()).get("eos_token_id")))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict],
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict | None = None,
) -> tuple[str, list[int]]:
    """Render `messages` with the checkpoint's chat template; returns (text, token ids)."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer (the engine was started with skip_tokenizer_init)")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    text = tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **(chat_template_kwargs or {}),
    )
    return text, tokenizer.encode(text, add_special_tokens=False)
