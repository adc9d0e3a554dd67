"""The torch Gated DeltaNet reference: chunked vs recurrent, against HF transformers' own torch
implementation and a naive float64 loop, on ragged batches over the state pools."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from meta_helpers import make_meta, rel_err
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from deltaserve.ops.gdn.reference import (
    chunk_gated_delta_rule,
    gdn_gates,
    l2norm,
    recurrent_gated_delta_rule,
    torch_gdn_kernels,
)

# HF wraps these to dispatch to hub kernels / FLA when present; take the plain torch functions.
hf_chunk = getattr(hf.torch_chunk_gated_delta_rule, "__wrapped__", hf.torch_chunk_gated_delta_rule)
hf_recurrent = getattr(
    hf.torch_recurrent_gated_delta_rule, "__wrapped__", hf.torch_recurrent_gated_delta_rule
)
hf_conv_fn = getattr(hf.causal_conv1d_fn, "__wrapped__", hf.causal_conv1d_fn)
hf_conv_update = getattr(hf.causal_conv1d_update, "__wrapped__", hf.causal_conv1d_update)

K, V = 16, 24  # key and value head dims differ on purpose
NUM_SLOTS = 9


def gdn_inputs(num_tokens: int, num_k_heads: int, num_v_heads: int, seed: int = 0):
    """Raw (pre-norm, pre-gate) inputs of the backend, with realistic gate magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, num_k_heads, K, generator=gen)
    k = torch.randn(num_tokens, num_k_heads, K, generator=gen)
    v = torch.randn(num_tokens, num_v_heads, V, generator=gen)
    a = torch.randn(num_tokens, num_v_heads, generator=gen)
    b = torch.randn(num_tokens, num_v_heads, generator=gen)
    A_log = torch.empty(num_v_heads).uniform_(0.01, 16, generator=gen).log()
    dt_bias = torch.randn(num_v_heads, generator=gen)
    return q, k, v, a, b, A_log, dt_bias


def naive_gdn(q, k, v, a, b, A_log, dt_bias, state):
    """The docstring math of `deltaserve.ops.gdn`, token by token and head by head, float64.
    q, k [L, HK, K]; v [L, HV, V]; state [HV, V, K]. Returns (o [L, HV, V], final state)."""
    L, num_k_heads, dk = k.shape
    num_v_heads = v.shape[1]
    ratio = num_v_heads // num_k_heads
    S = state.double().clone()
    out = torch.empty(L, num_v_heads, v.shape[2], dtype=torch.float64)
    for t in range(L):
        for h in range(num_v_heads):
            qt, kt = q[t, h // ratio].double(), k[t, h // ratio].double()
            qt = qt / torch.sqrt((qt * qt).sum() + 1e-6) * dk**-0.5
            kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
            g = -A_log[h].double().exp() * F.softplus(a[t, h].double() + dt_bias[h].double())
            beta = torch.sigmoid(b[t, h].double())
            S[h] = g.exp() * S[h]
            S[h] = S[h] + beta * torch.outer(v[t, h].double() - S[h] @ kt, kt)
            out[t, h] = S[h] @ qt
    return out, S


def random_pool(dtype: torch.dtype, num_v_heads: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(NUM_SLOTS, num_v_heads, V, K, generator=gen)).to(dtype)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 130])
def test_chunk_equals_recurrent(length, with_state, chunk_size):
    num_heads = 3
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(length, num_heads, num_heads, seed=length)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    q, k = l2norm(q), l2norm(k)
    state = random_pool(torch.float32, num_heads)[0] if with_state else None
    o_rec, s_rec = recurrent_gated_delta_rule(q, k, v, g, beta, state, K**-0.5)
    o_chk, s_chk = chunk_gated_delta_rule(q, k, v, g, beta, state, K**-0.5, chunk_size)
    assert o_chk.shape == (length, num_heads, V) and s_chk.shape == (num_heads, V, K)
    assert rel_err(o_chk, o_rec) < 1e-5
    assert rel_err(s_chk, s_rec) < 1e-5


@pytest.mark.parametrize("length", [1, 5, 65, 130])
def test_matches_hf_torch_kernels(length):
    """Backend (one prefill, then one decode) vs HF's torch chunk / recurrent functions; HF's
    state is [B, H, K, V], ours [H, V, K]."""
    num_k_heads, num_v_heads = 2, 4
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(length + 1, num_k_heads, num_v_heads, seed=3)
    pool = random_pool(torch.float32, num_v_heads)
    state0 = pool[4].clone()
    backend = torch_gdn_kernels()
    prefill, decode = slice(0, length), slice(length, length + 1)
    prefill_meta = make_meta([length], [7], 0, state_slots=[4])
    decode_meta = make_meta([1], [7 + length], 1, state_slots=[4])
    inputs = (q, k, v, a, b)
    out_prefill = backend.gated_delta_rule(
        *(t[prefill] for t in inputs), A_log, dt_bias, pool, prefill_meta
    )
    out_decode = backend.gated_delta_rule(
        *(t[decode] for t in inputs), A_log, dt_bias, pool, decode_meta
    )

    ratio = num_v_heads // num_k_heads
    hq = q.repeat_interleave(ratio, dim=1)  # [L + 1, HV, K]
    hk = k.repeat_interleave(ratio, dim=1)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)  # as HF's GatedDeltaNet.forward
    beta = b.sigmoid()
    common = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    for fn in (hf_chunk, hf_recurrent):
        want_prefill, hf_state = fn(
            *(t[None, prefill] for t in (hq, hk, v, g, beta)),
            initial_state=state0.transpose(-1, -2)[None],
            **common,
        )
        want_decode, hf_state = hf_recurrent(
            *(t[None, decode] for t in (hq, hk, v, g, beta)), initial_state=hf_state, **common
        )
        assert rel_err(out_prefill, want_prefill[0]) < 1e-5, fn.__name__
        assert rel_err(out_decode, want_decode[0]) < 1e-5, fn.__name__
        assert rel_err(pool[4], hf_state[0].transpose(-1, -2)) < 1e-5, fn.__name__


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [1, 2, 3])
def test_backend_ragged_batch(ratio, state_dtype):
    """2 decodes + 2 prefills (one fresh, on a NaN-poisoned slot; one on a cached prefix) equal
    running each sequence alone and the naive float64 loop; other slots stay bit-identical."""
    num_k_heads = 2
    num_v_heads = num_k_heads * ratio
    q_lens, context_lens, slots = [1, 1, 7, 33], [5, 9, 0, 10], [5, 2, 7, 3]
    num_tokens = sum(q_lens)
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(num_tokens, num_k_heads, num_v_heads, seed=ratio)
    pool = random_pool(state_dtype, num_v_heads)
    pool[7] = float("nan")  # the fresh prefill's slot holds garbage that must be ignored
    original = pool.clone()
    meta = make_meta(q_lens, context_lens, 2, state_slots=slots)
    backend = torch_gdn_kernels(chunk_size=16)
    out = backend.gated_delta_rule(q, k, v, a, b, A_log, dt_bias, pool, meta)
    assert out.shape == v.shape and out.dtype == v.dtype and torch.isfinite(out).all()

    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    torch.testing.assert_close(pool[untouched], original[untouched], rtol=0, atol=0)
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    for i, slot in enumerate(slots):
        rows = slice(meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1])
        solo_pool = original.clone()
        solo_meta = make_meta([q_lens[i]], [context_lens[i]], int(i < 2), state_slots=[slot])
        solo_out = backend.gated_delta_rule(
            q[rows], k[rows], v[rows], a[rows], b[rows], A_log, dt_bias, solo_pool, solo_meta
        )
        assert rel_err(out[rows], solo_out) < 1e-6, f"sequence {i} vs solo"
        assert rel_err(pool[slot], solo_pool[slot]) < 1e-6, f"sequence {i} state vs solo"

        init = original[slot] if context_lens[i] > 0 else torch.zeros_like(original[slot])
        want, want_state = naive_gdn(
            q[rows], k[rows], v[rows], a[rows], b[rows], A_log, dt_bias, init
        )
        assert rel_err(out[rows], want) < tol, f"sequence {i} vs naive"
        assert rel_err(pool[slot], want_state) < tol, f"sequence {i} state vs naive"


def conv_reference(history: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Full-sequence causal depthwise conv + SiLU with F.conv1d: history [N, C] -> [N, C]."""
    width = weight.shape[1]
    out = F.conv1d(history.T[None], weight[:, None, :], padding=width - 1, groups=weight.shape[0])
    return F.silu(out[0, :, : history.shape[0]]).T


def last_inputs(history: torch.Tensor, width: int) -> torch.Tensor:
    """The conv state after `history` [N, C]: its last W - 1 rows, zero-padded, as [C, W - 1]."""
    padded = torch.cat([history.new_zeros(width - 1, history.shape[1]), history])
    return padded[-(width - 1) :].T


@pytest.mark.parametrize("width", [2, 4])
def test_conv1d_ragged_batch(width):
    """Decodes and prefills of 1-2 tokens on short (< W - 1) or long histories, and fresh
    prefills on NaN-poisoned slots, against F.conv1d over each sequence's whole history."""
    conv_dim = 10
    q_lens, context_lens = [1, 1, 1, 2, 2, 2, 11, 6], [1, 9, 0, 0, 2, 1, 0, 5]
    slots = [8, 1, 3, 5, 2, 7, 4, 6]
    gen = torch.Generator().manual_seed(width)
    weight = torch.randn(conv_dim, width, generator=gen)
    histories = [
        torch.randn(c + q, conv_dim, generator=gen)
        for q, c in zip(q_lens, context_lens, strict=True)
    ]
    pool = torch.randn(NUM_SLOTS, conv_dim, width - 1, generator=gen)
    for hist, c, slot in zip(histories, context_lens, slots, strict=True):
        pool[slot] = last_inputs(hist[:c], width) if c > 0 else float("nan")
    original = pool.clone()
    x = torch.cat([hist[c:] for hist, c in zip(histories, context_lens, strict=True)])
    meta = make_meta(q_lens, context_lens, 2, state_slots=slots)

    out = torch_gdn_kernels().conv1d(x, weight, pool, meta)
    assert out.shape == x.shape and torch.isfinite(out).all()
    for i, (hist, c) in enumerate(zip(histories, context_lens, strict=True)):
        rows = slice(meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1])
        assert rel_err(out[rows], conv_reference(hist, weight)[c:]) < 1e-6, f"sequence {i}"
        assert rel_err(pool[slots[i]], last_inputs(hist, width)) == 0, f"state {i}"
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    torch.testing.assert_close(pool[untouched], original[untouched], rtol=0, atol=0)


def test_conv1d_matches_hf():
    """A fresh prefill vs HF's causal_conv1d_fn, then two decodes vs causal_conv1d_update."""
    conv_dim, width, length = 12, 4, 9
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(conv_dim, width, generator=gen)
    x = torch.randn(length + 2, conv_dim, generator=gen)
    pool = torch.full((3, conv_dim, width - 1), float("nan"))
    hf_state = torch.zeros(1, conv_dim, width - 1)
    backend = torch_gdn_kernels()

    out = backend.conv1d(x[:length], weight, pool, make_meta([length], [0], state_slots=[2]))
    want = hf_conv_fn(x[None, :length].transpose(1, 2), weight, None, activation="silu")
    assert rel_err(out, want[0].T) < 1e-6
    hf_state.copy_(x[None, length - width + 1 : length].transpose(1, 2))
    for t in range(length, length + 2):
        out = backend.conv1d(x[t : t + 1], weight, pool, make_meta([1], [t], 1, state_slots=[2]))
        want = hf_conv_update(x[None, t : t + 1].transpose(1, 2), hf_state, weight, None, "silu")
        assert rel_err(out, want[0].T) < 1e-6
        assert rel_err(pool[2], hf_state[0]) == 0


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_split_into_chunks_equals_whole(chunk_size):
    """Conv + delta rule over one 40-token prompt and 3 decodes: whole, vs prefill chunks of 7
    then single-token decodes, with everything carried through the pools."""
    num_k_heads, num_v_heads, width, length, num_decodes = 2, 6, 4, 40, 3
    total = length + num_decodes
    conv_dim = 2 * num_k_heads * K + num_v_heads * V
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(total, num_k_heads, num_v_heads, seed=9)
    x = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)  # [T, conv_dim]
    weight = torch.randn(conv_dim, width, generator=torch.Generator().manual_seed(1))
    backend = torch_gdn_kernels(chunk_size=chunk_size)

    def step(pools, start, end, is_decode):
        conv_pool, ssm_pool = pools
        meta = make_meta([end - start], [start], int(is_decode), state_slots=[3])
        y = backend.conv1d(x[start:end], weight, conv_pool, meta)
        qc, kc, vc = y.split([num_k_heads * K, num_k_heads * K, num_v_heads * V], dim=1)
        return backend.gated_delta_rule(
            qc.unflatten(1, (num_k_heads, K)),
            kc.unflatten(1, (num_k_heads, K)),
            vc.unflatten(1, (num_v_heads, V)),
            a[start:end],
            b[start:end],
            A_log,
            dt_bias,
            ssm_pool,
            meta,
        )

    def fresh_pools():
        conv_pool = torch.full((5, conv_dim, width - 1), float("nan"))
        return conv_pool, random_pool(torch.float32, num_v_heads)[:5].clone()

    whole_pools = fresh_pools()
    whole = step(whole_pools, 0, total, False)
    split_pools = fresh_pools()
    bounds = [*range(0, length, 7), length, *range(length + 1, total + 1)]
    split = torch.cat([step(split_pools, s, e, s >= length) for s, e in itertools.pairwise(bounds)])
    assert rel_err(split, whole) < 1e-5
    assert rel_err(split_pools[1][3], whole_pools[1][3]) < 1e-5
    assert rel_err(split_pools[0][3], whole_pools[0][3]) == 0
