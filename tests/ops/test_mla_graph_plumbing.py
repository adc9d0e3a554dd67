"""The decode-graph path drives the MLA backend like the attention backend: `init_cuda_graph`,
`plan_graph` before every (emulated) capture and replay, `plan` before eager forwards, and its
`graph_query_lens` in the runner's choice of verify graphs.

A stub model with one latent-attention "layer" (its queries and latents are fixed random maps
of the token ids) runs through `ModelInstance.capture_graphs` / `replay` with
DELTASERVE_EMULATE_CUDA_GRAPHS=1; the Triton MLA backend (interpreter) must give the torch
reference's output for the real rows, with padding rows in the bucket.
"""

from __future__ import annotations

import types

import pytest
import torch
from kernel_helpers import requires_triton

from deltaserve.engine.model_instance import ModelInstance
from deltaserve.forward_context import Kernels
from deltaserve.ops.mla.reference import TorchMLABackend

H, R, P, PAGE, VOCAB = 3, 20, 6, 4, 11


class StubMLAModel(torch.nn.Module):
    """Token id -> q_lat, q_pe, c_kv, k_pe (fixed random tables), one MLA call, flattened."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.tables = [torch.randn(VOCAB, n, generator=g) for n in (H * R, H * P, R, P)]

    def forward(self, input_ids, positions, ctx):
        q_lat, q_pe, c_kv, k_pe = (t[input_ids] for t in self.tables)
        out = ctx.kernels.mla.forward(
            q_lat.view(-1, H, R), q_pe.view(-1, H, P), c_kv, k_pe,
            ctx.caches[0]["latent_cache"], ctx.meta, 0.3,
        )  # fmt: skip
        return out.flatten(1)  # [T, H * R]

    def compute_logits(self, hidden):
        return hidden


class Recorder:
    """Wraps a backend and records its hook calls."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []
        self.name = inner.name
        self.graph_query_lens = inner.graph_query_lens

    def init_cuda_graph(self, max_batch_size, max_blocks, device):
        self.calls.append(("init", max_batch_size, max_blocks))

    def plan_graph(self, meta, bs):
        self.calls.append(("plan_graph", bs))

    def plan(self, meta):
        self.calls.append(("plan", meta.num_seqs))

    def forward(self, *args):
        return self.inner.forward(*args)


def make_instance(mla, num_blocks: int) -> ModelInstance:
    inst = object.__new__(ModelInstance)
    inst.config = types.SimpleNamespace(
        model=types.SimpleNamespace(max_model_len=32), cache=types.SimpleNamespace(block_size=PAGE)
    )
    inst.device = torch.device("cpu")
    inst.model = StubMLAModel()
    inst.kernels = Kernels(mla=mla)
    inst.caches = [{"latent_cache": torch.randn(num_blocks, PAGE, R + P)}]
    inst.tap_layers, inst.graph_taps, inst.graph_spec_verify = (), None, None
    inst.num_eager_forwards = 0
    inst.row_buckets = False
    inst.piecewise = None
    return inst


def decode_step(seq_lens: list[int], width: int, first_block: int):
    """An all-decode step: sequence b owns blocks first_block + b * width ..; one new token."""
    from meta_helpers import make_meta

    tables = [[first_block + b * width + i for i in range(width)] for b in range(len(seq_lens))]
    slots = [tables[b][(n - 1) // PAGE] * PAGE + (n - 1) % PAGE for b, n in enumerate(seq_lens)]
    meta = make_meta(
        [1] * len(seq_lens), [n - 1 for n in seq_lens], len(seq_lens),
        block_tables=tables, slot_mapping=slots,
    )  # fmt: skip
    ids = torch.tensor([(3 * n) % VOCAB for n in seq_lens])
    return ids, torch.tensor([n - 1 for n in seq_lens]), meta


@requires_triton
def test_emulated_graphs_plan_and_run_the_mla_backend(monkeypatch):
    from deltaserve.ops.mla.triton_backend import TritonMLABackend

    monkeypatch.setenv("DELTASERVE_EMULATE_CUDA_GRAPHS", "1")
    width = 32 // PAGE  # max_model_len / block_size
    rec = Recorder(TritonMLABackend())
    inst = make_instance(rec, 1 + 4 * width)
    ref = make_instance(TorchMLABackend(), 1 + 4 * width)
    ref.caches = [{"latent_cache": inst.caches[0]["latent_cache"].clone()}]
    inst.capture_graphs(4)
    assert rec.calls[0] == ("init", 4, width)
    rec.calls.clear()
    for seq_lens in ([5, 13, 9], [6, 14, 10], [1]):
        ids, pos, meta = decode_step(seq_lens, width, first_block=1)
        logits = inst.replay(ids, pos, meta)
        want = ref.forward_logits(ids, pos, meta)
        assert logits.shape == want.shape
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    # one plan_graph per replay, with the bucket size (3 rows replay bucket 4, 1 row bucket 1)
    assert rec.calls == [("plan_graph", 4), ("plan_graph", 4), ("plan_graph", 1)]
    # the real rows' latents landed as the reference wrote them (block 0 takes padding rows)
    torch.testing.assert_close(
        inst.caches[0]["latent_cache"][1:], ref.caches[0]["latent_cache"][1:]
    )
    rec.calls.clear()
    inst.forward(ids, pos, meta)  # an eager forward plans first
    assert rec.calls == [("plan", 1)]


@pytest.mark.parametrize("mla_lens,want", [((1,), (1,)), (tuple(range(1, 17)), (1, 4))])
def test_verify_graphs_need_the_mla_backend_to_capture_q(monkeypatch, mla_lens, want):
    """The runner captures verify graphs (q = 4) only when the MLA backend can run q = 4 rows
    in a graph (and the attention backend, when the model has one)."""
    from deltaserve.engine.model_runner import ModelRunner

    monkeypatch.delenv("DELTASERVE_EMULATE_CUDA_GRAPHS", raising=False)
    mla = types.SimpleNamespace(name="stub", graph_query_lens=mla_lens)
    runner = object.__new__(ModelRunner)
    runner.config = types.SimpleNamespace(speculative=types.SimpleNamespace(query_len=4))
    runner.instance = make_instance(mla, 2)
    runner.gdn_rollback = None
    assert runner._graph_query_lens() == want
