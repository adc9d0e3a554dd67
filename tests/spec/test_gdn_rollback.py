"""GDN rollback after a verify step equals decoding the accepted tokens only.

A real GatedDeltaNet layer (random weights) runs a verify step over rows of 1 + k tokens with
the rollback scratch set, then rows that rejected drafts are rolled back; every slot's conv
and SSM state must equal a run that fed only the kept tokens. Covers a = 0 .. k per row, rows
without drafts and a padding row in one batch, draft rows in the decode part and in the
prefill part (a second q), and a zero-draft step and a second verify after a rollback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))

from meta_helpers import make_meta, rel_err  # noqa: E402

from deltaserve.forward_context import ForwardContext, Kernels  # noqa: E402
from deltaserve.layers.gdn import GatedDeltaNet  # noqa: E402
from deltaserve.ops.gdn.reference import torch_gdn_kernels  # noqa: E402
from deltaserve.ops.gdn.replay import TorchGDNReplay, replay_states_ref  # noqa: E402
from deltaserve.spec.gdn_rollback import GDNRollback, RollbackRow  # noqa: E402

HIDDEN = 24
NUM_SLOTS = 12
SCRATCH = range(7, 12)  # the last 5 slots
K_MAX = 4  # drafts per row at most: Q = 5


def make_layer(seed: int = 0) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(0, HIDDEN, 2, 6, 8, 4, conv_kernel=4, rms_norm_eps=1e-6)  # ratio 3
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
        layer.A_log.copy_(torch.empty(6).uniform_(0.1, 4).log())
    return layer


def make_cache(layer: GatedDeltaNet) -> dict[str, torch.Tensor]:
    s = layer.spec
    return {
        "conv_state": torch.full((NUM_SLOTS, s.conv_dim, s.conv_kernel - 1), float("nan")),
        "ssm_state": torch.full((NUM_SLOTS, s.num_v_heads, s.head_v_dim, s.head_k_dim), 7.0),
    }


def run(layer, cache, x, q_lens, ctx_lens, slots, num_decodes=0, dq=1, spec=None):
    meta = make_meta(q_lens, ctx_lens, num_decodes, state_slots=slots, decode_query_len=dq)
    kernels = Kernels(gdn=torch_gdn_kernels(chunk_size=4))
    ctx = ForwardContext(meta=meta, caches=[cache], kernels=kernels, spec_verify=spec)
    with torch.no_grad():
        return layer(torch.zeros(x.shape[0], dtype=torch.long), x, ctx)


def clone(cache):
    return {k: v.clone() for k, v in cache.items()}


def assert_states_equal(got, want, slots):
    for name in ("conv_state", "ssm_state"):
        for s in slots:
            err = rel_err(got[name][s], want[name][s])
            assert err < 1e-5, (name, s, err)


def replay_backend(name: str):
    """The replay backend under test: the torch reference, or the Triton one (fused rollback
    kernels; Triton's interpreter on CPU)."""
    if name == "torch":
        return TorchGDNReplay()
    pytest.importorskip("triton")
    from deltaserve.ops.gdn.triton_replay import TritonGDNReplay

    return TritonGDNReplay()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("seed", [0, 1])
def test_rollback_equals_decoding_only_the_kept_tokens(seed, backend):
    layer = make_layer(seed)
    gen = torch.Generator().manual_seed(seed)
    slots = [1, 2, 3, 4, 5, 6]
    prompt = [5, 3, 7, 2, 4, 6]
    cache = make_cache(layer)
    x0 = torch.randn(sum(prompt), HIDDEN, generator=gen)
    run(layer, cache, x0, prompt, [0] * 6, slots)  # contexts in every slot
    rollback = GDNRollback(
        [layer], [cache], SCRATCH, 1 + K_MAX, torch.float32, x0.device, replay_backend(backend)
    )

    def verify_step(q_lens, num_decodes, dq, kept, ctx_lens):
        """One verify step over rows q_lens (decode rows first, then other rows through the
        prefill kernels), then rollback; check against feeding only kept[b] tokens."""
        ref = clone(cache)
        x = torch.randn(sum(q_lens), HIDDEN, generator=gen)
        starts = [sum(q_lens[:b]) for b in range(len(q_lens))]
        draft = [b for b, q in enumerate(q_lens) if q > 1]
        spec = rollback.scratch([(starts[b], q_lens[b], slots[b]) for b in draft])
        run(layer, cache, x, q_lens, ctx_lens, slots, num_decodes, dq, spec)
        rows = [
            RollbackRow(r, kept[b], slots[b]) for r, b in enumerate(draft) if kept[b] < q_lens[b]
        ]
        rollback.rollback(rows)
        # the reference: only the kept tokens of each row, as one prefill chunk per row
        xs = torch.cat([x[starts[b] : starts[b] + kept[b]] for b in range(len(q_lens))])
        run(layer, ref, xs, kept, ctx_lens, slots)
        assert_states_equal(cache, ref, slots)
        return [c + n for c, n in zip(ctx_lens, kept, strict=True)]

    ctx = list(prompt)
    # decode part: 4 rows of q = 5 (a = 0, 2, 4 and 1 accepted); prefill part: q 3, 1 (no drafts)
    ctx = verify_step([5, 5, 5, 5, 3, 1], 4, 5, [1, 3, 5, 2, 2, 1], ctx)
    # a zero-draft step after the rollback: plain decodes everywhere
    ctx = verify_step([1] * 6, 6, 1, [1] * 6, ctx)
    # drafts of mixed lengths, all in the prefill path (decode part: q = 1 rows)
    ctx = verify_step([1, 1, 4, 2, 5, 3], 2, 1, [1, 1, 1, 2, 4, 3], ctx)
    # every draft accepted (no rollback) and then every draft rejected
    ctx = verify_step([5] * 4 + [1, 1], 6 - 2, 5, [5, 5, 5, 5, 1, 1], ctx)
    verify_step([5] * 4 + [1, 1], 4, 5, [1, 1, 1, 1, 1, 1], ctx)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padding_rows_and_the_null_slot_are_left_alone(backend):
    """A padded decode row (slot 0) does not disturb the rollback of the others."""
    layer = make_layer(3)
    gen = torch.Generator().manual_seed(3)
    cache = make_cache(layer)
    run(layer, cache, torch.randn(9, HIDDEN, generator=gen), [4, 5], [0, 0], [1, 2])
    rollback = GDNRollback(
        [layer], [cache], SCRATCH, 1 + K_MAX, torch.float32, torch.device("cpu"),
        replay_backend(backend),
    )  # fmt: skip
    ref = clone(cache)
    x = torch.randn(15, HIDDEN, generator=gen)
    spec = rollback.scratch([(0, 5, 1), (5, 5, 2)])  # the padding row records nothing
    run(layer, cache, x, [5, 5, 5], [4, 5, 1], [1, 2, 0], 3, 5, spec)
    rollback.rollback([RollbackRow(0, 2, 1), RollbackRow(1, 1, 2)])
    run(layer, ref, torch.cat([x[0:2], x[5:6]]), [2, 1], [4, 5], [1, 2])
    assert_states_equal(cache, ref, [1, 2])


def test_replay_reference_matches_a_token_loop():
    """The replay reference against the plain one-sequence recurrence, n = 0 .. Q."""
    from deltaserve.ops.gdn.reference import recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    R, Q, HV, K, V = 5, 4, 3, 8, 6
    k = torch.nn.functional.normalize(torch.randn(R, Q, HV, K, generator=gen), dim=-1)
    v = torch.randn(R, Q, HV, V, generator=gen)
    g = -torch.rand(R, Q, HV, generator=gen)
    beta = torch.rand(R, Q, HV, generator=gen)
    pool = torch.randn(12, HV, V, K, generator=gen)
    want = pool.clone()
    kept = torch.tensor([0, 1, 2, 3, 4])
    src, dst = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6, 7, 8, 9, 10])
    replay_states_ref(k, v, g, beta, kept, src, dst, pool)
    for r in range(R):
        n = int(kept[r])
        if n == 0:
            final = want[src[r]]
        else:
            _, final = recurrent_gated_delta_rule(
                k[r, :n], k[r, :n], v[r, :n], g[r, :n], beta[r, :n], want[src[r]], 1.0
            )
        assert rel_err(pool[dst[r]], final) < 1e-6
    assert torch.equal(pool[1:6], want[1:6])  # sources untouched
