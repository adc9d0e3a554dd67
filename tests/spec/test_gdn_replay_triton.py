"""The Triton GDN replay kernel (rollback of a verify step) against the torch reference.

On CPU it runs in Triton's interpreter (small sizes); `gpu` tests use Qwen3.5-9B's GDN shapes
and also replay inside a CUDA graph.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deltaserve.ops.gdn.replay import replay_states_ref

# NOTE: not imported from tests/conftest.py: under the whole suite "conftest" may name another
# directory's conftest module. Without a GPU, tests/conftest.py sets TRITON_INTERPRET=1.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


def kernel_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def inputs(R, Q, HV, K, V, num_slots, device, state_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(R, Q, HV, K, generator=gen), dim=-1)
    v = torch.randn(R, Q, HV, V, generator=gen)
    g = -torch.rand(R, Q, HV, generator=gen) * 2
    beta = torch.rand(R, Q, HV, generator=gen)
    pool = torch.randn(num_slots, HV, V, K, generator=gen).to(state_dtype)
    perm = torch.randperm(num_slots - 1, generator=gen)[: 2 * R] + 1
    src, dst = perm[:R].contiguous(), perm[R:].contiguous()
    kept = torch.randint(0, Q + 1, (R,), generator=gen)
    out = [k, v, g, beta, kept, src, dst, pool]
    return [t.to(device) for t in out]


def check(R, Q, HV, K, V, state_dtype, device, tol, graph=False):
    from deltaserve.ops.gdn.triton_replay import gdn_replay

    k, v, g, beta, kept, src, dst, pool = inputs(R, Q, HV, K, V, 2 * R + 3, device, state_dtype)
    want = pool.clone()
    replay_states_ref(k, v, g, beta, kept, src, dst, want)
    got = pool.clone()
    if graph:
        gdn_replay(k, v, g, beta, kept, src, dst, got.clone())  # compile outside the capture
        torch.cuda.synchronize()
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            gdn_replay(k, v, g, beta, kept, src, dst, got)
        got.copy_(pool)
        cuda_graph.replay()
        torch.cuda.synchronize()
    else:
        gdn_replay(k, v, g, beta, kept, src, dst, got)
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < tol, err
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=device)
    untouched[dst] = False
    assert torch.equal(got[untouched], pool[untouched])  # only the dst slots are written


@pytest.mark.parametrize("K,V,HV", [(16, 8, 3), (32, 16, 2)])
def test_triton_replay_matches_reference(K, V, HV):
    check(4, 5, HV, K, V, torch.float32, kernel_device(), 1e-5)


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@gpu
@needs_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R", [1, 16, 64])
def test_gpu_replay_real_sizes(R, state_dtype):
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    check(R, 16, 32, 128, 128, state_dtype, torch.device("cuda"), tol)


@gpu
@needs_cuda
def test_gpu_replay_in_a_cuda_graph():
    check(8, 16, 32, 128, 128, torch.float32, torch.device("cuda"), 1e-5, graph=True)
