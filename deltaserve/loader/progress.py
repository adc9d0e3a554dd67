"""Progress bars of start-up work (weight loading), on stderr, only where someone watches."""

from __future__ import annotations

import logging
import sys
from typing import Any

from deltaserve import env


def progress_enabled() -> bool:
    """Bars show when stderr is a terminal, DELTASERVE_LOG_LEVEL is below WARNING and this is
    tensor-parallel rank 0; tests, CI and piped output stay quiet."""
    from deltaserve.distributed.parallel_state import tp_rank

    level = logging.getLevelName(env.log_level())
    if isinstance(level, int) and level >= logging.WARNING:
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty()) and tp_rank() == 0


def progress_bar(total: int, desc: str, unit: str) -> Any:
    """A tqdm bar on stderr, disabled unless `progress_enabled()`."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        disable=not progress_enabled(),
        dynamic_ncols=True,
        leave=False,
    )
