"""DELTASERVE_BLAS_LIBRARY: the library PyTorch's CUDA matmuls go through, set when the model
loads on a CUDA device (cuBLASLt unless told otherwise; never on CPU; `default` leaves
PyTorch's choice), and a bad value refused by name."""

from __future__ import annotations

import pytest
import torch

from deltaserve import env
from deltaserve.engine import model_instance


def test_blas_library_is_set_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", calls.append)
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("DELTASERVE_BLAS_LIBRARY", raising=False)
    assert model_instance.set_blas_library(torch.device("cpu")) is None and calls == []
    assert model_instance.set_blas_library(cuda) == "cublaslt" and calls == ["cublaslt"]
    monkeypatch.setenv("DELTASERVE_BLAS_LIBRARY", "default")
    assert model_instance.set_blas_library(cuda) is None and calls == ["cublaslt"]
    monkeypatch.setenv("DELTASERVE_BLAS_LIBRARY", "cublas")
    assert model_instance.set_blas_library(cuda) == "cublas" and calls == ["cublaslt", "cublas"]
    monkeypatch.setenv("DELTASERVE_BLAS_LIBRARY", "hipblas")
    with pytest.raises(ValueError, match="DELTASERVE_BLAS_LIBRARY must be"):
        env.blas_library()
