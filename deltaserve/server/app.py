"""The FastAPI app: routes, API-key check, OpenAI-style errors, engine start and stop.

`build_app(engine, model_names=[...], api_key=None, max_waiting=1024, max_request_bytes=32 MiB,
media=MediaConfig())` returns an app whose lifespan starts the engine loop (an LLMEngine's in a
thread, or an engine process's client, deltaserve/server/engine_client.py) and stops it at
shutdown. Every error is an OpenAI-style JSON body: 400 for bad input (malformed JSON,
validation errors and unusable images included), 401 for a missing or wrong API key, 404 for
unknown routes, 413 for a body over max_request_bytes, 503 when the waiting queue is full.
Tokenizing and chat templating run in tokenizer threads, so that a long prompt never blocks the
event loop; chat images load in media threads, so that a slow image URL never blocks it either.
"""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.logger import get_logger
from deltaserve.multimodal.media import MediaConfig, MediaLoader
from deltaserve.server.async_engine import AsyncEngine, InThreadEngine
from deltaserve.server.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimitMiddleware
from deltaserve.server.errors import BadRequest, OpenAIError, error_response
from deltaserve.server.metrics import ServerMetrics
from deltaserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from deltaserve.server.serving_chat import create_chat_completion
from deltaserve.server.serving_common import ServingContext, chat_inputs, render_chat
from deltaserve.server.serving_completions import create_completion
from deltaserve.server.serving_info import tokenizer_info, version

logger = get_logger(__name__)

GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def build_app(
    engine: LLMEngine | AsyncEngine,
    *,
    model_names: list[str],
    api_key: str | None = None,
    max_waiting: int = 1024,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    media: MediaConfig | None = None,
) -> FastAPI:
    """The OpenAI-compatible app serving `engine` under `model_names` (the first is reported);
    `api_key` (None: no authentication) guards /v1/*, /tokenize, /detokenize and
    /tokenizer_info; bodies over `max_request_bytes` get 413; `media` says where chat images
    may come from and how large they may be (default: data: and http(s) URLs, no file://)."""
    if not model_names:
        raise ValueError("model_names must name at least one model")
    if isinstance(engine, AsyncEngine):
        async_engine = engine
        async_engine.max_waiting = max_waiting
    else:
        async_engine = InThreadEngine(engine, max_waiting)
    if async_engine.engine.tokenizer is None:
        raise ValueError("the server needs a tokenizer (skip_tokenizer_init is not supported)")
    engine = async_engine.engine
    metrics = ServerMetrics(lambda: async_engine.snapshot)
    async_engine.metrics = metrics
    ctx = ServingContext(async_engine, list(model_names), MediaLoader(media))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        logger.info("serving %s", ", ".join(model_names))
        yield
        await async_engine.shutdown()
        ctx.close()

    app = FastAPI(title="deltaserve", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:  # outermost: a request without the key is refused before its body is read
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    _add_error_handlers(app, metrics)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if async_engine.is_alive else 503)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:  # SageMaker-style probe, as vLLM serves it
        return await health()

    @app.get("/version")
    async def get_version() -> JSONResponse:
        return JSONResponse(version().model_dump())

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> JSONResponse:
        return JSONResponse(tokenizer_info(ctx).model_dump())

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        cards = [
            ModelCard(id=name, root=engine.config.model.path, max_model_len=ctx.max_model_len)
            for name in model_names
        ]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw_request: Request) -> Response:
        return await create_completion(body, ctx, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await create_chat_completion(body, ctx, raw_request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        ctx.check_model(body.model)
        if body.messages is not None:
            # NOTE: images are not loaded: each counts as its template placeholder, unexpanded
            _, ids = await ctx.off_loop(
                render_chat,
                ctx.tokenizer,
                chat_inputs(body.messages).conversation,
                body.add_generation_prompt,
                body.chat_template_kwargs,
                body.tools,
            )
        elif body.prompt is not None:
            ids = await ctx.off_loop(
                ctx.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens
            )
        else:
            raise BadRequest("give either prompt or messages", "prompt")
        response = TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids)
        return JSONResponse(response.model_dump())

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        ctx.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise BadRequest(
                f"token id(s) {bad[:5]} outside the vocabulary [0, {engine.vocab_size})", "tokens"
            )
        text = await ctx.off_loop(ctx.tokenizer.decode, body.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    return app


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def count_error(request: Request, error: Any = None) -> None:
        if request.url.path in GENERATE_PATHS and not getattr(error, "counted", False):
            metrics.requests.labels("error").inc()

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        count_error(request, exc)
        return error_response(exc.message, exc.status, exc.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        count_error(request)
        messages, param = [], None
        for err in exc.errors():
            if err.get("type") == "json_invalid":
                detail = (err.get("ctx") or {}).get("error", "")
                return error_response(f"malformed JSON body: {detail}".rstrip(": "), 400)
            loc = [str(part) for part in err.get("loc", ()) if part != "body"]
            if param is None and loc:
                param = loc[0]
            messages.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
        return error_response("; ".join(messages) or "invalid request", 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        count_error(request)
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(f"internal error: {type(exc).__name__}", 500)


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches (constant-time) on /v1/*, /tokenize,
    /detokenize and /tokenizer_info; /health, /ping, /version and /metrics stay open (probes
    and scrapers)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _is_protected(scope["path"]):
            auth = Headers(scope=scope).get("authorization", "")
            scheme, _, token = auth.partition(" ")
            ok = hmac.compare_digest(token.strip().encode(), self._key)
            if scheme.lower() != "bearer" or not ok:
                response = error_response("Incorrect or missing API key", 401)
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _is_protected(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")
