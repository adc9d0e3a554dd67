"""The fused Triton GDN rollback (ops/gdn/triton_rollback.py) against the torch rollback
(`rollback_layer` in spec/gdn_rollback.py) on random records and states.

On CPU it runs in Triton's interpreter (tiny shapes, float32); `gpu` tests use Qwen3.5-9B's GDN
shapes (bf16 records, float32 state) and the rollback captured in a CUDA graph.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deltaserve.layers.gdn import GatedDeltaNet
from deltaserve.ops.gdn.replay import TorchGDNReplay
from deltaserve.spec.gdn_rollback import rollback_layer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


def kernel_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_layer(hk, hv, k, v, seed=0, w=4, device="cpu") -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(0, 16, hk, hv, k, v, conv_kernel=w, rms_norm_eps=1e-6)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
        layer.A_log.copy_(torch.empty(hv).uniform_(0.1, 4).log())
        layer.dt_bias.copy_(torch.randn(hv) * 3)  # some a + dt_bias past softplus' threshold
    return layer.to(device)


def case(layer, max_rows, Q, num_slots, rec_dtype, device, seed=0):
    """Records, a state pool with NaN-free random states, and rollback rows: record rows
    permuted, kept = 0 .. Q (0: a skipped row), distinct src and dst slots."""
    s = layer.spec
    gen = torch.Generator().manual_seed(seed)
    D = s.conv_dim + 2 * s.num_v_heads
    records = (torch.randn(max_rows * Q, D, generator=gen) * 2).to(rec_dtype)
    records[:, s.conv_dim + s.num_v_heads :] *= 6  # a: reach the softplus threshold
    conv = torch.randn(num_slots, s.conv_dim, s.conv_kernel - 1, generator=gen).to(rec_dtype)
    ssm = torch.randn(num_slots, s.num_v_heads, s.head_v_dim, s.head_k_dim, generator=gen)
    R = max_rows
    record_rows = torch.randperm(max_rows, generator=gen)
    kept = torch.arange(R) % (Q + 1)  # 0 .. Q
    perm = torch.randperm(num_slots - 1, generator=gen)[: 2 * R] + 1
    src, dst = perm[:R].contiguous(), perm[R:].contiguous()
    out = records, conv, ssm, record_rows, kept, src, dst
    return [t.to(device) for t in out]


def torch_rollback(layer, Q, records, conv, ssm, record_rows, kept, src, dst):
    """The reference over the rows with kept > 0."""
    live = kept > 0
    rec = records.view(-1, Q, records.shape[-1])[record_rows[live]]  # [R', Q, D]
    cache = {"conv_state": conv, "ssm_state": ssm}
    rollback_layer(layer, cache, rec, kept[live], src[live], dst[live], TorchGDNReplay())


def fused_rollback(layer, Q, records, conv, ssm, record_rows, kept, src, dst):
    from deltaserve.ops.gdn.triton_rollback import gdn_rollback_fused

    s = layer.spec
    weight = layer.conv1d.weight.view(s.conv_dim, s.conv_kernel)
    gdn_rollback_fused(
        records, weight, layer.A_log, layer.dt_bias, record_rows, kept, src, dst, conv, ssm,
        Q, s.num_k_heads,
    )  # fmt: skip


def check(layer, max_rows, Q, rec_dtype, device, tol, graph=False):
    num_slots = 2 * max_rows + 3
    records, conv, ssm, record_rows, kept, src, dst = case(
        layer, max_rows, Q, num_slots, rec_dtype, device
    )
    want_conv, want_ssm = conv.clone(), ssm.clone()
    torch_rollback(layer, Q, records, want_conv, want_ssm, record_rows, kept, src, dst)
    got_conv, got_ssm = conv.clone(), ssm.clone()
    args = (record_rows, kept, src, dst)
    if graph:
        fused_rollback(layer, Q, records, got_conv.clone(), got_ssm.clone(), *args)  # compile
        torch.cuda.synchronize()
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            fused_rollback(layer, Q, records, got_conv, got_ssm, *args)
        got_conv.copy_(conv)
        got_ssm.copy_(ssm)
        cuda_graph.replay()
        torch.cuda.synchronize()
    else:
        fused_rollback(layer, Q, records, got_conv, got_ssm, *args)
    for name, got, want in (("ssm", got_ssm, want_ssm), ("conv", got_conv, want_conv)):
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < tol, (name, err)
        written = torch.zeros(num_slots, dtype=torch.bool, device=device)
        written[dst[kept > 0]] = True
        assert torch.equal(got[~written], (conv if name == "conv" else ssm)[~written]), name
        for i in range(kept.shape[0]):  # every written slot, one by one
            if kept[i] > 0:
                e = ((got[dst[i]] - want[dst[i]]).double().norm() / want[dst[i]].norm()).item()
                assert e < tol, (name, i, int(kept[i]), e)


@pytest.mark.parametrize(
    "hk,hv,k,v,w", [(2, 6, 8, 4, 4), (1, 2, 16, 8, 4), (2, 2, 4, 8, 3)]
)  # value/key head ratios 3, 2, 1; K != V; conv kernel 4 and 3
def test_fused_rollback_matches_torch(hk, hv, k, v, w):
    layer = make_layer(hk, hv, k, v, w=w, device=kernel_device())
    with torch.no_grad():
        check(layer, 6, 5, torch.float32, kernel_device(), 1e-5)


def test_fused_rollback_skips_rows_with_nothing_kept():
    """kept = 0 rows (padding, all-accepted rows in a graph) write nothing, even with the null
    slot as their dst."""
    from deltaserve.ops.gdn.triton_rollback import gdn_rollback_fused

    dev = kernel_device()
    layer = make_layer(1, 2, 8, 4, device=dev)
    s = layer.spec
    records, conv, ssm, *_ = case(layer, 3, 4, 9, torch.float32, dev)
    conv0, ssm0 = conv.clone(), ssm.clone()
    zeros = torch.zeros(3, dtype=torch.int64, device=dev)
    with torch.no_grad():
        gdn_rollback_fused(
            records, layer.conv1d.weight.view(s.conv_dim, -1), layer.A_log, layer.dt_bias,
            torch.arange(3, device=dev), zeros, torch.tensor([4, 5, 6], device=dev), zeros,
            conv, ssm, 4, s.num_k_heads,
        )  # fmt: skip
    assert torch.equal(conv, conv0) and torch.equal(ssm, ssm0)


@pytest.mark.parametrize("rec_dtype", [torch.float32, torch.bfloat16])
def test_fused_record_equals_the_torch_record(rec_dtype):
    """`GDNVerifyScratch.record` fused (one Triton launch) writes exactly what the torch one
    writes: the states copied to the scratch slots, the draft tokens' [qkv | b | a] records
    (from column views of one projection, as the layer passes them), nothing else."""
    from deltaserve.spec.gdn_rollback import GDNVerifyScratch

    dev = kernel_device()
    gen = torch.Generator().manual_seed(5)
    C, HV, Z, Q = 40, 3, 12, 4
    # the projection in the records' dtype, as in the model (the layer's model dtype)
    proj = torch.randn(11, C + Z + 2 * HV, generator=gen).to(rec_dtype).to(dev)
    qkv, _, b, a = proj.split([C, Z, HV, HV], dim=-1)
    cache = {
        "conv_state": torch.randn(9, C, 3, generator=gen).to(rec_dtype).to(dev),
        "ssm_state": torch.randn(9, HV, 8, 16, generator=gen).to(dev),
    }
    idx = {  # rows: slots 2, 5 -> scratch 7, 8; tokens 0..3 -> record rows 4..7, 9..10 -> 0..1
        "src": [2, 5], "dst": [7, 8], "tok": [0, 1, 2, 3, 9, 10], "rec": [4, 5, 6, 7, 0, 1]
    }  # fmt: skip
    t = {k: torch.tensor(v, device=dev) for k, v in idx.items()}
    results = []
    for fused in (False, True):
        c = {k: v.clone() for k, v in cache.items()}
        records = {0: torch.full((2 * Q, C + 2 * HV), -3.0, dtype=rec_dtype, device=dev)}
        scratch = GDNVerifyScratch(t["src"], t["dst"], t["tok"], t["rec"], records, fused)
        scratch.record(0, qkv, b, a, c)
        results.append((c, records[0]))
    (c0, r0), (c1, r1) = results
    assert torch.equal(r0, r1)
    assert not torch.equal(r0, torch.full_like(r0, -3.0))
    for name in ("conv_state", "ssm_state"):
        assert torch.equal(c0[name], c1[name]), name
        assert torch.equal(c1[name][7], cache[name][2]), name


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@gpu
@needs_cuda
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("R", [1, 16])
def test_gpu_fused_rollback_9b_shapes(R, graph):
    """Qwen3.5-9B's GDN layer (HK 16, HV 32, K = V = 128, conv 4), Q = 16,
    bf16 records (a conv output may round to the other bf16 neighbour: tolerance 2e-3)."""
    layer = make_layer(16, 32, 128, 128, device="cuda")
    with torch.no_grad():
        check(layer, R, 16, torch.bfloat16, torch.device("cuda"), 2e-3, graph=graph)


@gpu
@needs_cuda
def test_gpu_rollback_graph_equals_eager_9b_shapes():
    """GDNRollback over three 9B-shaped layers: the captured rollback (a bucket larger than the
    rows: padding rows skipped) writes exactly what the eager fused launches write, and both
    match the torch rollback."""
    from deltaserve.ops.gdn.triton_replay import TritonGDNReplay
    from deltaserve.spec.gdn_rollback import GDNRollback, RollbackRow

    Q, rows_max, num_slots = 16, 8, 20
    scratch = range(num_slots - rows_max, num_slots)
    layers, caches = [], []
    for i in range(3):
        layer = make_layer(16, 32, 128, 128, seed=i, device="cuda")
        layer.layer_idx = i
        _, conv, ssm, *_ = case(layer, rows_max, Q, num_slots, torch.bfloat16, "cuda", i)
        layers.append(layer)
        caches.append({"conv_state": conv, "ssm_state": ssm})

    def build(replay, graphs):
        cs = [{k: v.clone() for k, v in c.items()} for c in caches]
        rb = GDNRollback(layers, cs, scratch, Q, torch.bfloat16, torch.device("cuda"), replay)
        gen = torch.Generator().manual_seed(7)
        for layer in layers:
            rec = rb.records[layer.layer_idx]
            rec.copy_(torch.randn(rec.shape, generator=gen).to(rec.dtype))
        if graphs:
            rb.capture_graphs([1, 2, 4, 8])
            assert rb.graphs, "no rollback graph captured"
        return rb, cs

    rows = [RollbackRow(0, 3, 1), RollbackRow(2, 1, 2), RollbackRow(5, 15, 3)]  # bucket 4
    results = []
    for replay, graphs in ((TorchGDNReplay(), False), (TritonGDNReplay(), False),
                           (TritonGDNReplay(), True)):  # fmt: skip
        rb, cs = build(replay, graphs)
        with torch.no_grad():
            rb.rollback(rows)
        torch.cuda.synchronize()
        results.append(cs)
    want, eager, graphed = results
    for i in range(3):
        for name in ("conv_state", "ssm_state"):
            assert torch.equal(graphed[i][name], eager[i][name]), (i, name)
            err = ((eager[i][name].double() - want[i][name].double()).norm()
                   / want[i][name].double().norm()).item()  # fmt: skip
            assert err < 2e-3, (i, name, err)


@gpu
@needs_cuda
@pytest.mark.parametrize("rec_dtype", [torch.float32, torch.bfloat16])
def test_gpu_fused_record_equals_the_torch_record(rec_dtype):
    """The same check compiled for the GPU (a bf16 model's conv state and records beside the
    float32 SSM state: Triton's typing of the kernel's branches is checked only there)."""
    test_fused_record_equals_the_torch_record(rec_dtype)
