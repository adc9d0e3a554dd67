"""The processes of tensor-parallel ranks 1..N-1 and their step loop.

Rank 0 is the engine's own process: it spawns the others (torch.multiprocessing, spawn), joins
the process group with them, and from then on broadcasts each step's `StepInput`; every worker
builds its own ModelRunner (its shard of the weights, its heads' caches) and runs the forward of
each step it receives, until the stop message (None). Only rank 0 schedules and samples.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from dataclasses import replace

import torch
import torch.multiprocessing as mp

from deltaserve.config import EngineConfig
from deltaserve.distributed.collective_bench import WorkerTask
from deltaserve.distributed.parallel_state import (
    backend_for,
    broadcast_object,
    destroy_tp,
    disable_nvlink_multicast,
    init_tp,
    tp_size,
)
from deltaserve.logger import get_logger

logger = get_logger(__name__)

STOP = None  # the message that ends the workers' loop


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config a rank runs with: on CUDA its own device, cuda:rank."""
    if config.model.device.type != "cuda":
        return config
    return replace(config, model=replace(config.model, device=torch.device("cuda", rank)))


def worker_main(
    rank: int, world: int, backend: str, init_method: str, config: EngineConfig
) -> None:
    """Entry point of a spawned rank: join the group, build the runner, run steps until STOP.

    The process leaves with os._exit: exit code 0 after STOP, 1 after a failure (logged).
    NOTE: it skips the interpreter's teardown on purpose: there is nothing to save, and CUDA /
    NCCL teardown in a child process (watchdog threads, communicators) must not be able to
    keep it alive after the group is gone.
    """
    code = 1
    try:
        code = _serve(rank, world, backend, init_method, config)
    except BaseException:  # os._exit below would swallow the traceback
        logger.exception("tensor-parallel rank %d failed to join or leave the group", rank)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)


def _serve(rank: int, world: int, backend: str, init_method: str, config: EngineConfig) -> int:
    from deltaserve.engine.model_runner import ModelRunner
    from deltaserve.engine.row_buckets import prime_instance
    from deltaserve.engine.warmup import should_warm_up

    config = rank_config(config, rank)
    if config.model.device.type == "cpu":  # share the cores between the ranks
        torch.set_num_threads(max(1, torch.get_num_threads() // world))
    init_tp(rank, world, backend, init_method)
    stopped = False
    try:
        runner = ModelRunner(config)
        if should_warm_up(config):  # rank 0 warms up through its steps; the GEMMs are local
            prime_instance(runner.instance, config)
        while True:
            step = broadcast_object()
            if step is STOP:
                stopped = True
                break
            if isinstance(step, WorkerTask):  # a bench of the collectives (rank 0's result)
                step.run(runner.device)
                continue
            runner.run_worker_step(step)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
    finally:
        # NOTE: rank 0 leaves the group at the same time (TPWorkers.shutdown), so an NCCL
        # communicator's destruction does not wait for a peer that is waiting for us
        destroy_tp(abort=not stopped)
    return 0 if stopped else 1


class TPWorkers:
    """Ranks 1..N-1 as child processes; constructing it also makes this process rank 0.

    `shutdown()` stops them (the STOP message, leave the group, join; terminate whoever does not
    exit) and leaves the group; it is idempotent and safe to call from a finalizer (the engine
    registers one: garbage collection and interpreter exit both stop the workers).
    """

    def __init__(self, config: EngineConfig, join_timeout_s: float = 60.0) -> None:
        world = config.tensor_parallel_size
        backend = backend_for(config.model.device)
        if backend == "nccl":
            disable_nvlink_multicast()  # before any NCCL communicator, inherited by the workers
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self.join_timeout_s = join_timeout_s
        self.processes: list = []
        self._stopped = False
        self.loop_running = False  # set by the engine once every rank's runner is ready
        for rank in range(1, world):
            proc = ctx.Process(
                target=worker_main,
                args=(rank, world, backend, init_method, config),
                name=f"deltaserve-tp{rank}",
                daemon=True,
            )
            proc.start()
            self.processes.append(proc)
        try:
            init_tp(0, world, backend, init_method)
        except BaseException:
            self._reap(timeout_s=0.0)
            raise
        logger.info(
            "tensor parallel: %d ranks, all-reduce over %s, step descriptions over a gloo "
            "control group; worker pids %s",
            world,
            backend,
            [p.pid for p in self.processes],
        )

    def shutdown(self) -> None:
        """Stop the workers and leave the process group, promptly in every case: the STOP
        message when every worker is in its step loop, then rank 0 leaves the group *while*
        the workers leave theirs (an NCCL communicator's destruction waits for every rank),
        then the join. Without STOP (a dead worker; a start-up failure, where the workers fail
        at the same checkpoint) rank 0 aborts the group instead, which waits for nobody, and
        terminates whoever has not exited by the join timeout."""
        if self._stopped:
            return
        self._stopped = True
        sent = False
        if self.loop_running and tp_size() > 1 and all(p.is_alive() for p in self.processes):
            try:
                broadcast_object(STOP)
                sent = True
            except Exception as e:  # a dead peer: terminate below
                logger.warning("could not send the stop message to the TP workers: %s", e)
        try:
            destroy_tp(abort=not sent)
        except Exception as e:  # still reap the workers
            logger.warning("leaving the tensor-parallel group failed: %s", e)
        self._reap(self.join_timeout_s)

    def _reap(self, timeout_s: float) -> None:
        """Join the workers within `timeout_s` in all; terminate (then kill) whoever is left."""
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.processes:
            if proc.is_alive():
                logger.warning("tensor-parallel worker %s did not exit: terminating", proc.name)
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
