"""POST /v1/completions: text or token-id prompts, streaming or not, echo and logprobs.

`echo=True, logprobs=k, max_tokens=0` is the loglikelihood request of lm-eval: the engine runs
one step (max_tokens=1) to score the prompt, and only the prompt and its logprobs come back.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deltaserve.outputs import PositionLogprobs, RequestOutput
from deltaserve.server.async_engine import RequestGroup
from deltaserve.server.errors import BadRequest, OpenAIError
from deltaserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    UsageInfo,
)
from deltaserve.server.serving_common import (
    DONE,
    ServingContext,
    check_stop_token_ids,
    random_id,
    run_until_disconnected,
    sampling_params,
    sse,
    sse_error,
)

LOGPROB_FLOOR = -9999.0  # stands in for -inf, which JSON cannot carry


@dataclass
class _Call:
    """One /v1/completions call: its prompts and what to send back."""

    ctx: ServingContext
    req: CompletionRequest
    request_id: str
    model: str
    prompt_texts: list[str | None]  # set wherever echo needs them
    prompt_ids: list[list[int]]
    echo_only: bool  # echo with max_tokens=0: return the prompt, drop the generated token
    created: int
    # per prompt: tokens the prefix cache served (from the outputs)
    num_cached_tokens: dict[int, int] = field(default_factory=dict)

    def choice_index(self, prompt_index: int, seq_index: int) -> int:
        return prompt_index * self.req.n + seq_index

    def usage(self, completion_tokens: int) -> UsageInfo:
        prompt_tokens = sum(len(ids) for ids in self.prompt_ids)
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(self.num_cached_tokens.values())
            ),
        )

    def logprobs(
        self,
        token_ids: list[int],
        positions: list[PositionLogprobs | None],
        offset: int,
    ) -> tuple[CompletionLogprobs, int]:
        """Legacy-format logprobs of `token_ids`; text offsets start at `offset`."""
        k = self.req.logprobs or 0
        out = CompletionLogprobs()
        for tid, pos in zip(token_ids, positions):
            token = self._text(tid, pos)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if pos is None:  # the first prompt token
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(max(pos[tid].logprob, LOGPROB_FLOOR))
            top: dict[str, float] = {}
            for t, lp in sorted(pos.items(), key=lambda item: item[1].rank or 0):
                if t == tid or (lp.rank is not None and lp.rank <= k):
                    top.setdefault(self._text(t, pos), max(lp.logprob, LOGPROB_FLOOR))
            out.top_logprobs.append(top)
        return out, offset

    def _text(self, token_id: int, pos: PositionLogprobs | None) -> str:
        entry = pos.get(token_id) if pos is not None else None
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        return self.ctx.token_text(token_id)

    def prompt_positions(self, output: RequestOutput, prompt_index: int) -> list:
        n = len(self.prompt_ids[prompt_index])
        return list(output.prompt_logprobs or [None] * n)


async def create_completion(
    req: CompletionRequest, ctx: ServingContext, raw_request: Request
) -> Response:
    model = ctx.check_model(req.model)
    if req.multi_modal_data is not None:
        raise BadRequest(
            "/v1/completions takes text only; send images to /v1/chat/completions as image_url "
            "content parts",
            "multi_modal_data",
        )
    if req.suffix:
        raise BadRequest("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise BadRequest("best_of is not supported (other than best_of == n)", "best_of")
    prompts = _prompt_list(req.prompt)
    echo_only = req.echo and req.max_tokens == 0
    max_tokens = 1 if echo_only else req.max_tokens
    texts, ids = await ctx.off_loop(_tokenize_prompts, ctx, prompts, max_tokens, req.echo)
    prompt_logprobs = req.logprobs if req.echo else None
    params = sampling_params(
        req, max_tokens=max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs
    )
    check_stop_token_ids(params.stop_token_ids, ctx.engine.vocab_size)
    call = _Call(ctx, req, random_id("cmpl"), model, texts, ids, echo_only, int(time.time()))
    engine_prompts = [{"prompt": t, "prompt_token_ids": i} for t, i in zip(texts, ids)]
    group = ctx.async_engine.submit(call.request_id, engine_prompts, params)
    if req.stream:
        return StreamingResponse(_stream(call, group), media_type="text/event-stream")
    return await run_until_disconnected(_collect(call, group), raw_request)


def _tokenize_prompts(
    ctx: ServingContext, prompts: list[str | list[int]], max_tokens: int | None, echo: bool
) -> tuple[list[str | None], list[list[int]]]:
    """(texts, token ids) of the prompts, checked (400 otherwise); blocking: runs off the loop."""
    texts, ids = [], []
    for prompt in prompts:
        text, token_ids = ctx.tokenize(prompt)
        ctx.check_length(len(token_ids), max_tokens)
        if text is None and echo:
            text = ctx.tokenizer.decode(token_ids)
        texts.append(text)
        ids.append(token_ids)
    return texts, ids


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequest("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


async def _collect(call: _Call, group: RequestGroup) -> Response:
    finals: list[RequestOutput | None] = [None] * len(call.prompt_ids)
    try:
        async for i, update in group.updates():
            call.num_cached_tokens[i] = update.output.num_cached_tokens
            if update.finished:
                finals[i] = update.output
    finally:
        group.close()
    req = call.req
    choices, completion_tokens = [], 0
    for i, output in enumerate(finals):
        assert output is not None
        for c in output.outputs:
            text, token_ids, positions = c.text, c.token_ids, c.logprobs or []
            if call.echo_only:
                text, token_ids, positions = "", [], []
            completion_tokens += len(token_ids)
            logprobs = None
            if req.logprobs is not None:
                if req.echo:
                    token_ids = call.prompt_ids[i] + token_ids
                    positions = call.prompt_positions(output, i) + positions
                logprobs, _ = call.logprobs(token_ids, positions, 0)
            if req.echo:
                text = call.prompt_texts[i] + text
            choices.append(
                CompletionChoice(
                    index=call.choice_index(i, c.index),
                    text=text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=list(c.token_ids) if req.return_token_ids else None,
                )
            )
    choices.sort(key=lambda ch: ch.index)
    response = CompletionResponse(
        id=call.request_id,
        created=call.created,
        model=call.model,
        choices=choices,
        usage=call.usage(completion_tokens),
    )
    return JSONResponse(response.model_dump())


async def _stream(call: _Call, group: RequestGroup) -> AsyncIterator[str]:
    req = call.req
    offsets: dict[int, int] = {}
    started: set[int] = set()
    completion_tokens = 0
    try:
        async for i, update in group.updates():
            call.num_cached_tokens[i] = update.output.num_cached_tokens
            for d in update.deltas:
                index = call.choice_index(i, d.index)
                text, token_ids, positions = d.text, d.token_ids, d.logprobs or []
                if call.echo_only:
                    text, token_ids, positions = "", [], []
                completion_tokens += len(token_ids)
                if req.echo and index not in started:
                    text = call.prompt_texts[i] + text
                    if req.logprobs is not None:
                        token_ids = call.prompt_ids[i] + token_ids
                        positions = call.prompt_positions(update.output, i) + positions
                started.add(index)
                logprobs = None
                if req.logprobs is not None and token_ids:
                    logprobs, offsets[index] = call.logprobs(
                        token_ids, positions, offsets.get(index, 0)
                    )
                new_ids = list(d.token_ids) if req.return_token_ids else None
                if not text and logprobs is None and d.finish_reason is None and not new_ids:
                    continue
                choice = CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=d.finish_reason,
                    stop_reason=d.stop_reason,
                    token_ids=new_ids,
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
    call: _Call, choices: list[CompletionChoice], usage: UsageInfo | None = None
) -> CompletionResponse:
    return CompletionResponse(
        id=call.request_id, created=call.created, model=call.model, choices=choices, usage=usage
    )
