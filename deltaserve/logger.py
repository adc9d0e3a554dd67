"""The package logger: one handler on the `deltaserve` logger, level from DELTASERVE_LOG_LEVEL."""

from __future__ import annotations

import logging

from deltaserve import env

_configured = False


def get_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        root = logging.getLogger("deltaserve")
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            root.addHandler(handler)
        root.setLevel(env.log_level())
        root.propagate = False
        _configured = True
    return logging.getLogger(name)
