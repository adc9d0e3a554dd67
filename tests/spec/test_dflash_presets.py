"""Random drafters in released shapes (deltaserve/spec/dflash/presets.py)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.models.dflash import DFlashDraftModel
from deltaserve.spec.dflash.config import parse_dflash_config
from deltaserve.spec.dflash.presets import drafter_preset_config, random_preset_name


def test_qwen35_9b_drafter_shape():
    cfg = parse_dflash_config(drafter_preset_config("qwen3.5-9b-dflash"), "preset")
    # the Qwen3.5-9B target: hidden 4096, vocab 248320, 32 layers
    cfg.check_target(4096, 248320, 32)
    assert cfg.target_layer_ids == (1, 8, 15, 22, 29) and cfg.block_size == 16
    with torch.device("meta"):
        model = DFlashDraftModel(cfg)
    specs = model.layer_specs()
    assert len(specs) == 5
    assert {(s.num_heads, s.num_kv_heads, s.head_dim) for s in specs} == {(32, 8, 128)}
    assert tuple(model.fc.weight.shape) == (4096, 5 * 4096)
    # about 1.05 B parameters: fc 84 M + 5 layers of (attention 42 M + MLP 151 M)
    n = sum(p.numel() for p in model.parameters())
    assert 1.0e9 < n < 1.1e9


def test_preset_names():
    assert random_preset_name("/some/dir") is None
    assert random_preset_name("random:qwen3.5-9b-dflash") == "qwen3.5-9b-dflash"
    with pytest.raises(ValueError, match="unknown random drafter 'nope'"):
        random_preset_name("random:nope")


def test_bench_runs_on_cpu(capsys):
    from deltaserve.spec.dflash.bench import main

    main(
        [
            "--preset",
            "tiny-dflash",
            "--device",
            "cpu",
            "--batch",
            "1",
            "3",
            "--drafts",
            "3",
            "--context",
            "21",
            "--iters",
            "1",
        ]
    )
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("batch")]
    assert len(lines) == 2 and "block forward" in lines[0]


def test_random_drafter_on_the_tiny_hybrid_target():
    """`random:tiny-dflash` binds to the random tiny Qwen3.5 (GDN + attention) target and
    drafts from its real taps after a prefill."""
    from types import SimpleNamespace

    from dflash_helpers import prefill_taps

    from deltaserve.cache.planner import CachePlan
    from deltaserve.loader.random_model import init_random_weights, random_model_config
    from deltaserve.loader.weights import build_model
    from deltaserve.models.registry import get_model_class
    from deltaserve.spec.dflash.proposer import DFlashProposer
    from deltaserve.spec.proposer import ComputedRow, TargetStep

    _, text, arch = random_model_config("tiny-qwen3.5")
    target = build_model(get_model_class(arch), text, False, torch.float32, "cpu")
    init_random_weights(target, 0)
    config = SimpleNamespace(
        model=SimpleNamespace(dtype=torch.float32, device=torch.device("cpu")),
        cache=SimpleNamespace(block_size=16, state_dtype=torch.float32),
    )
    spec = SimpleNamespace(model="random:tiny-dflash", num_speculative_tokens=7, options={})
    proposer = DFlashProposer(spec, config)
    proposer.bind(target)
    proposer.allocate(CachePlan({"paged": 4}, {"paged": 1}), config)
    prompt = list(range(10, 30))
    hidden = prefill_taps(target, prompt, proposer.tap_layer_ids)
    assert sorted(hidden) == [0, 2]
    seq = SimpleNamespace(
        seq_id=1,
        token_ids=prompt + [7],
        block_ids=[2, 3],
        params=SimpleNamespace(temperature=0.0),
        generator=None,
    )
    proposer.observe(TargetStep([ComputedRow(seq, 0, 20, range(20))], hidden))
    (draft,) = proposer.propose([seq], [7])
    assert len(draft.token_ids) == 7 and all(0 <= t < 512 for t in draft.token_ids)
    assert (
        draft.token_ids
        == proposer.drafter.draft_logits(
            torch.tensor([7]),
            torch.tensor([20], dtype=torch.int32),
            torch.tensor([[2, 3]], dtype=torch.int32),
            7,
        )[0]
        .argmax(-1)
        .tolist()
    )
