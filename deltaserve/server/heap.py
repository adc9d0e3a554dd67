"""Keep Python's full garbage collections short while serving.

After start-up a serving process holds hundreds of thousands of objects that live as long as it
does (torch, transformers and FastAPI modules, the model, the tokenizer): about 380 k in the
demo model's engine. A full (generation-2) collection walks them all, 175 ms on a 2-core CPU:
a pause in whatever step or request it lands on, at the same point of a deterministic workload
(a multi-turn chat benchmark's turn 5 was slower in both servers). `gc.freeze()` moves every
object alive at the end of start-up to the permanent generation, which collections skip (as
vLLM's engine core does); what is allocated while serving is collected as before.
"""

from __future__ import annotations

import gc
import time

from deltaserve.logger import get_logger

logger = get_logger(__name__)


def freeze_startup_heap(what: str) -> None:
    """Collect the start-up garbage once, then freeze what survives (call once, when `what`
    (the process's role, for the log) is ready to serve)."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.info(
        "%s: %d start-up objects frozen out of garbage collection (%.0f ms)",
        what,
        gc.get_freeze_count(),
        1e3 * (time.perf_counter() - start),
    )
