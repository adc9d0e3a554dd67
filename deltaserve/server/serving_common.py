"""What the completion and chat handlers share: prompt checks, sampling params, SSE, the chat
template and its content parts, loading images off the event loop, and running a handler until
the client disconnects."""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.loader.tokenizer import apply_chat_template
from deltaserve.multimodal.chat_parts import ChatInputs, ImageSource, parse_chat_messages
from deltaserve.multimodal.media import MediaError, MediaLoader, default_thread_count
from deltaserve.sampling_params import SamplingParams
from deltaserve.server.async_engine import AsyncEngine
from deltaserve.server.errors import BadRequest, error_body
from deltaserve.server.protocol import ChatMessageParam

DONE = "data: [DONE]\n\n"
TOKENIZE_THREADS = 2  # HF fast tokenizers release the GIL: long prompts tokenize in parallel

T = TypeVar("T")

# Arguments of transformers' apply_chat_template that chat_template_kwargs may not override.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    "conversation messages tools documents chat_template add_generation_prompt "
    "continue_final_message tokenize padding truncation max_length return_tensors return_dict "
    "return_assistant_tokens_mask tokenizer_kwargs".split()
)


@dataclass
class ServingContext:
    """The engine and what the handlers need to know about the served model."""

    async_engine: AsyncEngine
    model_names: list[str]
    media: MediaLoader = field(default_factory=MediaLoader)
    _token_text: dict[int, str] = field(default_factory=dict)
    _threads: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(
            TOKENIZE_THREADS, thread_name_prefix="deltaserve-tokenize"
        )
    )
    # NOTE: media loads wait on the network: their own threads, so that a slow image URL holds
    # up neither tokenizing nor other requests' images
    _media_threads: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(
            default_thread_count(), thread_name_prefix="deltaserve-media"
        )
    )

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in a tokenizer thread, so that tokenizing or templating a long
        prompt never blocks the event loop (other requests, /health); its exceptions propagate."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, functools.partial(fn, *args, **kwargs))

    def check_takes_images(self) -> None:
        """400 if the served model takes no images (before any image is fetched)."""
        if self.engine.image_processor is not None:
            return
        from deltaserve.multimodal.limits import no_image_reason

        reason = no_image_reason(self.engine.config)
        if reason is None:
            reason = f"{self.engine.config.model.architecture} has no vision tower in deltaserve"
        raise BadRequest(f"this model takes no images: {reason}", "messages")

    async def process_prompt(self, prompt: dict[str, Any]) -> Any:
        """The engine's ProcessedPrompt of an image prompt (image placeholders expanded, images
        preprocessed), checked; 400 naming what is wrong. Runs in a media thread, so that
        preprocessing holds up neither the event loop, nor tokenizing, nor the engine thread."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._media_threads, self.engine.process_prompt, prompt
            )
        except ValueError as e:
            raise BadRequest(str(e), "messages") from e

    async def load_images(self, sources: list[ImageSource]) -> list[Any]:
        """The images of one request, loaded concurrently in media threads; 400 naming the
        first (in prompt order) that cannot be used."""
        loop = asyncio.get_running_loop()
        futures = [
            loop.run_in_executor(self._media_threads, source.load, self.media) for source in sources
        ]
        results = await asyncio.gather(*futures, return_exceptions=True)
        for result in results:
            if isinstance(result, MediaError):
                raise BadRequest(str(result), "messages") from result
            if isinstance(result, BaseException):
                raise result
        return results

    def close(self) -> None:
        """Stop the tokenizer and media threads (work already running finishes)."""
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._media_threads.shutdown(wait=False, cancel_futures=True)

    @property
    def engine(self) -> LLMEngine:
        return self.async_engine.engine

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.model.max_model_len

    def check_model(self, name: str | None) -> str:
        """The model name to report; 400 for a name this server does not serve."""
        if name is None or name in self.model_names:
            return name or self.model_names[0]
        raise BadRequest(f"The model `{name}` does not exist; served: {self.model_names}", "model")

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(text, token ids) of a text or token-id prompt, checked against the vocabulary and
        max_model_len (400 otherwise)."""
        arg = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        try:
            return self.engine.tokenize_prompt(arg)
        except ValueError as e:
            raise BadRequest(str(e), "prompt") from e

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        if max_tokens is None or num_prompt_tokens + max_tokens <= self.max_model_len:
            return
        raise BadRequest(
            f"This model's maximum context length is {self.max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} in the completion). Reduce the prompt or max_tokens.",
            "max_tokens",
        )

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


def sampling_params(
    req: Any, *, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    """SamplingParams from the fields that completions and chat share; 400 if invalid."""
    if req.logit_bias:
        raise BadRequest("logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise BadRequest("stream_options can only be set when stream=True", "stream_options")
    kwargs: dict[str, Any] = dict(
        n=req.n,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]  # SamplingParams' messages start with the field's name
        raise BadRequest(str(e), name if name in kwargs else None) from e


def check_stop_token_ids(stop_token_ids: list[int] | None, vocab_size: int) -> None:
    bad = [t for t in stop_token_ids or [] if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(
            f"stop_token_ids {bad[:5]} outside the vocabulary [0, {vocab_size})", "stop_token_ids"
        )


def chat_inputs(messages: list[ChatMessageParam]) -> ChatInputs:
    """The template conversation of `messages` and their images' sources, in prompt order;
    text-only part lists are joined with newlines; 400 naming a malformed or unsupported part.
    No I/O: the images are loaded afterwards (ServingContext.load_images)."""
    dumped = []
    for m in messages:
        out = m.model_dump(exclude_none=True)
        out["content"] = m.content
        dumped.append(out)
    try:
        return parse_chat_messages(dumped, allow_pil=False, join_text_parts=True)
    except ValueError as e:
        raise BadRequest(str(e), "messages") from e


def render_chat(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
    chat_template_kwargs: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
) -> tuple[str, list[int]]:
    """The chat template applied to `conversation` (chat_inputs'): (text, token ids); 400 if it
    cannot be."""
    import jinja2

    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise BadRequest(f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
    if tools:
        kwargs["tools"] = tools
    try:
        return apply_chat_template(tokenizer, conversation, add_generation_prompt, kwargs)
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as e:
        raise BadRequest(f"could not apply the chat template: {e}", "messages") from e


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def sse_error(error: Exception, status: int = 500) -> str:
    message = getattr(error, "message", None) or str(error)
    status = getattr(error, "status", status)
    return f"data: {error_body(message, status).model_dump_json()}\n\n"


async def run_until_disconnected(handler: Awaitable[Response], request: Request) -> Response:
    """Await `handler`; if the client disconnects first, cancel it (its `finally` aborts the
    engine requests, freeing their blocks and state slots) and answer 499."""
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done():
        return Response(status_code=499)
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
