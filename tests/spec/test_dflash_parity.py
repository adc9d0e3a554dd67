"""The engine's paged drafter equals the dense float32 reference of the same math
(deltaserve/spec/dflash/reference.py) over several drafting steps with varying acceptance, for a
batch of sequences with scattered KV blocks, in all-bidirectional, sliding-window-mixed and
non-causal sliding-window configs (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from dflash_helpers import StandInTarget, drafter_config, write_drafter

from deltaserve.spec.dflash.drafter import gather_taps, load_drafter
from deltaserve.spec.dflash.reference import DenseDrafter

BLOCK = 4  # KV block size: awkward on purpose
NUM_BLOCKS = 48

CONFIGS = {
    "bidirectional": {},
    "swa_mixed": {  # sliding layers causal (is_causal unset), the middle one full
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 5,
    },
    "swa_noncausal": {  # window smaller than the block: masks inside the block both ways
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "sliding_window": 3,
        "is_causal": False,
    },
    "causal_scaled_bias": {  # every layer causal, the optional scales, attention biases
        "is_causal": True,
        "attention_bias": True,
        "dflash_config": {
            "block_size": 6,
            "mask_token_id": 63,
            "target_layer_ids": [1, 4],
            "input_embedding_scale": 1.7,
            "output_multiplier": 0.6,
            "final_logit_softcapping": 3.0,
        },
    },
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_paged_drafter_equals_dense_reference(tmp_path, name):
    raw = drafter_config(**CONFIGS[name])
    weights = write_drafter(tmp_path / name, raw)
    target = StandInTarget()
    drafter = load_drafter(tmp_path / name, target, torch.float32, "cpu")
    spec = drafter.layer_specs()[0]
    drafter.caches = [
        {
            n: torch.full(shape, float("nan"), dtype=dt)  # never-written slots must not be read
            for n, (shape, dt) in s.tensors(NUM_BLOCKS, BLOCK, torch.float32, torch.float32).items()
        }
        for s in drafter.layer_specs()
    ]
    assert spec.num_kv_heads == 2 and spec.head_dim == 8
    cfg = drafter.config
    refs = [
        DenseDrafter(weights, cfg, target.model.embed_tokens.weight, target.lm_head_weight)
        for _ in range(3)
    ]
    gen = torch.Generator().manual_seed(7)
    perm = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()  # block 0 is null
    tables = [perm[0:15], perm[15:30], perm[30:45]]
    ctx_lens = [0, 0, 0]
    new_counts = [7, 1, 11]  # the prompts
    for step in range(5):
        # 1) context of the newly accepted positions, all rows in one call
        taps_rows, pos_rows, slot_rows = [], [], []
        for b, n in enumerate(new_counts):
            hidden = {i: torch.randn(n, cfg.hidden_size, generator=gen) for i in range(6)}
            taps = gather_taps(hidden, cfg.target_layer_ids)  # [n, 2, H]
            refs[b].add_context(taps)
            pos = torch.arange(ctx_lens[b], ctx_lens[b] + n)
            slots = torch.tensor([tables[b][p // BLOCK] * BLOCK + p % BLOCK for p in pos.tolist()])
            taps_rows.append(taps)
            pos_rows.append(pos)
            slot_rows.append(slots)
            ctx_lens[b] += n
        drafter.insert_context(torch.cat(taps_rows), torch.cat(pos_rows), torch.cat(slot_rows))

        # 2) one block forward for the batch; k varies (a shorter block than block_size too)
        k = [5, 3, 5, 2, 5][step]
        last = torch.randint(0, 60, (3,), generator=gen)
        width = max(ctx_lens) // BLOCK + 1 + step % 2  # wider tables than needed on odd steps
        table_t = torch.tensor([t[:width] for t in tables], dtype=torch.int32)
        lens_t = torch.tensor(ctx_lens, dtype=torch.int32)
        logits = drafter.draft_logits(last, lens_t, table_t, k)
        tokens, probs = drafter.propose(last, lens_t, table_t, k)
        assert probs is None and tokens.shape == (3, k)
        for b in range(3):
            ref = refs[b].draft_logits(int(last[b]), k)
            torch.testing.assert_close(
                logits[b],
                ref,
                atol=1e-4,
                rtol=1e-4,
                msg=lambda m, b=b, s=step: f"step {s} row {b}: {m}",
            )
            assert torch.equal(tokens[b], logits[b].argmax(-1))

        # 3) varying acceptance: a of the k drafts accepted -> a + 1 new context positions
        new_counts = [int(torch.randint(0, k + 1, (1,), generator=gen)) + 1 for _ in range(3)]


def test_context_changes_the_drafts(tmp_path):
    """The block reads the cached context (a different context gives different logits), and
    only the context: positions past ctx_len in the cache are never read."""
    raw = drafter_config()
    write_drafter(tmp_path / "d", raw)
    drafter = load_drafter(tmp_path / "d", StandInTarget(), torch.float32, "cpu")
    specs = drafter.layer_specs()
    drafter.caches = [
        {
            n: torch.zeros(sh, dtype=dt)
            for n, (sh, dt) in s.tensors(8, BLOCK, torch.float32, torch.float32).items()
        }
        for s in specs
    ]
    gen = torch.Generator().manual_seed(0)
    taps = torch.randn(6, 2, 32, generator=gen)
    slots = torch.arange(4, 10)
    drafter.insert_context(taps, torch.arange(6), slots)
    table = torch.tensor([[1, 2]], dtype=torch.int32)
    last = torch.tensor([5])
    base = drafter.draft_logits(last, torch.tensor([6]), table, 4)
    # garbage past the context (slots 10, 11) changes nothing
    for c in drafter.caches:
        c["k_cache"].view(-1, 2, 8)[10:12] = 1e4
    assert torch.equal(drafter.draft_logits(last, torch.tensor([6]), table, 4), base)
    # a different context changes the drafts
    drafter.insert_context(taps.flip(0), torch.arange(6), slots)
    other = drafter.draft_logits(last, torch.tensor([6]), table, 4)
    assert (other - base).abs().max() > 1e-3


def test_sampled_drafts_return_their_probabilities(tmp_path):
    write_drafter(tmp_path / "d", drafter_config())
    drafter = load_drafter(tmp_path / "d", StandInTarget(), torch.float32, "cpu")
    drafter.caches = [
        {
            n: torch.zeros(sh, dtype=dt)
            for n, (sh, dt) in s.tensors(4, BLOCK, torch.float32, torch.float32).items()
        }
        for s in drafter.layer_specs()
    ]
    drafter.insert_context(torch.randn(3, 2, 32), torch.arange(3), torch.arange(4, 7))
    args = (torch.tensor([9, 9]), torch.tensor([3, 3]), torch.tensor([[1], [1]], dtype=torch.int32))
    logits = drafter.draft_logits(*args, 4)
    tokens, probs = drafter.propose(
        *args, 4, temperature=0.7, generator=torch.Generator().manual_seed(1)
    )
    torch.testing.assert_close(probs, torch.softmax(logits / 0.7, -1))
    assert tokens.shape == (2, 4) and bool((probs.gather(-1, tokens[..., None]) > 0).all())
    with pytest.raises(ValueError, match="num_drafts 6"):
        drafter.propose(*args, 6)


def test_padding_rows_change_nothing(tmp_path):
    """Rows with context length 0 and the null block (CUDA-graph padding) leave the real rows'
    drafts as they are."""
    write_drafter(tmp_path / "d", drafter_config())
    drafter = load_drafter(tmp_path / "d", StandInTarget(), torch.float32, "cpu")
    drafter.caches = [
        {
            n: torch.zeros(sh, dtype=dt)
            for n, (sh, dt) in s.tensors(8, BLOCK, torch.float32, torch.float32).items()
        }
        for s in drafter.layer_specs()
    ]
    gen = torch.Generator().manual_seed(2)
    drafter.insert_context(
        torch.randn(9, 2, 32, generator=gen), torch.arange(9), torch.arange(4, 13)
    )
    drafter.insert_context(
        torch.randn(3, 2, 32, generator=gen), torch.arange(3), torch.arange(16, 19)
    )
    last = torch.tensor([5, 8])
    lens = torch.tensor([9, 3], dtype=torch.int32)
    table = torch.tensor([[1, 2, 3], [4, 0, 0]], dtype=torch.int32)
    real = drafter.draft_logits(last, lens, table, 5)
    padded = drafter.draft_logits(
        torch.cat([last, torch.zeros(2, dtype=torch.long)]),
        torch.cat([lens, torch.zeros(2, dtype=torch.int32)]),
        torch.cat([table, torch.zeros(2, 3, dtype=torch.int32)]),
        5,
    )
    torch.testing.assert_close(padded[:2], real, atol=1e-5, rtol=1e-5)
    assert bool(torch.isfinite(padded).all())
