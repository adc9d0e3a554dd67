"""`deltaserve bench throughput` on CPU, as a newcomer types it: the demo model by default, small
rows, floors against this CPU's measured rates, and a one-line error (before any allocation) for
a random preset larger than the free memory."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltaserve.bench import floors, memory
from deltaserve.cli import main
from deltaserve.loader.demo import DEMO_MODEL_NAME, ensure_demo_model

REPO_ROOT = Path(__file__).resolve().parents[2]
# The run may not use more address space than this: a bench that builds a multi-GB model instead
# of the demo model fails fast instead of taking the machine's memory.
ADDRESS_SPACE_LIMIT = 8 << 30
SMALL_ROWS = ["--prefill-lens", "8", "--decode-batches", "2", "--contexts", "8",
              "--decode-steps", "2", "--warmup-steps", "1", "--repeats", "1"]  # fmt: skip


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))


def test_cpu_bench_without_model_runs_the_demo_model(tmp_path: Path) -> None:
    ensure_demo_model()  # built once, outside the timed and memory-bounded run
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "deltaserve.cli", "bench", "throughput", "--device", "cpu",
            *SMALL_ROWS, "--json", str(out)]  # fmt: skip
    run = subprocess.run(
        argv,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        preexec_fn=_limit_memory,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no --model on CPU: using the demo model" in run.stderr
    result = json.loads(out.read_text())
    assert result["model"] == DEMO_MODEL_NAME
    assert [r["kind"] for r in result["rows"]] == ["prefill", "decode"]
    # floors against this CPU's rates, not the H200's reference figures
    assert result["ceilings"]["source"].startswith("measured on this CPU")
    assert result["ceilings"]["copy_bytes_per_s"] != floors.H200_COPY_BYTES_PER_S
    assert "on CPU the floors divide by this CPU's rates" in run.stdout
    assert "GB/s" in run.stdout and "GFLOP/s" in run.stdout


def test_cpu_defaults_are_small_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rows not given are the CPU's small ones (a decode row at B=256, L=8192 would run for
    hours on a CPU); rows given are kept."""
    out = tmp_path / "bench.json"
    argv = ["bench", "throughput", "--device", "cpu", "--model", str(ensure_demo_model()),
            "--decode-steps", "1", "--warmup-steps", "0", "--repeats", "1", "--decode-batches",
            "2", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["length"] for r in rows if r["kind"] == "prefill"] == [64, 256]
    assert {(r["batch"], r["length"]) for r in rows if r["kind"] == "decode"} == {(2, 64), (2, 256)}
    err = capsys.readouterr().err
    assert "small rows by default: --prefill-lens 64,256; --contexts 64,256" in err


def test_oversized_random_preset_fails_in_one_line_before_allocating(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from deltaserve.llm import LLM

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine was built: the memory check did not run first")

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1_000_000_000)
    monkeypatch.setattr(LLM, "__init__", no_engine)
    argv = ["bench", "throughput", "--device", "cpu", "--random-model", "qwen3-0.6b", *SMALL_ROWS]
    assert main(argv) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert lines[-1].startswith("deltaserve bench: error: random model qwen3-0.6b does not fit")
    assert "float32 weights need 2.4 GB" in lines[-1]  # 596 M parameters x 4 bytes
    assert "this machine has 1.0 GB free" in lines[-1]
    assert "Traceback" not in captured.err and captured.out == ""


def test_a_preset_that_fits_passes_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1_000_000_000)
    memory.check_random_model_fits("tiny-qwen3.5", "auto", "cpu")  # a few MB: no error
    need = memory.random_model_bytes("qwen3-0.6b", torch.bfloat16)
    assert 2 * need == memory.random_model_bytes("qwen3-0.6b", torch.float32)
    assert 1.1e9 < need < 1.3e9
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2_000_000_000)
    memory.check_random_model_fits("qwen3-0.6b", "bfloat16", "cpu")


def test_available_host_memory_reads_meminfo(monkeypatch, tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  4000 kB\nMemFree:  1000 kB\nMemAvailable:  3000 kB\n")
    monkeypatch.setattr(memory, "_MEMINFO", meminfo)
    assert memory.available_bytes(torch.device("cpu")) == 3000 * 1024


def test_cpu_ceilings_are_measured_and_plausible() -> None:
    """Any CPU copies at 0.2-2000 GB/s and multiplies float32 at 0.1-100,000 GFLOP/s; a units
    slip (ms vs s, bytes counted once) lands far outside."""
    c = floors.measure_cpu_ceilings(copy_bytes=1 << 24, matmul_size=256, iters=2)
    assert 0.2e9 < c.copy_bytes_per_s < 2e12
    assert 0.1e9 < c.matmul_flop_per_s < 1e14
    assert (c.device_name, c.matmul_dtype) == ("cpu", "float32")
    text = c.describe()
    assert "GB/s" in text and "float32 matmul" in text and "GFLOP/s" in text
    given = floors.resolve_ceilings(False, copy_bw=5e9, cpu_dtype=torch.float32)
    assert given.copy_bytes_per_s == 5e9 and "partly given" in given.source
    assert given.source.startswith("measured on this CPU")


def test_bench_takes_the_model_as_a_positional(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's `bench ... MODEL`: the positional model is benchmarked; with --random-model as
    well, one line says to give one of them."""
    out = tmp_path / "bench.json"
    demo = str(ensure_demo_model())
    argv = ["bench", "throughput", demo, "--device", "cpu", "--prefill-lens", "16",
            "--decode-batches", "1", "--contexts", "16", "--decode-steps", "1", "--warmup-steps",
            "0", "--repeats", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(out.read_text())["model"] == Path(demo).name
    assert main([*argv, "--random-model", "qwen3-0.6b"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("give a model (MODEL / --model) or --random-model, not both")


def test_ceilings_below_a_gpu_read_in_gigabytes_too() -> None:
    """A CPU's copy rate reads in GB/s too wherever it is below 1 TB/s (a cached copy passed
    100 GB/s on a CI-class machine); a GPU's stays in TB/s alone."""
    for rate in (5e9, 1.1e11, 9.9e11):
        text = floors.Ceilings(rate, 2e11, "cpu", matmul_dtype="float32").describe()
        assert f"= {rate / 1e9:.1f} GB/s" in text and "GFLOP/s" in text
    gpu = floors.Ceilings(4.2e12, 7.7e14, "NVIDIA H200").describe()
    assert "copy 4.20 TB/s, bf16 matmul 770 TFLOP/s" in gpu and "GB/s" not in gpu
