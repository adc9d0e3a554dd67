"""Pydantic models of the OpenAI protocol (requests and responses), with vLLM's extra fields.

Requests ignore unknown fields (clients send vendor extensions freely) and reject NaN and
infinities. Ranges that SamplingParams checks (temperature, top_p, penalties, ...) are checked
there, once; only what SamplingParams cannot know (caps on n and logprobs, seed range) is here.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

MAX_N = 128  # completions per prompt
MAX_LOGPROBS = 20  # top logprobs per position
_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1 - MAX_N  # torch seeds; the engine adds the index


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- shared ------------------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=_LONG_MIN, le=_LONG_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class PromptTokensDetails(_Response):
    cached_tokens: int = 0  # prompt tokens served by the prefix cache


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# ---- /v1/completions ---------------------------------------------------------------------------


class CompletionRequest(_SamplingFields):
    # NOTE: list[int] before list[str]: pydantic's smart union picks the exact match either way.
    prompt: str | list[int] | list[list[int]] | list[str]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None
    return_token_ids: bool = False  # vLLM's: each choice also carries its generated token ids
    multi_modal_data: Any = None  # refused with a 400 (images: chat only), not silently dropped


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids (a stream: this chunk's)


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# ---- /v1/chat/completions ----------------------------------------------------------------------


class ChatMessageParam(_Request):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    response_format: dict[str, Any] | None = None


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ChatMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(_Response):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(_Response):
    """Only the fields that are set: `{"role": "assistant", "content": ""}`, `{"content": ..}`
    or `{}`, as OpenAI streams them."""

    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# ---- models, tokenizer -------------------------------------------------------------------------


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "deltaserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class TokenizerInfoResponse(_Response):
    """GET /tokenizer_info: what a client needs to tokenize and template on its side (lm-eval's
    remote tokenizer reads eos_token, bos_token, pad_token and chat_template). vLLM returns the
    tokenizer's tokenizer_config.json fields; these are the ones clients read, by the same names.
    `model_max_length` is the server's max_model_len, `eos_token_ids` every id that ends a
    sequence (generation_config.json's, the config's and the tokenizer's)."""

    tokenizer_class: str
    eos_token: str | None
    eos_token_id: int | None
    eos_token_ids: list[int]
    bos_token: str | None
    bos_token_id: int | None
    pad_token: str | None
    pad_token_id: int | None
    chat_template: str | None
    model_max_length: int
    vocab_size: int


class VersionResponse(_Response):
    version: str
