"""GET /tokenizer_info and /version: what clients probe before they send requests."""

from __future__ import annotations

from typing import Any

from deltaserve.server.protocol import TokenizerInfoResponse, VersionResponse
from deltaserve.server.serving_common import ServingContext


def tokenizer_info(ctx: ServingContext) -> TokenizerInfoResponse:
    """The served tokenizer's special tokens, chat template and lengths."""
    tok = ctx.tokenizer
    return TokenizerInfoResponse(
        tokenizer_class=type(tok).__name__,
        eos_token=_token(tok, "eos_token"),
        eos_token_id=_token_id(tok, "eos_token_id"),
        eos_token_ids=sorted(ctx.engine.eos_token_ids),
        bos_token=_token(tok, "bos_token"),
        bos_token_id=_token_id(tok, "bos_token_id"),
        pad_token=_token(tok, "pad_token"),
        pad_token_id=_token_id(tok, "pad_token_id"),
        chat_template=_chat_template(tok),
        model_max_length=ctx.max_model_len,
        vocab_size=ctx.engine.vocab_size,
    )


def version() -> VersionResponse:
    from deltaserve import __version__

    return VersionResponse(version=__version__)


def _token(tok: Any, name: str) -> str | None:
    value = getattr(tok, name, None)
    if value is None:
        return None
    return str(getattr(value, "content", value))  # an AddedToken carries its text in .content


def _token_id(tok: Any, name: str) -> int | None:
    value = getattr(tok, name, None)
    return None if value is None else int(value)


def _chat_template(tok: Any) -> str | None:
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one
        template = template.get("default")
    return template if isinstance(template, str) and template else None
