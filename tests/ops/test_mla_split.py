"""The `split` MLA backend (deltaserve.ops.mla.split_backend): which half serves each step,
the lifecycle hooks each half receives, and the composition with the Triton decode (CPU
interpreter) equal to the torch reference."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import requires_triton
from meta_helpers import rel_err
from mla_cases import make_mla_case

from deltaserve.ops.mla.reference import TorchMLABackend
from deltaserve.ops.mla.split_backend import SplitMLABackend, all_decode

CASES = [  # (context_len, q_len) per sequence, num_decodes, decode query length
    ([(11, 1), (30, 1)], 2, 1),  # all decodes
    ([(4, 3), (17, 3)], 2, 3),  # all verify rows
    ([(4, 1), (9, 6), (0, 3)], 1, 1),  # mixed
    ([(4, 3), (21, 3), (2, 5), (0, 1)], 2, 3),  # verify rows and prefills
    ([(0, 7), (30, 2)], 0, 1),  # prefills only
]


class Recording(TorchMLABackend):
    """The torch reference, noting every hook it receives."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls
        self.supports_cuda_graph = name == "decode"
        self.graph_query_lens = (1, 2, 3) if name == "decode" else (1,)

    def setup(self, specs, block_size, dtype):
        self.calls.append((self.name, "setup"))

    def init_cuda_graph(self, max_batch_size, max_blocks_per_seq, device):
        self.calls.append((self.name, "init_cuda_graph"))

    def plan_graph(self, meta, batch_size):
        self.calls.append((self.name, "plan_graph"))

    def plan(self, meta):
        self.calls.append((self.name, "plan"))

    def forward(self, *args):
        self.calls.append((self.name, "forward"))
        return super().forward(*args)


@pytest.mark.parametrize("seqs,num_decodes,qlen", CASES)
def test_all_decode_steps_go_to_the_decode_half_every_other_to_the_prefill_half(
    seqs, num_decodes, qlen
):
    calls: list = []
    split = SplitMLABackend(Recording("prefill", calls), Recording("decode", calls))
    case = make_mla_case(seqs, num_decodes, 3, 20, 6, 8, torch.float32, decode_query_len=qlen)
    half = "decode" if num_decodes == len(seqs) else "prefill"
    assert all_decode(case.meta) == (half == "decode")
    want_cache = case.cache.clone()
    args = (case.q_lat, case.q_pe, case.c_kv, case.k_pe)
    want = TorchMLABackend().forward(*args, want_cache, case.meta, 0.4)
    split.plan(case.meta)
    out = split.forward(*args, case.cache, case.meta, 0.4)
    assert calls == [(half, "plan"), (half, "forward")]
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(case.cache, want_cache, rtol=0, atol=0, equal_nan=True)


def test_graphs_are_the_decode_halfs_and_setup_reaches_both():
    calls: list = []
    split = SplitMLABackend(Recording("prefill", calls), Recording("decode", calls))
    assert split.supports_cuda_graph is True and split.graph_query_lens == (1, 2, 3)
    split.setup([], 16, torch.bfloat16)
    split.init_cuda_graph(8, 4, torch.device("cpu"))
    case = make_mla_case([(5, 1), (9, 1)], 2, 3, 20, 6, 8, torch.float32)
    split.plan_graph(case.meta, 4)
    assert calls == [
        ("prefill", "setup"),
        ("decode", "setup"),
        ("decode", "init_cuda_graph"),
        ("decode", "plan_graph"),
    ]


@requires_triton
@pytest.mark.parametrize("seqs,num_decodes,qlen", CASES)
def test_triton_decode_half_with_a_reference_prefill_half_equals_the_reference(
    seqs, num_decodes, qlen
):
    """The Triton MLA as the decode half (interpreter on CPU) and the torch reference in
    FlashInfer's place: every kind of step equals the reference, writes included."""
    from deltaserve.ops.mla.triton_backend import TritonMLABackend

    split = SplitMLABackend(TorchMLABackend(), TritonMLABackend())
    case = make_mla_case(seqs, num_decodes, 3, 20, 6, 8, torch.float32, decode_query_len=qlen)
    want_cache = case.cache.clone()
    args = (case.q_lat, case.q_pe, case.c_kv, case.k_pe)
    want = TorchMLABackend().forward(*args, want_cache, case.meta, 0.4)
    out = split.forward(*args, case.cache, case.meta, 0.4)
    torch.testing.assert_close(case.cache, want_cache, rtol=0, atol=0, equal_nan=True)
    assert rel_err(out, want) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("decodes_only", [True, False])
def test_gpu_split_matches_reference(decodes_only):
    """FlashInfer's MLA and the Triton decode as the halves, DeepSeek-V2-Lite's widths (16
    heads, R 512, P 64, bf16): an all-decode step and a mixed one against the reference."""
    pytest.importorskip("flashinfer")
    if decodes_only:
        seqs, nd = [(n - 1, 1) for n in (1, 17, 4096, 2051, 700)], 5
    else:
        seqs, nd = [(1000, 1), (37, 1), (0, 515), (2047, 300)], 2
    case = make_mla_case(seqs, nd, 16, 512, 64, 16, torch.bfloat16, seed=7)
    meta = case.meta
    split = SplitMLABackend()
    assert type(split.half(meta)).__name__ == (
        "TritonMLABackend" if decodes_only else "FlashInferMLABackend"
    )
    scale = (128 + 64) ** -0.5
    want_cache = case.cache.clone()
    args = (case.q_lat, case.q_pe, case.c_kv, case.k_pe)
    want = TorchMLABackend().forward(*args, want_cache, meta, scale)
    out = split.forward(*args, case.cache, meta, scale)
    torch.testing.assert_close(case.cache, want_cache, rtol=0, atol=0, equal_nan=True)
    for b in range(len(seqs)):
        rows = slice(meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1])
        assert rel_err(out[rows], want[rows]) < 1.5e-2, f"sequence {b}"


@requires_triton
def test_mixed_step_decode_rows_go_to_the_decode_half():
    """Beside expanded prefill rows (the layer's choice from `expanded_min_query`, 6144 here),
    a mixed step's decode rows go to the decode half's `decode_rows`: equal to the reference's
    decode rows, and `decodes_alone` is the decode half's."""
    from deltaserve.ops.mla.triton_backend import TritonMLABackend

    split = SplitMLABackend(TorchMLABackend(), TritonMLABackend())
    assert split.expanded_min_query == 6144 and split.decodes_alone is True
    no_rows = TorchMLABackend()
    no_rows.decodes_alone = False
    assert SplitMLABackend(TorchMLABackend(), no_rows).decodes_alone is False
    case = make_mla_case([(9, 1), (30, 1), (0, 5)], 2, 3, 20, 6, 8, torch.float32)
    args = (case.q_lat, case.q_pe, case.c_kv, case.k_pe)
    want = TorchMLABackend().forward(*args, case.cache, case.meta, 0.4)  # writes the latents
    out = split.decode_rows(case.q_lat, case.q_pe, case.cache, case.meta, 0.4)
    assert out.shape[0] == 2
    assert rel_err(out, want[:2]) < 1e-5
