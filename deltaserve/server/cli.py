"""`deltaserve serve` and `deltaserve smoke`: argument parsers and handlers.

Imports at module level stay light (argparse only): torch, fastapi and uvicorn are imported
inside the handlers, so that `deltaserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from deltaserve.server import DEFAULT_MAX_REQUEST_BYTES


def add_serve_parser(commands: Any) -> None:
    from deltaserve.cli import add_engine_args

    parser = commands.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, metrics)",
        description="Serve the model over an OpenAI-compatible HTTP API: /v1/models, "
        "/v1/completions, /v1/chat/completions, /tokenize, /detokenize, /tokenizer_info, "
        "/health, /ping, /version, /metrics. The port is checked before the model loads.",
    )
    add_engine_args(parser)
    parser.add_argument(
        "--random-model",
        default=None,
        metavar="PRESET",
        help="serve random weights of a preset's shapes (deltaserve.loader.random_model, e.g. "
        "qwen3.5-9b) instead of a checkpoint, for serving benchmarks; the tokenizer is "
        "--tokenizer or the demo model's (token-id prompts; ids it lacks decode to nothing: "
        "ask /v1/completions for return_token_ids)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--port", type=int, default=8000, help="TCP port (default 8000; 0: any free port)"
    )
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize and "
        "/tokenizer_info (default: $DELTASERVE_API_KEY; neither: no authentication). An "
        "empty key is an error",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="N",
        help="largest request body accepted; larger ones get HTTP 413 "
        f"(default {DEFAULT_MAX_REQUEST_BYTES} = {DEFAULT_MAX_REQUEST_BYTES >> 20} MiB)",
    )
    _add_media_args(parser)
    parser.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="model name in the API (default: --model as given, or the demo model's name)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        metavar="N",
        help="sequences allowed to wait for a slot; more get 503 (default 1024)",
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine in its own process, so that the HTTP handlers never hold up its "
        "steps (default); --no-engine-process runs it in a thread of the server's process",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level",
    )
    parser.set_defaults(handler=run_serve)


def _add_media_args(parser: argparse.ArgumentParser) -> None:
    from deltaserve.multimodal import media

    group = parser.add_argument_group(
        "images",
        "chat image parts (image_url): data:image/...;base64, URIs, http(s) URLs, and file:// "
        "URLs under --allowed-local-media-path; an image that cannot be used gets HTTP 400",
    )
    group.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="serve file:// image URLs that resolve (after symlinks and ..) into DIR "
        "(default: none; every file:// URL is refused). Anyone who can reach the server can "
        "read the images under DIR",
    )
    group.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="fetch http(s) images only from these hosts, redirects included (vLLM's flag; "
        "default: any host the server can reach)",
    )
    group.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=media.DEFAULT_FETCH_TIMEOUT,
        metavar="S",
        help="seconds an http(s) image fetch may take in all (default "
        f"{media.DEFAULT_FETCH_TIMEOUT:g}, as vLLM's VLLM_IMAGE_FETCH_TIMEOUT)",
    )
    group.add_argument(
        "--max-image-bytes",
        type=int,
        default=media.DEFAULT_MAX_IMAGE_BYTES,
        metavar="N",
        help="largest encoded image (fetched, read or base64-decoded) in bytes (default "
        f"{media.DEFAULT_MAX_IMAGE_BYTES} = {media.DEFAULT_MAX_IMAGE_BYTES >> 20} MiB)",
    )
    group.add_argument(
        "--max-image-pixels",
        type=int,
        default=media.DEFAULT_MAX_IMAGE_PIXELS,
        metavar="N",
        help="largest image in pixels (width * height), checked before decoding "
        f"(default {media.DEFAULT_MAX_IMAGE_PIXELS} = 8192x8192)",
    )


def media_config(args: argparse.Namespace) -> Any:
    """The MediaConfig of the image flags; ValueError naming the flag at fault."""
    from deltaserve.multimodal.media import MediaConfig

    try:
        return MediaConfig(
            allowed_local_media_path=args.allowed_local_media_path,
            fetch_timeout=args.media_fetch_timeout,
            max_image_bytes=args.max_image_bytes,
            max_image_pixels=args.max_image_pixels,
            allowed_media_domains=(
                None if args.allowed_media_domains is None else tuple(args.allowed_media_domains)
            ),
        )
    except ValueError as e:
        raise ValueError(f"{_MEDIA_FLAG_HINT}: {e}") from e


_MEDIA_FLAG_HINT = (
    "bad image flag (--allowed-local-media-path, --allowed-media-domains, "
    "--media-fetch-timeout, --max-image-bytes, --max-image-pixels)"
)


def add_smoke_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "smoke",
        help="regression smoke of a running OpenAI-compatible endpoint",
        description="Stream a few chat requests to ENDPOINT, parse the server-sent events and "
        "check for non-empty answers, time-outs and an optional generation-speed floor. Exits "
        "non-zero on any failure.",
    )
    parser.add_argument("--endpoint", required=True, metavar="URL", help="e.g. http://host:8000")
    parser.add_argument("--api-key", default=None, metavar="KEY")
    parser.add_argument(
        "--model", default=None, help="model name (default: the first of /v1/models)"
    )
    parser.add_argument(
        "--min-gen-tps",
        type=float,
        default=None,
        metavar="X",
        help="fail if a request generates slower than X tokens/s (after its first token)",
    )
    parser.add_argument("--num-requests", type=int, default=3, metavar="N")
    parser.add_argument("--max-tokens", type=int, default=32, metavar="N")
    parser.add_argument(
        "--timeout", type=float, default=60.0, metavar="S", help="seconds per request"
    )
    parser.set_defaults(handler=_run_smoke)


def run_serve(args: argparse.Namespace) -> int:
    from deltaserve.server.startup import bind_socket, resolve_api_key

    # everything a user can get wrong in the flags fails here, before the model loads
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.max_request_bytes <= 0:
        raise ValueError(f"--max-request-bytes must be > 0, got {args.max_request_bytes}")
    api_key = resolve_api_key(args.api_key)
    media = media_config(args)
    sock = bind_socket(args.host, args.port)
    try:
        return _serve(args, sock, api_key, media)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, sock: Any, api_key: str | None, media: Any) -> int:
    from deltaserve.cli import engine_kwargs
    from deltaserve.config import create_engine_config
    from deltaserve.logger import get_logger
    from deltaserve.server.app import build_app
    from deltaserve.server.heap import freeze_startup_heap
    from deltaserve.server.run import run_app
    from deltaserve.server.startup import is_loopback

    if api_key is None and not is_loopback(args.host):
        get_logger(__name__).warning(
            "serving on %s without an API key: anyone who can reach this port can use it "
            "(set --api-key or DELTASERVE_API_KEY)",
            args.host,
        )
    kwargs = engine_kwargs(args)
    if args.random_model is not None:
        if args.model is not None:
            raise ValueError("pass either a model or --random-model, not both")
        if kwargs.get("tokenizer") is None:
            kwargs["tokenizer"] = _resolve_model(None)[0]
        config = create_engine_config(None, random_model=args.random_model, **kwargs)
        default_name = f"random-{args.random_model}"
    else:
        model, default_name = _resolve_model(args.model)
        config = create_engine_config(model, **kwargs)
    if args.engine_process:
        from deltaserve.server.engine_client import EngineProcessClient

        engine = EngineProcessClient(config)
    else:
        from deltaserve.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
    try:
        app = build_app(
            engine,
            model_names=[args.served_model_name or default_name],
            api_key=api_key,
            max_waiting=args.max_waiting,
            max_request_bytes=args.max_request_bytes,
            media=media,
        )
        freeze_startup_heap("server")
        started = run_app(app, sock, log_level=args.log_level)
    finally:
        if args.engine_process:
            engine.close()  # stopped by the app's shutdown already, unless it never started
    return 0 if started else 3  # 3: uvicorn's start-up failure status


def _resolve_model(model: str | None) -> tuple[str, str]:
    """(model directory, default served name)."""
    if model is not None:
        return model, model
    from deltaserve.loader.demo import DEMO_MODEL_NAME, DEMO_NOTICE, ensure_demo_model

    print(DEMO_NOTICE, file=sys.stderr, flush=True)
    return str(ensure_demo_model()), DEMO_MODEL_NAME


def _run_smoke(args: argparse.Namespace) -> int:
    from deltaserve.server.smoke import run_smoke

    return run_smoke(args)
