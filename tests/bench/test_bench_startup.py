"""`deltaserve bench startup`: each run is a fresh process that reports, from inside, the
seconds since it started, its import's and engine's seconds and the engine's start-up phases;
the table and the JSON carry them; bad `--env` pairs and failing runs fail with a clear
message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltaserve.bench import startup
from deltaserve.cli import main


def test_bench_startup_reports_fresh_processes(tmp_path: Path, capsys) -> None:
    out = tmp_path / "startup.json"
    args = ["bench", "startup", "--device", "cpu", "--max-model-len", "256", "--repeats", "1"]
    assert main([*args, "--env", "DELTASERVE_STARTUP_BENCH_TEST=1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["env"] == ["DELTASERVE_STARTUP_BENCH_TEST=1"]
    (run,) = report["runs"]
    phases = run["phases"]
    assert list(phases)[:3] == ["before the engine", "tokenizer", "model"]
    assert 0 < run["import_s"] < run["wall_s"] and run["engine_s"] > 0
    # the process's own clock (10 ms ticks) covers its import, engine and phases
    assert run["ready_s"] >= run["import_s"] + run["engine_s"] - 0.05
    assert run["ready_s"] >= sum(phases.values()) - 0.05
    table = capsys.readouterr().out
    assert "| run | ready (s) | wall (s) | import (s) | engine (s) | before the engine |" in table


def test_bad_env_pairs_and_failed_runs_say_what_went_wrong() -> None:
    with pytest.raises(ValueError, match="--env takes K=V, got 'NOEQUALS'"):
        startup.child_env(["NOEQUALS"])
    assert startup.child_env(["PYTHONDONTWRITEBYTECODE="])["PYTHONDONTWRITEBYTECODE"] == ""
    env = startup.child_env([])
    with pytest.raises(RuntimeError, match="start-up run failed.*nonexistent/checkpoint"):
        startup.run_once({"model": "/nonexistent/checkpoint", "device": "cpu"}, env, 120)


def test_max_model_len_defaults_within_the_checkpoint(tmp_path: Path) -> None:
    """Without --max-model-len the runs take 8192 tokens, or a checkpoint's
    max_position_embeddings where it is smaller (the demo model's 4096: `bench startup --device
    cpu` once asked it for 8192 and failed); a given length is passed as it is."""
    from deltaserve.cli import build_parser

    def kwargs(*argv: str) -> dict:
        return startup.llm_kwargs(build_parser().parse_args(["bench", "startup", *argv]))

    demo = kwargs("--device", "cpu")
    assert demo["max_model_len"] == startup.checkpoint_max_positions(demo["model"]) == 4096
    assert kwargs("--random-model", "qwen3.5-9b")["max_model_len"] == 8192
    assert kwargs("--max-model-len", "300")["max_model_len"] == 300
    nested = tmp_path / "vl"
    nested.mkdir()
    (nested / "config.json").write_text(
        json.dumps({"text_config": {"max_position_embeddings": 64}})
    )
    assert kwargs("--model", str(nested))["max_model_len"] == 64
    assert startup.checkpoint_max_positions(str(tmp_path / "missing")) is None
