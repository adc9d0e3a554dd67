"""The OpenAI-compatible server: `build_app` (app.py), the engine thread (async_engine.py), the
protocol models, the completion and chat handlers, metrics, and the `serve` / `smoke` commands.

Nothing here is imported at CLI parse time except `cli.py`, which keeps its imports light.
"""
