"""The engine's ready line says where start-up went: the runner's phases (model, caches, and
with CUDA graphs their captures) and, on Linux, the seconds since the process started."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

_TESTS_DIR = Path(__file__).resolve().parents[1]
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))

from hf_models import SPECS_BY_NAME, build_model  # noqa: E402
from test_row_buckets import make_llm  # noqa: E402

from deltaserve.engine.stats import process_uptime  # noqa: E402


def test_ready_line_names_the_start_up_phases(tmp_path, monkeypatch, caplog) -> None:
    model_dir, _ = build_model(SPECS_BY_NAME["qwen3_g4_kv2"], tmp_path / "m", load_oracle=False)
    monkeypatch.setenv("DELTASERVE_EMULATE_CUDA_GRAPHS", "1")
    logger = logging.getLogger("deltaserve")  # it does not propagate: hand caplog's handler
    with caplog.at_level(logging.INFO, logger="deltaserve"):
        logger.addHandler(caplog.handler)
        try:
            llm = make_llm(model_dir)
        finally:
            logger.removeHandler(caplog.handler)
    phases = llm.llm_engine.runner.startup_s
    assert list(phases) == ["model", "caches", "decode graphs", "piecewise graphs"]
    assert all(v >= 0 for v in phases.values())
    before = llm.llm_engine.startup_before_s
    ready = [r.getMessage() for r in caplog.records if "engine ready" in r.getMessage()]
    assert len(ready) == 1 and "model " in ready[0] and "piecewise graphs " in ready[0]
    assert "tokenizer " in ready[0] and before["tokenizer"] >= 0
    up = process_uptime()
    if sys.platform.startswith("linux"):
        # /proc's clocks tick every 10 ms: the two uptimes may each be a tick off
        assert up is not None and up >= sum(phases.values()) + sum(before.values()) - 0.05
        assert "process up " in ready[0]
        # the process's imports and config, before the engine began
        assert list(before) == ["before the engine", "tokenizer"]
        assert "start-up: before the engine " in ready[0]


def test_warm_up_line_says_when_the_engine_was_ready(tmp_path, caplog) -> None:
    """With the warm-up on (CUDA's default; forced here on CPU), its closing line gives the
    seconds from the process's start to a ready engine."""
    model_dir, _ = build_model(SPECS_BY_NAME["qwen3_g4_kv2"], tmp_path / "m", load_oracle=False)
    logger = logging.getLogger("deltaserve")
    with caplog.at_level(logging.INFO, logger="deltaserve"):
        logger.addHandler(caplog.handler)
        try:
            make_llm(model_dir, warmup=True)
        finally:
            logger.removeHandler(caplog.handler)
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up: ")]
    assert len(done) == 1
    if sys.platform.startswith("linux"):
        assert "s after the process started" in done[0]
