"""The server's client of an engine in its own process (engine_process.py), as vLLM runs its
engine core: the engine's Python (scheduling, step preparation, output processing) then never
waits for the GIL while the HTTP handlers parse bodies, render chat templates and tokenize.

`EngineProcessClient(config)` spawns the process and waits until the engine is ready (model
loaded, caches planned, CUDA graphs captured); a start-up failure raises with the engine's
traceback. Commands are pickled and sent by a sender thread (a large prompt never blocks the
event loop on a full pipe); a reader thread unpickles each EngineBatch and hands it to the event
loop. If the engine process dies, running requests fail with 500 and /health turns 503.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import queue
import threading
import weakref
from typing import Any

from deltaserve.config import EngineConfig
from deltaserve.engine.prompts import (
    ProcessedPrompt,
    PromptProcessor,
    build_image_processor,
    load_engine_tokenizer,
)
from deltaserve.logger import get_logger
from deltaserve.server.async_engine import AsyncEngine
from deltaserve.server.engine_loop import Failure
from deltaserve.server.engine_process import EngineInfo, engine_process_main

logger = get_logger(__name__)

STOP_TIMEOUT_S = 60.0  # a stopping engine finishes its step and fails what is running


class EngineFront:
    """What the handlers read of an engine in another process: its config, tokenizer, vocabulary,
    EOS ids and prompt checks (the same PromptProcessor the engine itself runs)."""

    def __init__(self, config: EngineConfig, info: EngineInfo, tokenizer: Any = None) -> None:
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_engine_tokenizer(config)
        self.vocab_size = info.vocab_size
        self.eos_token_ids = set(info.eos_token_ids)
        self.image_processor = build_image_processor(config) if info.takes_images else None
        self.prompts = PromptProcessor(
            self.tokenizer,
            info.vocab_size,
            config.model.max_model_len,
            self.image_processor,
            info.no_image_reason,
        )

    def process_prompt(self, prompt: str | dict | ProcessedPrompt) -> ProcessedPrompt:
        return self.prompts.process(prompt)

    def tokenize_prompt(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        text, ids, _ = self.prompts.process(prompt)
        return text, ids


def _kill(process: Any) -> None:
    if process.is_alive():
        process.kill()
        process.join(timeout=10)


class EngineProcessClient(AsyncEngine):
    """An AsyncEngine whose engine loop runs in a spawned process."""

    def __init__(self, config: EngineConfig, max_waiting: int = 1024, metrics: Any = None):
        super().__init__(max_waiting, metrics)
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        commands_in, commands_out = ctx.Pipe(duplex=False)
        events_in, events_out = ctx.Pipe(duplex=False)
        # NOTE: not a daemon: a tensor-parallel engine starts its own worker processes
        self._process = ctx.Process(
            target=engine_process_main,
            args=(config, commands_in, events_out),
            name="deltaserve-engine",
        )
        self._process.start()
        commands_in.close()
        events_out.close()
        self._commands = commands_out
        self._events = events_in
        self._finalizer = weakref.finalize(self, _kill, self._process)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._reader: threading.Thread | None = None
        self._dead = False
        try:
            tokenizer = load_engine_tokenizer(config)  # while the engine loads
            info = self._wait_ready()
            self.engine = EngineFront(config, info, tokenizer)
        except BaseException:
            self.close()
            raise
        self._sender = threading.Thread(target=self._send_loop, name="deltaserve-send", daemon=True)
        self._sender.start()

    def _wait_ready(self) -> EngineInfo:
        while not self._events.poll(0.5):
            if not self._process.is_alive():
                raise RuntimeError(
                    f"the engine process exited during start-up (exit code "
                    f"{self._process.exitcode}); its log is above"
                )
        try:
            kind, payload = pickle.loads(self._events.recv_bytes())
        except EOFError:
            self._process.join(timeout=10)
            raise RuntimeError(
                f"the engine process exited during start-up (exit code "
                f"{self._process.exitcode}); its log is above"
            ) from None
        if kind == "failed":
            raise RuntimeError(f"the engine failed to start:\n{payload}")
        return payload

    # ---- transport -------------------------------------------------------------------------
    def _start(self) -> None:
        self._reader = threading.Thread(target=self._read_loop, name="deltaserve-recv", daemon=True)
        self._reader.start()

    def _send(self, command: tuple) -> None:
        self._outbox.put(command)

    def _send_loop(self) -> None:
        while True:
            command = self._outbox.get()
            if command is None:
                return
            try:
                data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # this request cannot travel: it fails, the others go on
                logger.exception("cannot send %s of %r to the engine", command[0], command[1])
                if command[0] == "add" and self._loop is not None:
                    message = f"cannot send the request to the engine: {type(e).__name__}: {e}"
                    try:
                        self._loop.call_soon_threadsafe(
                            self._unsendable, command[1], command[3].n, message
                        )
                    except RuntimeError:  # the event loop is closed: nobody is listening
                        pass
                continue
            try:
                self._commands.send_bytes(data)
            except OSError:  # the engine process is gone; the reader reports it
                return

    def _unsendable(self, request_id: str, num_seqs: int, message: str) -> None:
        """On the event loop: a request that never reached the engine fails (500)."""
        self._submitted -= num_seqs  # never to be drained
        group = self._groups.pop(request_id, None)
        if group is not None:
            group.post(Failure(request_id, "engine", message))

    def _read_loop(self) -> None:
        while True:
            try:
                kind, batch = pickle.loads(self._events.recv_bytes())
            except (EOFError, OSError):
                break
            except Exception:  # a message that cannot be read: the engine is no longer usable
                logger.exception("unreadable message from the engine process")
                self.close()
                self._stopping = False  # report it below as the failure it is
                break
            if kind == "batch":
                self._deliver_threadsafe(batch)
        self._dead = True
        if not self._stopping:
            self._process.join(timeout=5)
            message = f"the engine process exited (exit code {self._process.exitcode})"
            logger.error("%s; running requests fail, /health answers 503", message)
            loop = self._loop
            if loop is not None:
                try:
                    loop.call_soon_threadsafe(self._fail_groups, "engine", message)
                except RuntimeError:
                    pass

    async def _stop(self) -> None:
        self._send(("stop",))
        self._send(None)
        await asyncio.to_thread(self._process.join, STOP_TIMEOUT_S)
        if self._process.is_alive():
            logger.warning("the engine process did not stop in %.0f s: killed", STOP_TIMEOUT_S)
            self.close()
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, 10)
        await asyncio.sleep(0)  # the engine's last batch (its failures) is delivered first

    def close(self) -> None:
        """Kill the engine process now (idempotent); for exits that skip `shutdown` (a second
        Ctrl-C, a server that failed to start)."""
        self._stopping = True  # an exit we chose: the reader does not report it as a failure
        self._finalizer()

    @property
    def is_alive(self) -> bool:
        return not self._dead and self._process.is_alive()
