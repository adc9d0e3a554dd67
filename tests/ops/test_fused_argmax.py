"""The sampler's row argmax (ops/fused/argmax.py) against torch.argmax: the first maximum of
every row, across chunk boundaries, with ties inside a chunk and across chunks, rows of -inf
(every token banned), strided rows and 16-bit logits (CPU: Triton's interpreter; GPU:
`pytest -m gpu` at the models' vocabulary sizes). The sampler's greedy and sampled rows take
the argmax it is given."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import kernel_device, requires_triton

from deltaserve.ops.fused.argmax import CHUNK


def _check(x: torch.Tensor) -> None:
    from deltaserve.ops.fused.argmax import row_argmax

    got = row_argmax(x)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    assert torch.equal(got.cpu(), x.float().argmax(dim=-1).cpu())


@requires_triton
@pytest.mark.parametrize("vocab", [1, 37, CHUNK, CHUNK + 1, 2 * CHUNK + 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_matches_torch(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(3, vocab, generator=gen).to(dtype).to(kernel_device())
    _check(x)


@requires_triton
def test_row_argmax_ties_go_to_the_first_index():
    """The max repeated inside one chunk, in two chunks (the earlier chunk's copy wins), and a
    row of -inf (torch: index 0)."""
    vocab = 2 * CHUNK + 100
    x = torch.full((4, vocab), -3.0)
    x[0, [17, 900, 901]] = 5.0  # inside chunk 0
    x[1, [CHUNK + 5, 2 * CHUNK + 7]] = 5.0  # chunks 1 and 2
    x[2, [2 * CHUNK + 99, CHUNK - 1]] = 5.0  # the last logit and chunk 0's last
    x[3] = float("-inf")
    x = x.to(torch.float16).to(kernel_device())
    _check(x)
    from deltaserve.ops.fused.argmax import row_argmax

    assert row_argmax(x).tolist() == [17, CHUNK + 5, CHUNK - 1, 0]


@requires_triton
def test_row_argmax_of_strided_rows_and_bad_input():
    from deltaserve.ops.fused.argmax import row_argmax

    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(5, CHUNK + 64, generator=gen).to(kernel_device())
    _check(wide[1:4, 10 : CHUNK + 20])  # row stride CHUNK + 64, a column window
    assert row_argmax(wide[:0]).shape == (0,)
    with pytest.raises(ValueError, match="unit last stride"):
        row_argmax(wide.t())


def test_sampler_uses_the_given_argmax():
    """Greedy batches, mixed batches and sampled rows all go through `argmax`; the fused ops
    of either backend provide one."""
    from deltaserve.engine.sampler import Sampler, SamplingBatch
    from deltaserve.ops.fused import TorchFusedOps
    from deltaserve.sampling_params import SamplingParams

    seen = []

    def spy(x: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return x.argmax(dim=-1)

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)

    def batch(params):
        n = len(params)
        return SamplingBatch(params, [None] * n, [[1]] * n, [[]] * n, [[]] * n)

    sampler = Sampler(argmax=spy)
    ids = sampler.sample_ids(logits, batch([greedy] * 3))
    assert seen == [(3, 50)] and torch.equal(ids, logits.argmax(dim=-1))
    seen.clear()
    sampler.sample_ids(logits, batch([greedy, sampled, greedy]))
    assert seen == [(2, 50), (1, 50)]
    assert TorchFusedOps().argmax(logits).tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("vocab", [102400, 151936, 248320])
def test_row_argmax_gpu_vocab_sizes(rows, vocab):
    gen = torch.Generator(device="cuda").manual_seed(rows + vocab)
    _check(torch.randn(rows, vocab, device="cuda", generator=gen))
    # bf16 logits with many exact ties of the max
    x = torch.randint(-4, 4, (rows, vocab), device="cuda", generator=gen).to(torch.bfloat16)
    _check(x)
