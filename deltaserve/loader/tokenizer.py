"""Tokenizer, chat template and end-of-sequence ids of a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltaserve.loader.files import CheckpointFileError, one_line, read_json

# What makes a tokenizer: one of these sets of files (the vocabulary), or a *.tiktoken file.
# tokenizer_config.json alone does not count: without a vocabulary transformers fails or builds
# a tokenizer of one token that turns every prompt into nothing.
TOKENIZER_FILE_SETS: tuple[tuple[str, ...], ...] = (
    ("tokenizer.json",),  # the tokenizers library's serialization (fast tokenizers)
    ("tokenizer.model",),  # sentencepiece (Llama, Mistral, Gemma)
    ("vocab.json", "merges.txt"),  # byte-level BPE (GPT-2, Qwen)
    ("spiece.model",),  # sentencepiece (T5)
    ("sentencepiece.bpe.model",),  # sentencepiece (XLM-R)
    ("vocab.txt",),  # WordPiece (BERT)
)
# JSON files a tokenizer load reads: checked one by one to name the damaged one
_TOKENIZER_JSON = (
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "chat_template.json",
    "config.json",
)
_SKIP_HINT = "pass skip_tokenizer_init=True (--skip-tokenizer-init) to run on token ids only"


def has_tokenizer_files(path: str | Path) -> bool:
    """True when directory `path` holds a tokenizer vocabulary (see TOKENIZER_FILE_SETS)."""
    path = Path(path)
    if any(all((path / name).is_file() for name in names) for names in TOKENIZER_FILE_SETS):
        return True
    return any(path.glob("*.tiktoken"))


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's HF tokenizer (local files only). Raises ValueError on one line when the
    directory holds no tokenizer files, a tokenizer file is damaged (naming it) or the tokenizer
    cannot encode anything."""
    from transformers import AutoTokenizer

    from deltaserve.loader.hub import resolve_model_path

    path = resolve_model_path(path, what="tokenizer")
    if not has_tokenizer_files(path):
        expected = ", ".join(" + ".join(names) for names in TOKENIZER_FILE_SETS)
        raise ValueError(
            f"no tokenizer files in {path} (expected one of {expected} or a *.tiktoken file: "
            f"copy the model's tokenizer files there, point tokenizer= at them, or {_SKIP_HINT})"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises several types for a missing tokenizer
        for name in _TOKENIZER_JSON:  # a truncated file: name it
            if (path / name).is_file():
                read_json(path / name)
        raise ValueError(
            f"could not load a tokenizer from {path} ({type(e).__name__}: {one_line(e)}); "
            + _SKIP_HINT
        ) from e
    if len(tokenizer) < 2:
        raise ValueError(
            f"the tokenizer in {path} has {len(tokenizer)} token(s): its files are incomplete; "
            + _SKIP_HINT
        )
    return tokenizer


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
        value = read_json(gen).get("eos_token_id")
        try:
            ids |= set(_as_list(value))
        except (TypeError, ValueError) as e:
            raise CheckpointFileError(
                f"{gen} is not valid (eos_token_id {value!r} is not a token id or a list of them)"
            ) from e
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
