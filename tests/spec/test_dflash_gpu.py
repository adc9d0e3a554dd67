"""The drafter on CUDA (run with `pytest -m gpu tests/spec/test_dflash_gpu.py`):

- a tiny drafter in bf16 (torch and Triton fused ops) against the dense float32 reference;
- a random drafter of the Qwen3.5-9B DFlash shape (5 layers, H 4096, 32 / 8 heads of 128,
  block 16) in bf16: context insertion, the eager block forward, and its CUDA graphs (replay
  equals eager, padding rows included).
"""

from __future__ import annotations

import pytest
import torch
from dflash_helpers import StandInTarget, drafter_config, write_drafter

from deltaserve.forward_context import Kernels
from deltaserve.ops.fused import load_fused_ops
from deltaserve.spec.dflash.config import parse_dflash_config
from deltaserve.spec.dflash.drafter import build_drafter, load_drafter
from deltaserve.spec.dflash.graphs import DrafterGraphs
from deltaserve.spec.dflash.presets import drafter_preset_config
from deltaserve.spec.dflash.reference import DenseDrafter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
BLOCK = 16


def _caches(drafter, num_blocks: int, dtype: torch.dtype):
    return [
        {
            n: torch.zeros(sh, dtype=dt, device=CUDA)
            for n, (sh, dt) in s.tensors(num_blocks, BLOCK, dtype, torch.float32).items()
        }
        for s in drafter.layer_specs()
    ]


def _slots(table: list[int], start: int, n: int) -> torch.Tensor:
    pos = range(start, start + n)
    return torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in pos], device=CUDA)


@pytest.mark.parametrize("fused", ["torch", "triton"])
def test_tiny_drafter_bf16_matches_reference(tmp_path, fused):
    raw = drafter_config(
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=20,
    )
    weights = write_drafter(tmp_path / "d", raw)
    target = StandInTarget(device=CUDA, dtype=torch.bfloat16)
    kernels = Kernels(fused=load_fused_ops(fused))
    drafter = load_drafter(tmp_path / "d", target, torch.bfloat16, CUDA, kernels)
    drafter.caches = _caches(drafter, 16, torch.bfloat16)
    cfg = drafter.config
    embed = target.model.embed_tokens.weight.float().cpu()
    ref = DenseDrafter(weights, cfg, embed, target.lm_head_weight.float().cpu())
    gen = torch.Generator().manual_seed(0)
    table = [3, 9, 4, 12, 7]
    ctx = 0
    for n in (37, 3, 1, 6):
        taps = torch.randn(n, 2, 32, generator=gen)
        ref.add_context(taps)
        drafter.insert_context(
            taps.to(CUDA, torch.bfloat16),
            torch.arange(ctx, ctx + n, device=CUDA),
            _slots(table, ctx, n),
        )
        ctx += n
        last = int(torch.randint(0, 60, (1,), generator=gen))
        logits = drafter.draft_logits(
            torch.tensor([last], device=CUDA),
            torch.tensor([ctx], dtype=torch.int32, device=CUDA),
            torch.tensor([table], dtype=torch.int32, device=CUDA),
            5,
        )[0].cpu()
        expect = ref.draft_logits(last, 5)
        err = (logits - expect).abs().max() / expect.abs().max()
        assert err < 5e-2, f"relative error {err:.3g} after {ctx} context positions"


@torch.inference_mode()
def test_9b_shape_block_forward_and_graphs():
    raw = drafter_preset_config("qwen3.5-9b-dflash")
    cfg = parse_dflash_config(raw)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (5, 4096, 32)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.block_size) == (8, 128, 16)
    target = StandInTarget(4096, 248320, 32, device=CUDA, dtype=torch.bfloat16)
    drafter = build_drafter(
        cfg,
        target,
        torch.bfloat16,
        CUDA,
        Kernels(fused=load_fused_ops("triton")),
        random_seed=0,
    )
    num_blocks, width = 64, 16
    drafter.caches = _caches(drafter, num_blocks, torch.bfloat16)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    lens = [37, 200, 5, 121]
    tables = [list(range(1 + 15 * r, 1 + 15 * r + width)) for r in range(4)]
    for r, n in enumerate(lens):
        taps = torch.randn(n, 5, 4096, generator=gen, device=CUDA, dtype=torch.bfloat16)
        drafter.insert_context(taps, torch.arange(n, device=CUDA), _slots(tables[r], 0, n))
    last = torch.tensor([11, 22, 33, 44], device=CUDA)
    ctx = torch.tensor(lens, dtype=torch.int32, device=CUDA)
    table = torch.tensor(tables, dtype=torch.int32, device=CUDA)
    k = 15
    logits = drafter.draft_logits(last, ctx, table, k)
    assert logits.shape == (4, k, 248320) and bool(torch.isfinite(logits).all())
    tokens, _ = drafter.propose(last, ctx, table, k)
    assert torch.equal(tokens, logits.argmax(-1))

    graphs = DrafterGraphs(drafter, max_batch=8, num_drafts=k, max_blocks=width)
    graphs.capture()
    # same rows, same shapes as eager: the same drafts (where the top two logits are apart)
    _assert_same_drafts(graphs.replay(last, ctx, table), logits)
    # 3 rows in the 4-row bucket (one padding row): the padding changes nothing for the others
    eager3 = drafter.draft_logits(last[:3], ctx[:3], table[:3], k)
    _assert_same_drafts(graphs.replay(last[:3], ctx[:3], table[:3]), eager3)


def _assert_same_drafts(tokens: torch.Tensor, logits: torch.Tensor) -> None:
    """tokens [R, k] equal logits [R, k, V]'s argmax wherever the top two logits differ by
    more than bf16 noise (most positions)."""
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.02 * top2[..., 0].abs().clamp_min(1.0)
    assert clear.float().mean() > 0.5
    assert bool((tokens == logits.argmax(-1))[clear].all())


def test_proposer_graphs_replay_the_eager_drafts(tmp_path):
    from types import SimpleNamespace

    from deltaserve.cache.planner import CachePlan
    from deltaserve.spec.dflash.proposer import DFlashProposer
    from deltaserve.spec.proposer import ComputedRow, TargetStep

    write_drafter(tmp_path / "d", drafter_config())
    config = SimpleNamespace(
        model=SimpleNamespace(dtype=torch.bfloat16, device=CUDA),
        cache=SimpleNamespace(block_size=BLOCK, state_dtype=torch.float32),
    )
    spec = SimpleNamespace(model=str(tmp_path / "d"), num_speculative_tokens=5, options={})
    proposer = DFlashProposer(spec, config)
    proposer.bind(StandInTarget(device=CUDA, dtype=torch.bfloat16))
    proposer.allocate(CachePlan({"paged": 16}, {"paged": 1}), config)
    seqs = [
        SimpleNamespace(
            seq_id=i,
            token_ids=list(range(3, 3 + n)),
            block_ids=blocks,
            params=SimpleNamespace(temperature=0.0),
            generator=None,
        )
        for i, (n, blocks) in enumerate([(40, [1, 2, 3, 4]), (7, [5, 6, 7, 8])])
    ]
    rows, start = [], 0
    for s in seqs:
        n = len(s.token_ids) - 1
        rows.append(ComputedRow(s, 0, n, range(start, start + n)))
        start += n
    taps = {
        i: torch.randn(start, 32, device=CUDA, dtype=torch.bfloat16) for i in proposer.tap_layer_ids
    }
    proposer.observe(TargetStep(rows, taps))
    eager = [d.token_ids for d in proposer.propose(seqs, [5, 5])]
    proposer.capture_graphs(max_batch=4, max_blocks=4)
    graphed = [d.token_ids for d in proposer.propose(seqs, [5, 5])]
    assert graphed == eager
