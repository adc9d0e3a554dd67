"""The engine loop in a background thread, beside the asyncio event loop.

The LLMEngine is not thread-safe, so one thread owns it: it takes commands (add, abort) from a
deque, runs `step()` while there is work, and posts each request's progress to that request's
asyncio queue with `loop.call_soon_threadsafe`. Requests that arrive together are batched by the
engine's scheduler like any others. The event loop never touches the engine's state, apart from
`tokenize_prompt`, which reads only the tokenizer and the config.

NOTE: stream deltas (text with partial stop strings held back, new tokens, new logprobs) are cut
in the engine thread, because the detokenizer's stream position is engine-thread state.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deltaserve.logger import get_logger
from deltaserve.server.errors import (
    BadRequest,
    EngineError,
    EngineShutdownError,
    OpenAIError,
    QueueFullError,
)

if TYPE_CHECKING:
    from deltaserve.engine.llm_engine import LLMEngine, ProcessedPrompt
    from deltaserve.outputs import PositionLogprobs, RequestOutput
    from deltaserve.sampling_params import SamplingParams
    from deltaserve.server.metrics import ServerMetrics

logger = get_logger(__name__)


@dataclass(frozen=True)
class EngineSnapshot:
    """Queue lengths and cache usage, published by the engine thread after every change."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    state_slots_used: int = 0
    state_slots_total: int = 0
    # cumulative prefix-cache counters and snapshot pool usage (LLMEngine.prefix_cache_stats)
    prefix_cache: dict[str, int] = field(default_factory=dict)
    spec: Any = None  # speculative decoding's SpecSnapshot (deltaserve/spec/stats.py), or None


@dataclass
class SeqDelta:
    """What one of a request's `n` sequences added since its last delta."""

    index: int
    text: str  # new text, holding back a suffix that may start a stop string
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None  # one entry per new token
    finish_reason: str | None = None  # set in the sequence's last delta only
    stop_reason: int | str | None = None


@dataclass
class RequestUpdate:
    request_id: str
    output: RequestOutput  # cumulative; safe to read once `finished`
    deltas: list[SeqDelta]
    finished: bool


@dataclass
class _Failure:
    request_id: str
    error: OpenAIError


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request."""

    post: Callable[[Any], None]
    seqs: list[Any]
    sent_tokens: list[int] = field(default_factory=list)
    finish_sent: list[bool] = field(default_factory=list)


class AsyncEngine:
    """Runs an LLMEngine in its own thread; `submit` queues the prompts of one API call."""

    def __init__(
        self, engine: LLMEngine, max_waiting: int, metrics: ServerMetrics | None = None
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.snapshot = EngineSnapshot()
        self._commands: deque[tuple] = deque()
        self._wake = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._submitted = 0  # sequences submitted (event loop)
        self._drained = 0  # sequences taken from the command deque (engine thread)
        self._stop = False
        self._dead = False
        self._thread: threading.Thread | None = None

    # ---- event-loop side -------------------------------------------------------------------
    def start(self) -> None:
        self._publish_snapshot()
        self._thread = threading.Thread(target=self._run, name="deltaserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread; requests still running fail with 503."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._dead

    def num_waiting(self) -> int:
        """Sequences not yet running: still in the command deque, or in the scheduler's queue."""
        return self._submitted - self._drained + self.snapshot.waiting

    def submit(
        self, base_id: str, prompts: list[dict | ProcessedPrompt], params: SamplingParams
    ) -> RequestGroup:
        """Queue one request per prompt ({"prompt", "prompt_token_ids"}, validated, or the
        engine's ProcessedPrompt of an image prompt) as `{base_id}-{i}`; raises QueueFullError
        (503) and queues nothing if they do not fit."""
        if self._stop or not self.is_alive:
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
            self._commands.append(("add", rid, prompt, params, group.post))
        self._wake.set()
        return group

    def abort(self, request_id: str) -> None:
        self._commands.append(("abort", request_id))
        self._wake.set()

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self._wake.clear()
                self._drain()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=1.0)
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # an engine bug: fail what is running, keep serving
                    logger.exception("engine step failed")
                    self._fail_all(EngineError(f"engine step failed: {type(e).__name__}: {e}"))
                    continue
                for out in outputs:
                    self._dispatch(out)
                self._publish_snapshot()
                if not outputs and not self.snapshot.running:
                    self._wake.wait(timeout=0.01)  # nothing schedulable yet: do not spin
        except BaseException:
            logger.exception("engine thread died")
            raise
        finally:
            self._dead = True
            self._drain()
            self._fail_all(EngineShutdownError())

    def _drain(self) -> None:
        drained = 0
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "abort":
                self.engine.abort_request(command[1])
                self._tracked.pop(command[1], None)
                continue
            _, rid, prompt, params, post = command
            drained += params.n
            try:
                self.engine.add_request(rid, prompt, params)
            except ValueError as e:
                post(_Failure(rid, BadRequest(str(e))))
                continue
            except Exception as e:
                logger.exception("add_request failed")
                post(_Failure(rid, EngineError(f"{type(e).__name__}: {e}")))
                continue
            n = params.n
            self._tracked[rid] = _Tracked(
                post, self.engine.requests[rid].seqs, [0] * n, [False] * n
            )
        self._publish_snapshot()  # NOTE: before counting them drained, so none goes unseen
        self._drained += drained

    def _dispatch(self, out: RequestOutput) -> None:
        tracked = self._tracked.get(out.request_id)
        if tracked is None:  # aborted meanwhile
            return
        deltas = []
        for seq, completion in zip(tracked.seqs, out.outputs):
            i = seq.index
            sent = tracked.sent_tokens[i]
            new_ids = completion.token_ids[sent:]
            text = ""
            if seq.detokenizer is not None:
                text = seq.detokenizer.get_stream_delta(seq.is_finished, seq.params.stop)
            finish = completion.finish_reason if not tracked.finish_sent[i] else None
            if not new_ids and not text and finish is None:
                continue
            logprobs = None
            if completion.logprobs is not None:
                logprobs = completion.logprobs[sent : len(completion.token_ids)]
            stop_reason = completion.stop_reason if finish is not None else None
            deltas.append(SeqDelta(i, text, new_ids, logprobs, finish, stop_reason))
            tracked.sent_tokens[i] = len(completion.token_ids)
            tracked.finish_sent[i] = finish is not None or tracked.finish_sent[i]
        if out.finished:
            del self._tracked[out.request_id]
        tracked.post(RequestUpdate(out.request_id, out, deltas, out.finished))

    def _fail_all(self, error: OpenAIError) -> None:
        for rid, tracked in list(self._tracked.items()):
            self.engine.abort_request(rid)
            tracked.post(_Failure(rid, error))
        self._tracked.clear()
        self._publish_snapshot()

    def _publish_snapshot(self) -> None:
        running, waiting = self.engine.num_running_and_waiting()
        usage = self.engine.cache_usage()
        prefix = self.engine.prefix_cache_stats()
        spec_decoder = getattr(self.engine, "spec", None)
        spec = spec_decoder.stats.snapshot() if spec_decoder is not None else None
        self.snapshot = EngineSnapshot(running, waiting, **usage, prefix_cache=prefix, spec=spec)


class RequestGroup:
    """The engine requests of one API call (one per prompt), their updates on one queue.

    Iterate `updates()` for (prompt index, RequestUpdate); call `close()` when done (in a
    `finally`): it aborts whatever has not finished, e.g. when the client went away.
    """

    def __init__(self, engine: AsyncEngine, request_ids: list[str], prompt_lens: list[int]):
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.request_ids = request_ids
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._prompt_lens = prompt_lens
        self._unfinished = set(request_ids)
        self._arrival = time.monotonic()
        self._last_token: dict[str, float] = {}

    def post(self, item: RequestUpdate | _Failure) -> None:
        """Called from the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass

    async def updates(self) -> AsyncIterator[tuple[int, RequestUpdate]]:
        metrics = self._engine.metrics
        while self._unfinished:
            item = await self._queue.get()
            rid = item.request_id
            if isinstance(item, _Failure):
                self._unfinished.discard(rid)
                if metrics is not None:
                    metrics.requests.labels("error").inc()
                    item.error.counted = True
                raise item.error
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
