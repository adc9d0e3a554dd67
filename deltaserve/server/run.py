"""Run the app with uvicorn on a socket bound before the model loaded (startup.bind_socket)."""

from __future__ import annotations

import logging
import socket
from typing import Any

import uvicorn


class _Server(uvicorn.Server):
    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets:  # uvicorn logs the address only for sockets it binds
            logging.getLogger("uvicorn.error").info(
                "Uvicorn running on %s (Press CTRL+C to quit)", listen_url(sockets[0])
            )


def run_app(app: Any, sock: socket.socket, *, log_level: str) -> bool:
    """Serve `app` on `sock` until Ctrl-C / SIGTERM; False if it failed to start. On shutdown,
    uvicorn stops accepting, lets running requests finish (up to 30 s), then the app's lifespan
    stops the engine thread."""
    server = _Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=30))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled; uvicorn.run drops it too
        pass
    return server.started


def listen_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
