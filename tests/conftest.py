"""Session-wide test setup: nothing engine-specific lives here."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (small sizes only), so
# CI checks their logic against the torch references. Triton reads this when a kernel is
# decorated, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

# Tests of Triton kernels: on the GPU, or in the interpreter on CPU.
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def lift_backend_check(monkeypatch: pytest.MonkeyPatch, op: str, backend: str = "triton") -> None:
    """Op family `op` with `backend`'s capability check lifted for the test (Triton's
    interpreter runs its kernels on CPU, which the check would refuse)."""
    import dataclasses

    from deltaserve import backends

    family = backends.OP_FAMILIES[op]
    lifted = tuple(
        dataclasses.replace(b, check=lambda caps: None) if b.name == backend else b
        for b in family.backends
    )
    patched = {**backends.OP_FAMILIES, op: dataclasses.replace(family, backends=lifted)}
    monkeypatch.setattr(backends, "OP_FAMILIES", patched)


def kernel_device() -> torch.device:
    """Where Triton kernel tests put their tensors: CUDA if present, else CPU (interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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
