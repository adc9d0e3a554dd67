"""The engine's side of serving: one thread owns the LLMEngine, takes commands, steps while there
is work, and hands every change to `emit` as one EngineBatch.

The same loop runs in a thread of the server's process (async_engine.InThreadEngine: `emit`
posts the batch to the event loop) or as the main loop of the engine's own process
(engine_process.py: `emit` pickles the batch into a pipe). Only the transport differs.

Commands are tuples: ("add", request_id, prompt, params) and ("abort", request_id).

NOTE: stream deltas (text with partial stop strings held back, new tokens, new logprobs) are cut
here, because the detokenizer's stream position is engine-thread state.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deltaserve.logger import get_logger
from deltaserve.outputs import PositionLogprobs, RequestOutput

logger = get_logger(__name__)


@dataclass(frozen=True)
class EngineSnapshot:
    """Queue lengths and cache usage, published by the engine loop after every change."""

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
    # cumulative and complete in a request's first update (prompt logprobs) and its last; in
    # between, an engine in another process sends only num_cached_tokens (light outputs)
    output: RequestOutput
    deltas: list[SeqDelta]
    finished: bool


@dataclass
class Failure:
    """A request that failed: kind "bad_request" (400), "engine" (500) or "shutdown" (503)."""

    request_id: str
    kind: str
    message: str = ""


@dataclass
class EngineBatch:
    """What one turn of the loop changed: updates and failures, the snapshot after it, and how
    many sequences the loop has taken from its command queue so far."""

    items: list[RequestUpdate | Failure]
    snapshot: EngineSnapshot
    drained: int


@dataclass
class _Tracked:
    """Bookkeeping of one request."""

    seqs: list[Any]
    sent_tokens: list[int]
    finish_sent: list[bool]


class EngineLoop:
    """Runs `engine` until `stop()`; `put(command)` may be called from any thread."""

    def __init__(
        self, engine: Any, emit: Callable[[EngineBatch], None], *, light_outputs: bool = False
    ) -> None:
        self.engine = engine
        self._emit = emit
        self._light = light_outputs
        self._commands: deque[tuple] = deque()
        self._wake = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._items: list[RequestUpdate | Failure] = []
        self._drained = 0  # sequences taken from the command queue
        self._stop = False

    def put(self, command: tuple) -> None:
        self._commands.append(command)
        self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()

    def run(self) -> None:
        """The loop; requests still running when it stops fail with "shutdown"."""
        self._flush()  # the first snapshot
        try:
            while not self._stop:
                self._wake.clear()
                if self._drain():
                    self._flush()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=1.0)
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # an engine bug: fail what is running, keep serving
                    logger.exception("engine step failed")
                    self._fail_all("engine", f"engine step failed: {type(e).__name__}: {e}")
                    self._flush()
                    continue
                for out in outputs:
                    self._dispatch(out)
                snapshot = self._flush()
                if not outputs and not snapshot.running:
                    self._wake.wait(timeout=0.01)  # nothing schedulable yet: do not spin
        except BaseException:
            logger.exception("engine loop died")
            raise
        finally:
            self._drain()
            self._fail_all("shutdown")
            self._flush()

    def _drain(self) -> bool:
        """Apply queued commands; whether any was applied."""
        applied = False
        while self._commands:
            applied = True
            command = self._commands.popleft()
            if command[0] == "abort":
                self.engine.abort_request(command[1])
                self._tracked.pop(command[1], None)
                continue
            _, rid, prompt, params = command
            self._drained += params.n
            try:
                self.engine.add_request(rid, prompt, params)
            except ValueError as e:
                self._items.append(Failure(rid, "bad_request", str(e)))
                continue
            except Exception as e:
                logger.exception("add_request failed")
                self._items.append(Failure(rid, "engine", f"{type(e).__name__}: {e}"))
                continue
            n = params.n
            self._tracked[rid] = _Tracked(self.engine.requests[rid].seqs, [0] * n, [False] * n)
        return applied

    def _dispatch(self, out: RequestOutput) -> None:
        tracked = self._tracked.get(out.request_id)
        if tracked is None:  # aborted meanwhile
            return
        # a sequence's first delta may read the prompt's logprobs (echo)
        starting = any(
            not sent and not fin for sent, fin in zip(tracked.sent_tokens, tracked.finish_sent)
        )
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
        output = out
        if self._light and not out.finished and not starting:
            # NOTE: the prompt's ids and logprobs and the cumulative outputs are only read from a
            # sequence's first update and the request's last: pickling them every step would
            # cost the engine time in every step
            output = RequestOutput(
                out.request_id, None, [], [], num_cached_tokens=out.num_cached_tokens
            )
        self._items.append(RequestUpdate(out.request_id, output, deltas, out.finished))

    def _fail_all(self, kind: str, message: str = "") -> None:
        for rid in list(self._tracked):
            self.engine.abort_request(rid)
            self._items.append(Failure(rid, kind, message))
        self._tracked.clear()

    def _flush(self) -> EngineSnapshot:
        """Emit what this turn changed; the snapshot it carried."""
        items, self._items = self._items, []
        snapshot = self._snapshot()
        self._emit(EngineBatch(items, snapshot, self._drained))
        return snapshot

    def _snapshot(self) -> EngineSnapshot:
        engine = self.engine
        running, waiting = engine.num_running_and_waiting()
        spec_decoder = getattr(engine, "spec", None)
        spec = spec_decoder.stats.snapshot() if spec_decoder is not None else None
        return EngineSnapshot(
            running,
            waiting,
            **engine.cache_usage(),
            prefix_cache=engine.prefix_cache_stats(),
            spec=spec,
        )
