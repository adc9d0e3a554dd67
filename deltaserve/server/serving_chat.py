"""POST /v1/chat/completions: messages through the checkpoint's chat template, streaming or not.

Messages may carry image parts (`image_url` with a data:, http(s) or allowed file:// URL): each
renders as the template's placeholder, the images load in media threads (400 naming the part
and the problem if one cannot be used) and go to the engine as `multi_modal_data`, which expands
the placeholders (a model without a vision tower, or too many images: the engine's 400).

Streaming follows OpenAI: per choice, a first chunk with `{"role": "assistant", "content": ""}`,
then `{"content": ...}` deltas, the last one carrying finish_reason; with include_usage a usage
chunk with empty choices; then `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deltaserve.outputs import PositionLogprobs, RequestOutput
from deltaserve.server.async_engine import RequestGroup
from deltaserve.server.errors import BadRequest, OpenAIError
from deltaserve.server.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
    PromptTokensDetails,
    UsageInfo,
)
from deltaserve.server.serving_common import (
    DONE,
    ServingContext,
    chat_inputs,
    check_stop_token_ids,
    random_id,
    render_chat,
    run_until_disconnected,
    sampling_params,
    sse,
    sse_error,
)
from deltaserve.server.serving_completions import LOGPROB_FLOOR


@dataclass
class _Call:
    ctx: ServingContext
    req: ChatCompletionRequest
    request_id: str
    model: str
    num_prompt_tokens: int
    created: int
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (from the outputs)

    def usage(self, completion_tokens: int) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=self.num_prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached_tokens),
        )

    def logprobs(
        self, token_ids: list[int], positions: list[PositionLogprobs] | None
    ) -> ChatChoiceLogprobs | None:
        if not self.req.logprobs or positions is None:
            return None
        k = self.req.top_logprobs or 0
        content = []
        for tid, pos in zip(token_ids, positions):
            top = sorted(
                ((t, lp) for t, lp in pos.items() if lp.rank is not None and lp.rank <= k),
                key=lambda item: item[1].rank,
            )
            entry = self._entry(tid, pos)
            content.append(
                ChatTokenLogprob(**entry, top_logprobs=[self._entry(t, pos) for t, _ in top])
            )
        return ChatChoiceLogprobs(content=content)

    def _entry(self, token_id: int, pos: PositionLogprobs) -> dict:
        lp = pos[token_id]
        token = lp.decoded_token
        if token is None:
            token = self.ctx.token_text(token_id)
        return ChatTopLogprob(
            token=token,
            logprob=max(lp.logprob, LOGPROB_FLOOR),
            bytes=list(token.encode("utf-8", errors="replace")),
        ).model_dump()


def _render_prompt(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    conversation: list[dict[str, Any]],
    max_tokens: int | None,
    has_images: bool,
) -> tuple[str, list[int]]:
    """The chat template applied to the request's conversation: (text, token ids), checked (400
    otherwise; a prompt with images is checked once its placeholders are expanded, by
    ServingContext.process_prompt); blocking: runs off the event loop."""
    text, ids = render_chat(
        ctx.tokenizer,
        conversation,
        req.add_generation_prompt,
        req.chat_template_kwargs,
        req.tools,
    )
    if not has_images:
        _, ids = ctx.tokenize(ids)  # vocabulary and max_model_len checks
        ctx.check_length(len(ids), max_tokens)
    return text, ids


async def create_chat_completion(
    req: ChatCompletionRequest, ctx: ServingContext, raw_request: Request
) -> Response:
    model = ctx.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise BadRequest("top_logprobs requires logprobs=true", "top_logprobs")
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise BadRequest("only response_format type 'text' is supported", "response_format")
    max_tokens = req.max_tokens
    if req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    inputs = chat_inputs(req.messages)  # malformed parts: 400 before any work
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
    check_stop_token_ids(params.stop_token_ids, ctx.engine.vocab_size)
    if inputs.images:
        ctx.check_takes_images()  # before fetching anything
    text, ids = await ctx.off_loop(
        _render_prompt, ctx, req, inputs.conversation, max_tokens, bool(inputs.images)
    )
    prompt: Any = {"prompt": text, "prompt_token_ids": ids}
    if inputs.images:
        prompt["multi_modal_data"] = {"image": await ctx.load_images(inputs.images)}
        prompt = await ctx.process_prompt(prompt)
        ids = prompt.token_ids  # placeholders expanded: the prompt tokens the model sees
        ctx.check_length(len(ids), max_tokens)
    call = _Call(ctx, req, random_id("chatcmpl"), model, len(ids), int(time.time()))
    group = ctx.async_engine.submit(call.request_id, [prompt], params)
    if req.stream:
        return StreamingResponse(_stream(call, group), media_type="text/event-stream")
    return await run_until_disconnected(_collect(call, group), raw_request)


async def _collect(call: _Call, group: RequestGroup) -> Response:
    final: RequestOutput | None = None
    try:
        async for _, update in group.updates():
            call.num_cached_tokens = update.output.num_cached_tokens
            if update.finished:
                final = update.output
    finally:
        group.close()
    assert final is not None
    choices = [
        ChatChoice(
            index=c.index,
            message=ChatMessage(content=c.text),
            logprobs=call.logprobs(c.token_ids, c.logprobs),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in final.outputs
    ]
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    response = ChatCompletionResponse(
        id=call.request_id,
        created=call.created,
        model=call.model,
        choices=choices,
        usage=call.usage(completion_tokens),
    )
    return JSONResponse(response.model_dump())


async def _stream(call: _Call, group: RequestGroup) -> AsyncIterator[str]:
    req = call.req
    started: set[int] = set()
    completion_tokens = 0
    try:
        async for _, update in group.updates():
            call.num_cached_tokens = update.output.num_cached_tokens
            for d in update.deltas:
                if d.index not in started:
                    started.add(d.index)
                    first = ChatStreamChoice(
                        index=d.index, delta=DeltaMessage(role="assistant", content="")
                    )
                    yield sse(_chunk(call, [first]))
                completion_tokens += len(d.token_ids)
                logprobs = call.logprobs(d.token_ids, d.logprobs) if d.token_ids else None
                if not d.text and logprobs is None and d.finish_reason is None:
                    continue
                choice = ChatStreamChoice(
                    index=d.index,
                    delta=DeltaMessage(content=d.text) if d.text else DeltaMessage(),
                    logprobs=logprobs,
                    finish_reason=d.finish_reason,
                    stop_reason=d.stop_reason,
                )
                yield sse(_chunk(call, [choice]))
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse(_chunk(call, [], call.usage(completion_tokens)))
        yield DONE
    except OpenAIError as e:
        yield sse_error(e)
        yield DONE
    finally:
        group.close()


def _chunk(
    call: _Call, choices: list[ChatStreamChoice], usage: UsageInfo | None = None
) -> ChatCompletionChunk:
    return ChatCompletionChunk(
        id=call.request_id, created=call.created, model=call.model, choices=choices, usage=usage
    )
