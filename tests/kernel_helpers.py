"""Helpers of the kernel tests, importable from any test file (`from kernel_helpers import
kernel_device`): a module of its own, since `conftest` names two modules here (this directory's
and tests/server's) and an import of it resolves to whichever was loaded first."""

from __future__ import annotations

import os

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
