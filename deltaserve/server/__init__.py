"""The OpenAI-compatible server: `build_app` (app.py), the engine thread (async_engine.py), the
protocol models, the completion and chat handlers, metrics, and the `serve` / `smoke` commands.

Nothing here is imported at CLI parse time except `cli.py`, which keeps its imports light.
"""

# The largest request body `serve` accepts by default (--max-request-bytes; 413 past it): 32 MiB,
# about 8M tokens of text, far past any context. Here so that the CLI reads it without fastapi.
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024
