"""Session-wide test setup: nothing engine-specific lives here."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# sets the TRITON_INTERPRET default before any kernel module loads (see kernel_helpers.py)
import kernel_helpers  # noqa: F401
import pytest


@pytest.fixture(scope="session", autouse=True)
def warm_up_only_when_asked() -> Iterator[None]:
    """Engines built in tests skip the start-up warm-up (deltaserve/engine/warmup.py) unless they
    pass warmup=True: on by default with CUDA, it would compile every prefill kernel variant for
    each tiny model shape of the GPU suite (minutes over the suite). It leaves an engine as
    fresh, so nothing else changes; tests/engine/test_warmup.py turns it on, on CPU and GPU."""
    import deltaserve.engine.llm_engine as llm_engine

    original = llm_engine.warm_up

    def only_when_asked(engine) -> None:
        if engine.config.warmup:
            original(engine)

    patch = pytest.MonkeyPatch()
    patch.setattr(llm_engine, "warm_up", only_when_asked)
    yield
    patch.undo()


@pytest.fixture(scope="session", autouse=True)
def share_the_gpu_between_workers() -> Iterator[None]:
    """Under pytest-xdist (scripts/gpu_tests.sh runs the parts marked `*` in several workers on
    one GPU) an engine on a CUDA device whose test sets no kv_cache_memory_bytes gets 4 GiB of
    cache: the default budget, a share of the whole device less what other processes hold,
    would leave the other workers' engines nothing."""
    import torch

    if not os.environ.get("PYTEST_XDIST_WORKER") or not torch.cuda.is_available():
        yield
        return
    import dataclasses

    from deltaserve.cache import planner

    original = planner._cuda_cache_budget

    def fixed_share(config) -> int:
        if config.kv_cache_memory_bytes is None:
            config = dataclasses.replace(config, kv_cache_memory_bytes=4 * 2**30)
        return original(config)

    patch = pytest.MonkeyPatch()
    patch.setattr(planner, "_cuda_cache_budget", fixed_share)
    yield
    patch.undo()


@pytest.fixture(scope="session", autouse=True)
def deltaserve_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point DELTASERVE_CACHE_DIR at a fresh temporary directory for the whole session, so tests
    never read or write the user's cache (the demo model is built there once, on first use)."""
    path = tmp_path_factory.mktemp("deltaserve-cache")
    previous = os.environ.get("DELTASERVE_CACHE_DIR")
    os.environ["DELTASERVE_CACHE_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("DELTASERVE_CACHE_DIR", None)
    else:
        os.environ["DELTASERVE_CACHE_DIR"] = previous


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With DELTASERVE_TEST_REPORT_FAILURES=1 (scripts/gpu_tests.sh sets it), a failing test's
    report is printed as soon as the test ends, not in the summary at the session's end, so a
    part killed at its time limit still shows why an earlier test failed."""
    if os.environ.get("DELTASERVE_TEST_REPORT_FAILURES") != "1" or not report.failed:
        return
    import sys

    print(f"\n=== FAILED {report.nodeid} ({report.when})", file=sys.stderr)
    print(report.longreprtext, file=sys.stderr, flush=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`pytest -m gpu` on a machine without CUDA skips the GPU tests (saying why) rather than
    failing each in its first CUDA call."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="a GPU test: needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
