"""The engine's own process: builds the LLMEngine, reports what the server's front needs
(EngineInfo), then runs the engine loop (engine_loop.py), taking pickled commands from one pipe
and sending pickled EngineBatches down another.

Messages up: ("ready", EngineInfo) | ("failed", traceback text) once, then ("batch", EngineBatch).
Commands down: the engine loop's tuples, or ("stop",). The process stops on ("stop",) or when
the server's end of the command pipe closes (the server died): it never outlives the server.
"""

from __future__ import annotations

import pickle
import signal
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from deltaserve.config import EngineConfig
from deltaserve.logger import get_logger
from deltaserve.server.heap import freeze_startup_heap

logger = get_logger(__name__)


@dataclass(frozen=True)
class EngineInfo:
    """What the server's front of the engine needs to check prompts without the model."""

    vocab_size: int
    eos_token_ids: frozenset[int]
    takes_images: bool  # the vision tower is loaded (the front builds its own image processor)
    no_image_reason: str | None


def _send(conn: Connection, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def engine_process_main(config: EngineConfig, commands: Connection, events: Connection) -> None:
    """The target of the engine process (spawned: nothing of the server's state is inherited)."""
    # Ctrl-C reaches the whole process group: the server stops this process itself, after its
    # running requests are answered
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from deltaserve.engine.llm_engine import LLMEngine
    from deltaserve.server.engine_loop import EngineLoop

    try:
        engine = LLMEngine(config)
    except BaseException:
        _send(events, ("failed", traceback.format_exc()))
        return
    try:
        info = EngineInfo(
            engine.vocab_size,
            frozenset(engine.eos_token_ids),
            engine.image_processor is not None,
            engine.runner.instance.no_image_reason,
        )
        freeze_startup_heap("engine process")
        _send(events, ("ready", info))

        def emit(batch) -> None:
            try:
                _send(events, ("batch", batch))
            except OSError:  # the server is gone
                loop.stop()

        loop = EngineLoop(engine, emit, light_outputs=True)

        def read_commands() -> None:
            while True:
                try:
                    command = pickle.loads(commands.recv_bytes())
                except (EOFError, OSError):
                    break
                if command[0] == "stop":
                    break
                loop.put(command)
            loop.stop()

        threading.Thread(target=read_commands, name="deltaserve-commands", daemon=True).start()
        loop.run()
    finally:
        engine.shutdown()
