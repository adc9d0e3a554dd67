"""Tensor-parallel shutdown on CPU (gloo): prompt and clean in every way an engine ends.

Each case bounds the time from "the engine is told to stop" (or its process exits) to "every
worker process is gone" by SHUTDOWN_BOUND_S: a behaviour bound (a hang would take the 60 s join
timeout), not a speed figure. After a normal stop a worker exits with code 0. `shutdown()` and
garbage collection are bounded in test_tensor_parallel.py's parity tests.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hf_models import build_model

from deltaserve import LLM, SamplingParams
from deltaserve.distributed.parallel_state import tp_size
from deltaserve.distributed.worker import TPWorkers
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.engine.model_runner import ModelRunner

SHUTDOWN_BOUND_S = 10.0
LLM_KWARGS = dict(
    dtype="float32",
    device="cpu",
    max_model_len=128,
    max_num_seqs=4,
    block_size=16,
    skip_tokenizer_init=True,
    seed=0,
    tensor_parallel_size=2,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path, _ = build_model("qwen3_g3_tied_sharded", tmp_path_factory.mktemp("tp-stop"), False)
    return path


def _generate_one(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params)
    assert len(out.outputs[0].token_ids) == 2


def _gone(pid: int) -> bool:
    """Whether process `pid` has exited (no such process, or a zombie nobody reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(procs: list, bound_s: float) -> float:
    start = time.monotonic()
    for p in procs:
        p.join(max(0.0, bound_s - (time.monotonic() - start)))
    return time.monotonic() - start


def test_process_exit_stops_the_workers(model_dir, tmp_path) -> None:
    """A program that never shuts its engine down: the finalizer runs at interpreter exit."""
    script = tmp_path / "leave.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import time
            from deltaserve import LLM, SamplingParams
            if __name__ == "__main__":  # the workers are spawned: they import this file
                llm = LLM({str(model_dir)!r}, **{LLM_KWARGS!r})
                params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
                llm.generate([{{"prompt_token_ids": [5, 6, 7]}}], params)
                pids = [p.pid for p in llm.llm_engine._tp_workers.processes]
                print("PIDS", *pids, flush=True)
                print("END", time.monotonic(), flush=True)
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=90
    )
    exited = time.monotonic()
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    pids = [int(p) for p in lines["PIDS"].split()]
    assert exited - float(lines["END"]) < SHUTDOWN_BOUND_S
    deadline = time.monotonic() + SHUTDOWN_BOUND_S
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), pids
    assert "did not exit" not in proc.stderr, proc.stderr[-3000:]


def test_dead_worker_does_not_hang_shutdown(model_dir) -> None:
    llm = LLM(str(model_dir), **LLM_KWARGS)
    procs = list(llm.llm_engine._tp_workers.processes)
    _generate_one(llm)
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].join(SHUTDOWN_BOUND_S)
    start = time.monotonic()
    llm.shutdown()
    elapsed = time.monotonic() - start
    assert elapsed < SHUTDOWN_BOUND_S, f"shutdown took {elapsed:.1f} s"
    assert procs[0].exitcode == -signal.SIGKILL
    assert tp_size() == 1
    del llm
    gc.collect()


@pytest.mark.parametrize("where", ["runner", "engine"])
def test_rank0_start_up_failure_stops_the_workers(model_dir, monkeypatch, where: str) -> None:
    """Rank 0 alone fails at start-up (the workers are fresh spawned processes: the patch does
    not reach them): in the runner's last set-up stage, after the caches, where the workers
    learn it at the last checkpoint and fail too; or in the engine after the runner, where
    every worker is in its step loop and gets the stop message (exit code 0)."""

    def fail(*args, **kwargs):
        raise RuntimeError("injected rank-0 failure")

    if where == "runner":
        monkeypatch.setattr(ModelRunner, "_finish_setup", fail)
    else:
        monkeypatch.setattr(LLMEngine, "_init_scheduling", fail)
    seen: list = []
    stop = TPWorkers.shutdown

    def recording_stop(self) -> None:
        seen.extend(self.processes)
        stop(self)

    monkeypatch.setattr(TPWorkers, "shutdown", recording_stop)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="injected rank-0 failure"):
        LLM(str(model_dir), **LLM_KWARGS)
    gc.collect()
    elapsed = time.monotonic() - start + _wait_gone(seen, SHUTDOWN_BOUND_S)
    assert len(seen) == 1 and not seen[0].is_alive()
    assert seen[0].exitcode == (1 if where == "runner" else 0)
    assert tp_size() == 1
    # start-up included: a hang would be the 60 s join timeout
    assert elapsed < 3 * SHUTDOWN_BOUND_S, f"failed start-up took {elapsed:.1f} s"


def test_a_blocking_nccl_abort_does_not_hang_destroy_tp(monkeypatch) -> None:
    """ncclCommAbort blocked rank 0's shutdown on two H100s: destroy_tp waits for the abort at
    most its timeout, says so, and leaves the rank with tp_size() == 1."""
    import threading

    import torch.distributed as dist

    from deltaserve.distributed import parallel_state as ps

    release = threading.Event()
    calls = []

    def blocking_abort(abort: bool) -> None:
        calls.append(abort)
        release.wait(30)  # a stuck communicator

    warnings = []
    monkeypatch.setattr(ps, "_abort_nccl", blocking_abort)
    monkeypatch.setattr(ps.logger, "warning", lambda msg, *a: warnings.append(msg % a))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setitem(ps._STATE, "size", 2)
    monkeypatch.setitem(ps._STATE, "rank", 0)
    monkeypatch.setitem(ps._STATE, "backend", "nccl")
    start = time.monotonic()
    ps.destroy_tp(timeout_s=0.5)
    took = time.monotonic() - start
    release.set()
    assert calls == [False]
    assert 0.5 <= took < 5.0
    assert tp_size() == 1
    assert len(warnings) == 1 and "did not return in 0 s" in warnings[0]


def test_destroy_tp_reraises_an_abort_error(monkeypatch) -> None:
    import torch.distributed as dist

    from deltaserve.distributed import parallel_state as ps

    def failing_abort(abort: bool) -> None:
        raise RuntimeError("communicator gone")

    monkeypatch.setattr(ps, "_abort_nccl", failing_abort)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setitem(ps._STATE, "size", 2)
    monkeypatch.setitem(ps._STATE, "backend", "nccl")
    with pytest.raises(RuntimeError, match="communicator gone"):
        ps.destroy_tp(abort=True)
    assert tp_size() == 1


def test_nccl_graphs_are_released_before_the_abort(monkeypatch) -> None:
    """NCCL's abort waits until every graph that captured a collective is destroyed: graphs made
    under an NCCL group are reset first, then the communicators aborted; graphs made outside
    TP are not tracked."""
    import torch
    import torch.distributed as dist

    from deltaserve.distributed import parallel_state as ps

    events: list[str] = []

    class FakeGraph:
        def __init__(self) -> None:
            self.name = f"graph{len(events)}"
            events.append("made")

        def reset(self) -> None:
            events.append(f"reset {self.name}")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))
    monkeypatch.setattr(
        dist.distributed_c10d, "_abort_process_group", lambda *a: events.append("abort")
    )
    untracked = ps.new_cuda_graph()  # no TP: not remembered
    monkeypatch.setitem(ps._STATE, "size", 2)
    monkeypatch.setitem(ps._STATE, "backend", "nccl")
    kept = [ps.new_cuda_graph(), ps.new_cuda_graph()]
    ps._abort_nccl(abort=False)
    assert events[:4] == ["made", "made", "made", "sync"] and events[6:] == ["abort"]
    assert sorted(events[4:6]) == ["reset graph1", "reset graph2"]  # a set: any order
    assert ps.release_cuda_graphs() == 0  # released once
    assert untracked.name == "graph0" and len(kept) == 2


def test_engine_graphs_are_made_by_new_cuda_graph() -> None:
    """Every CUDA graph the engine captures comes from new_cuda_graph, so leaving an NCCL
    group can release it first; only the single-GPU kernel benches (never under TP) and the
    autotuner's timing (ops/graph_bench.py: one kernel and a memset a graph, no collective,
    destroyed before it returns; remembering them would keep their memory) make their own."""
    import re

    root = Path(__file__).resolve().parents[2] / "deltaserve"
    direct = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if re.search(r"torch\.cuda\.CUDAGraph\(\)", p.read_text())
    )
    assert direct == [
        "distributed/parallel_state.py",
        "ops/gdn/triton_bench.py",
        "ops/graph_bench.py",
    ]
