"""The server's handle on the engine: `submit` queues the prompts of one API call, `abort`
stops a request, and every EngineBatch the engine loop emits (deltaserve/server/engine_loop.py) is
delivered on the event loop to the RequestGroup of each request.

Two transports: `InThreadEngine` runs the engine loop in a thread of this process (tests, and
`serve --no-engine-process`); `EngineProcessClient` (engine_client.py) runs it in a process of
its own, so that the engine's Python never waits on the HTTP handlers' for the GIL (as vLLM's
engine core does). The event loop never touches the engine's state, apart from the prompt checks
of `engine.tokenize_prompt` / `process_prompt`, which read only the tokenizer and the config.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from deltaserve.logger import get_logger
from deltaserve.server.engine_loop import (
    EngineBatch,
    EngineLoop,
    EngineSnapshot,
    Failure,
    RequestUpdate,
    SeqDelta,
)
from deltaserve.server.errors import (
    BadRequest,
    EngineError,
    EngineShutdownError,
    OpenAIError,
    QueueFullError,
)

if TYPE_CHECKING:
    from deltaserve.engine.llm_engine import LLMEngine
    from deltaserve.engine.prompts import ProcessedPrompt
    from deltaserve.sampling_params import SamplingParams
    from deltaserve.server.metrics import ServerMetrics

__all__ = ["AsyncEngine", "EngineSnapshot", "InThreadEngine", "RequestGroup", "SeqDelta"]

logger = get_logger(__name__)


def failure_error(failure: Failure) -> OpenAIError:
    """The HTTP error of a failed request."""
    if failure.kind == "bad_request":
        return BadRequest(failure.message)
    if failure.kind == "shutdown":
        return EngineShutdownError()
    return EngineError(failure.message)


class AsyncEngine:
    """The event loop's side of an engine loop; subclasses carry commands and batches.

    `engine` answers what the handlers ask of the model (tokenizer, config, vocab_size,
    eos_token_ids, image_processor, tokenize_prompt, process_prompt).
    """

    engine: Any

    def __init__(self, max_waiting: int = 1024, metrics: ServerMetrics | None = None) -> None:
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.snapshot = EngineSnapshot()
        self._groups: dict[str, RequestGroup] = {}
        self._submitted = 0  # sequences submitted
        self._drained = 0  # sequences the engine loop has taken from its queue
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    # ---- transport (subclasses) ------------------------------------------------------------
    def _start(self) -> None:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError

    def _send(self, command: tuple) -> None:
        raise NotImplementedError

    @property
    def is_alive(self) -> bool:
        raise NotImplementedError

    # ---- event-loop side -------------------------------------------------------------------
    def start(self) -> None:
        """Start delivering (call on the event loop, in the app's lifespan)."""
        self._loop = asyncio.get_running_loop()
        self._start()

    async def shutdown(self) -> None:
        """Stop the engine loop; requests still running fail with 503."""
        self._stopping = True
        await self._stop()
        self._fail_groups("shutdown")

    def num_waiting(self) -> int:
        """Sequences not yet running: still queued for the engine loop, or in its scheduler."""
        return self._submitted - self._drained + self.snapshot.waiting

    def submit(
        self, base_id: str, prompts: list[dict | ProcessedPrompt], params: SamplingParams
    ) -> RequestGroup:
        """Queue one request per prompt ({"prompt", "prompt_token_ids"}, validated, or the
        engine's ProcessedPrompt of an image prompt) as `{base_id}-{i}`; raises QueueFullError
        (503) and queues nothing if they do not fit."""
        if self._stopping or not self.is_alive:
            raise EngineShutdownError()
        num_seqs = len(prompts) * params.n
        if self.num_waiting() + num_seqs > self.max_waiting:
            error = QueueFullError(self.max_waiting)
            if self.metrics is not None:
                self.metrics.requests.labels("rejected").inc()
                error.counted = True
            raise error
        ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        lens = [len(p["prompt_token_ids"] if isinstance(p, dict) else p.token_ids) for p in prompts]
        group = RequestGroup(self, ids, lens)
        for rid, prompt in zip(ids, prompts):
            self._submitted += params.n
            self._groups[rid] = group
            self._send(("add", rid, prompt, params))
        return group

    def abort(self, request_id: str) -> None:
        self._groups.pop(request_id, None)
        self._send(("abort", request_id))

    def _deliver(self, batch: EngineBatch) -> None:
        """Runs on the event loop: route one batch's updates to their groups."""
        self.snapshot = batch.snapshot
        self._drained = batch.drained
        for item in batch.items:
            rid = item.request_id
            group = self._groups.get(rid)
            if group is None:  # aborted meanwhile
                continue
            if isinstance(item, Failure) or item.finished:
                del self._groups[rid]
            group.post(item)

    def _deliver_threadsafe(self, batch: EngineBatch) -> None:
        """`_deliver` from another thread."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._deliver, batch)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass

    def _fail_groups(self, kind: str, message: str = "") -> None:
        """Fail every request still waiting for updates (the engine is gone)."""
        for rid, group in list(self._groups.items()):
            group.post(Failure(rid, kind, message))
        self._groups.clear()


class InThreadEngine(AsyncEngine):
    """Runs an LLMEngine's loop in a thread of this process (the engine is not thread-safe: only
    that thread touches it)."""

    def __init__(
        self, engine: LLMEngine, max_waiting: int = 1024, metrics: ServerMetrics | None = None
    ) -> None:
        super().__init__(max_waiting, metrics)
        self.engine = engine
        self._engine_loop = EngineLoop(engine, self._deliver_threadsafe)
        self._thread: threading.Thread | None = None
        self._dead = False

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="deltaserve-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._engine_loop.run()
        finally:
            self._dead = True

    async def _stop(self) -> None:
        self._engine_loop.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            await asyncio.sleep(0)  # the loop's last batch (its failures) is delivered first

    def _send(self, command: tuple) -> None:
        self._engine_loop.put(command)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._dead


class RequestGroup:
    """The engine requests of one API call (one per prompt), their updates on one queue.

    Iterate `updates()` for (prompt index, RequestUpdate); call `close()` when done (in a
    `finally`): it aborts whatever has not finished, e.g. when the client went away.
    """

    def __init__(self, engine: AsyncEngine, request_ids: list[str], prompt_lens: list[int]):
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue()
        self.request_ids = request_ids
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._prompt_lens = prompt_lens
        self._unfinished = set(request_ids)
        self._arrival = time.monotonic()
        self._last_token: dict[str, float] = {}

    def post(self, item: RequestUpdate | Failure) -> None:
        """Called on the event loop."""
        self._queue.put_nowait(item)

    async def updates(self) -> AsyncIterator[tuple[int, RequestUpdate]]:
        metrics = self._engine.metrics
        while self._unfinished:
            item = await self._queue.get()
            rid = item.request_id
            if isinstance(item, Failure):
                self._unfinished.discard(rid)
                error = failure_error(item)
                if metrics is not None:
                    metrics.requests.labels("error").inc()
                    error.counted = True
                raise error
            if metrics is not None:
                self._observe(metrics, item)
            if item.finished:
                self._unfinished.discard(rid)
            yield self._index[rid], item

    def _observe(self, metrics: ServerMetrics, update: RequestUpdate) -> None:
        rid = update.request_id
        num_new = sum(len(d.token_ids) for d in update.deltas)
        if num_new:
            now = time.monotonic()
            last = self._last_token.get(rid)
            if last is None:
                metrics.ttft.observe(now - self._arrival)
                metrics.prompt_tokens.inc(self._prompt_lens[self._index[rid]])
            else:
                metrics.itl.observe(now - last)
            self._last_token[rid] = now
            metrics.generation_tokens.inc(num_new)
        if update.finished:
            reasons = {c.finish_reason for c in update.output.outputs}
            metrics.requests.labels("length" if "length" in reasons else "stop").inc()

    def close(self) -> None:
        for rid in self._unfinished:
            self._engine.abort(rid)
            if self._engine.metrics is not None:
                self._engine.metrics.requests.labels("abort").inc()
        self._unfinished.clear()
