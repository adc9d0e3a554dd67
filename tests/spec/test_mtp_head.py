"""The MTP head (`mtp.*`, deltaserve/models/mtp.py) loaded from tiny checkpoints in the released
layout, and the MTP proposer's paged drafting, equal a hand-written float32 reference of the math
(tests/spec/mtp_helpers.py): dense and MoE targets, per-expert and fused experts, the Qwen3.5
text, multimodal and Qwen3-Next key layouts.

The proposer is driven as the engine drives it: prefill chunks observed (target hidden states
random here: the head's math does not care where they come from), chains drafted for a batch
of sequences with scattered KV blocks (never-written cache slots are NaN, so reading one shows),
verify steps that accept some drafts observed, chains drafted again: every draft and its logits
equal the reference recomputed from scratch over the whole sequence."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

_TESTS_DIR = Path(__file__).resolve().parents[1]
for extra in (_TESTS_DIR, _TESTS_DIR / "spec"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from hf_models import SPECS_BY_NAME, build_model  # noqa: E402
from mtp_helpers import MTPReference, add_mtp_head, text_config  # noqa: E402

from deltaserve.loader.hf_config import load_hf_config  # noqa: E402
from deltaserve.loader.weights import WeightLoadError, load_weights  # noqa: E402
from deltaserve.loader.weights import build_model as build_ds_model  # noqa: E402
from deltaserve.models.registry import get_model_class  # noqa: E402
from deltaserve.spec.mtp.proposer import MTPProposer  # noqa: E402
from deltaserve.spec.proposer import FINAL_HIDDEN_TAP, ComputedRow, TargetStep  # noqa: E402

BLOCK = 4
NUM_BLOCKS = 40

CASES = {
    # name: (tiny checkpoint, fused experts in the MTP layer)
    "qwen3_5_dense": ("qwen3_5_r2_g3", False),
    "qwen3_5_vl_layout": ("qwen3_5_vl", False),
    "qwen3_5_moe": ("qwen3_5_moe_e10k3_g3", False),
    "qwen3_5_moe_fused": ("qwen3_5_moe_e12k4_g5_fused", True),
    "qwen3_next_moe": ("qwen3_next_e10k3_r2", False),
    "qwen3_next_dense_layer0": ("qwen3_next_e12k4_r3_step2_nonorm", False),  # sparse step 2
}


def load_target(path: Path, with_mtp: bool = True):
    hf_config, text, arch = load_hf_config(path)
    tie = bool(getattr(hf_config, "tie_word_embeddings", False))
    extra = {"with_mtp": True} if with_mtp else {}
    model = build_ds_model(get_model_class(arch), text, tie, torch.float32, "cpu", **extra)
    load_weights(model, path)
    return model


def make_proposer(model, k: int) -> MTPProposer:
    spec = SimpleNamespace(method="mtp", num_speculative_tokens=k, model=None, options={})
    config = SimpleNamespace(
        cache=SimpleNamespace(block_size=BLOCK),
        model=SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32),
    )
    proposer = MTPProposer(spec, config)
    proposer.bind(model)
    drafter = proposer.drafter
    drafter.caches = [
        {
            n: torch.full(shape, float("nan"), dtype=dt)  # never-written slots must not be read
            for n, (shape, dt) in s.tensors(NUM_BLOCKS, BLOCK, torch.float32, torch.float32).items()
        }
        for s in drafter.layer_specs()
    ]
    return proposer


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    name, fused = CASES[request.param]
    path, _ = build_model(SPECS_BY_NAME[name], tmp_path_factory.mktemp(name), load_oracle=False)
    weights = add_mtp_head(path, seed=11, fused=fused)
    model = load_target(path)
    lm_head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    ref_args = (weights, text_config(path), model.model.embed_tokens.weight, lm_head)
    return path, model, ref_args


def test_paged_drafting_equals_the_reference(case):
    _, model, ref_args = case
    k = 3
    proposer = make_proposer(model, k)
    cfg = ref_args[1]
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    gen = torch.Generator().manual_seed(3)
    perm = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()  # block 0 is null
    prompts = [7, 1, 11]
    seqs = [
        SimpleNamespace(
            seq_id=i,
            token_ids=torch.randint(3, V, (n,), generator=gen).tolist(),
            block_ids=perm[13 * i : 13 * i + 13],
        )
        for i, n in enumerate(prompts)
    ]
    hiddens: list[list[torch.Tensor]] = [[] for _ in seqs]  # per position h_p

    def observe(chunks: list[tuple[int, int, int]]) -> None:
        """(seq index, first position, kept) rows of one target step."""
        rows, parts, t = [], [], 0
        for i, first, kept in chunks:
            h = torch.randn(kept, H, generator=gen)
            assert len(hiddens[i]) == first
            hiddens[i].extend(h)
            parts.append(h)
            rows.append(ComputedRow(seqs[i], first, kept, range(t, t + kept)))
            t += kept
        proposer.observe(TargetStep(rows, {FINAL_HIDDEN_TAP: torch.cat(parts)}))

    def check(max_drafts: list[int]) -> list[list[int]]:
        drafts = proposer.propose(seqs, max_drafts)
        for i, seq in enumerate(seqs):
            ref = MTPReference(*ref_args)
            tokens = torch.tensor(seq.token_ids[1:])  # t_{p+1} of positions 0 .. n - 1
            want, want_logits = ref.chain(tokens, torch.stack(hiddens[i]), max_drafts[i])
            assert drafts[i].token_ids == want, f"sequence {i}"
            # the chain's logits too (step 0 rewrites position n - 1 with the same values)
            n = len(seq.token_ids) - 1
            _, logits = proposer.drafter.chain(
                torch.tensor([seq.token_ids[-1]]),
                hiddens[i][-1][None],
                torch.tensor([n - 1]),
                torch.tensor([seq.block_ids[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK]),
                torch.tensor([seq.block_ids], dtype=torch.int32),
                max_drafts[i],
            )
            torch.testing.assert_close(logits[0], want_logits, rtol=1e-4, atol=1e-4)
        return [d.token_ids for d in drafts]

    # prefill: seq 2 in two chunks (the first chunk's last position waits for its next token)
    observe([(0, 0, 7), (1, 0, 1), (2, 0, 5)])
    observe([(2, 5, 6)])
    for seq in seqs:  # the sampled token after the prompt
        seq.token_ids.append(int(torch.randint(3, V, (1,), generator=gen)))
    drafts = check([3, 2, 1])
    # verify: accept 2, 0 and 1 drafts (then a target token), and draft again
    for _step, accepted in enumerate(([2, 0, 1], [3, 1, 0])):
        chunks = []
        for i, (seq, a) in enumerate(zip(seqs, accepted, strict=True)):
            first = len(seq.token_ids) - 1
            a = min(a, len(drafts[i]))
            seq.token_ids.extend(drafts[i][:a])
            chunks.append((i, first, 1 + a))
        observe(chunks)
        for seq in seqs:
            seq.token_ids.append(int(torch.randint(3, V, (1,), generator=gen)))
        drafts = check([3, 3, 2])


def test_weights_are_skipped_without_the_method_and_named_when_missing(case, tmp_path):
    path, _, _ = case
    plain = load_target(path, with_mtp=False)  # the mtp.* tensors are skipped
    assert getattr(plain, "mtp", None) is None
    # a head tensor missing from the checkpoint is named
    from hf_models import remove_tensor

    name = "mtp.layers.0.self_attn.k_norm.weight"
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    remove_tensor(broken, name)
    with pytest.raises(WeightLoadError, match=name.replace(".", r"\.")):
        load_target(broken)


def test_chain_graph_replay_equals_the_eager_chain(case):
    """The chain's graph body (emulated: run eagerly on the static buffers of a padded bucket)
    drafts what the eager chain drafts, and its padding row writes nothing into the cache."""
    from deltaserve.spec.mtp.graphs import ChainGraphs

    _, model, ref_args = case
    proposer = make_proposer(model, 2)
    H, V = ref_args[1]["hidden_size"], ref_args[1]["vocab_size"]
    gen = torch.Generator().manual_seed(4)
    seqs, tables = [], [list(range(1, 6)), list(range(6, 11)), list(range(11, 16))]
    for i, n in enumerate([6, 9, 3]):
        seq = SimpleNamespace(
            seq_id=i,
            token_ids=torch.randint(3, V, (n,), generator=gen).tolist(),
            block_ids=tables[i],
        )
        h = torch.randn(n, H, generator=gen)
        proposer.observe(TargetStep([ComputedRow(seq, 0, n, range(n))], {FINAL_HIDDEN_TAP: h}))
        seq.token_ids.append(int(torch.randint(3, V, (1,), generator=gen)))
        seqs.append(seq)
    drafter = proposer.drafter
    graphs = ChainGraphs(drafter, max_batch=4, num_drafts=2, max_blocks=6, emulate=True)
    args = (
        torch.tensor([s.token_ids[-1] for s in seqs]),
        torch.stack([proposer.pending[s.seq_id].hidden for s in seqs]),
        torch.tensor([len(s.token_ids) - 2 for s in seqs]),
        torch.tensor(
            [
                t[(len(s.token_ids) - 2) // BLOCK] * BLOCK + (len(s.token_ids) - 2) % BLOCK
                for s, t in zip(seqs, tables)
            ]
        ),  # fmt: skip
        torch.tensor(tables, dtype=torch.int32),
    )
    eager, _ = drafter.chain(*args, 2)
    nan_before = int(drafter.caches[0]["k_cache"].isnan().sum())
    assert graphs.replay(*args).tolist() == eager.tolist()
    assert graphs.replays == {4: 1}  # 3 rows padded to the bucket of 4
    assert int(drafter.caches[0]["k_cache"].isnan().sum()) == nan_before
