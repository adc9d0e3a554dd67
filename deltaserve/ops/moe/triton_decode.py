"""The decode path of the Triton `moe` backend: few pairs (T * k <= a threshold), no sort.

Goal: memory bandwidth. Each selected expert's weights are read once per step. The grid is
(S = T * k pair slots, column tiles), fixed by the shapes (CUDA-graph safe). The program of slot
s reads all S expert ids (a few bytes) and returns at once unless s is the first slot of its
expert; that program compacts the slots routed to the same expert into a tile of ROWS rows
(ROWS = T rounded up to a power of two in 16..64: with a top-k routing an expert has at most T
slots; more take further passes) and streams that expert's weight tile once for all of them:
- gate_up: inter[s] = silu(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T), t = s // k;
- down: pair_out[s] = topk_weight[s] * (inter[s] @ w2[e].T), float32.
With the block's shared expert given (its gate/up projection's outputs and its down weight), the
down kernel's grid has one more row of programs, which does the shared expert's SiLU-and-mul on
the tiles it loads and its down projection, gated by sigmoid(shared gate logit), into T more
rows of pair_out: the shared expert costs no launches of its own (at batch 1 it saved a
SiLU-and-mul and a decode GEMM launch per MoE layer).
The token sum: with `sum_tokens` the down kernel's last program of each column tile (its
arrival counter, deltaserve.ops.tile_counters) sums the tokens' rows in `triton_reduce`'s order
(no reduce launch); else `triton_reduce.reduce_pairs` over the returned pair outputs.
gate_up may split H across programs (SPLIT_K, chosen by its autotuner with the block sizes), and
for a single token route it itself from the router logits (`route`), each program computing the
token's top-k (the routing kernel's math) and program (s, 0, 0) storing slot s's choice. The
down kernel then routes the token the same way in each row of programs (it does not read the
stored choice), so under programmatic dependent launch (ops/pdl.py) it loads its experts' down
weights while gate_up is still running, and waits for gate_up only to read the intermediates.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from deltaserve.ops import pdl
from deltaserve.ops.moe.triton_decode_common import SPLIT_K_MAX
from deltaserve.ops.moe.triton_decode_down import _decode_down_kernel
from deltaserve.ops.moe.triton_decode_gate_up import _decode_gate_up_kernel
from deltaserve.ops.moe.triton_gemm import dot_precision
from deltaserve.ops.tile_counters import arrival_counters

# the most pairs (T * k) the decode path can serve (64 tokens at top-8), and the most the backend
# sends it by default (16 tokens at top-8; a guess until `bench kernels --only moe` decides)
DECODE_MAX_PAIRS = 512
DECODE_DEFAULT_PAIRS = 128


def decode_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    shared: SharedExpertArgs | None = None,
    sum_tokens: bool = False,
    gate_up_meta: dict | None = None,
    route: RouteArgs | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids / topk_weights [T, k] contiguous,
    T * k <= DECODE_MAX_PAIRS -> pair outputs [T * k, H] float32 (weighted, not yet summed).

    With `shared` (the shared expert: gate_up [T, 2Is], down [H, Is], gate [T, 1] or None,
    checked by the caller) the result is [T * k + T, H]: row T * k + t holds token t's shared
    expert output times sigmoid(gate[t]), computed by one more row of the down kernel's
    programs (the shared down weight streamed beside the routed experts').

    With `sum_tokens` the result is the op's output instead, [T, H] in x's dtype: each token's
    k rows (and its shared row) summed in float32 by the last program of each column tile of
    the down kernel (an arrival counter per tile, deltaserve.ops.tile_counters), in the order
    `triton_reduce` sums them: no reduce launch.

    `gate_up_meta` ({"BLOCK_N", "BLOCK_K", "SPLIT_K"}: tests) runs the gate_up kernel with that
    configuration instead of the autotuner's choice.

    With `route` (one token only) topk_ids / topk_weights are outputs: the gate_up kernel routes
    the token's router logits in every program (what triton_routing computes) and stores the
    routing there for the down kernel, saving the routing launch (with `route.scale`,
    DeepSeek-V2's greedy rule, topk_weights must be float32)."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if route is not None and (num_tokens != 1 or route.logits.shape != (1, w13.shape[0])):
        raise ValueError(
            f"routing inside gate_up serves one token's [1, E={w13.shape[0]}] logits, got "
            f"{tuple(route.logits.shape)}"
        )
    scaled = route is not None and route.scale is not None
    if scaled and topk_weights.dtype != torch.float32:
        raise ValueError(f"scaled routing stores float32 weights, got {topk_weights.dtype}")
    if num_pairs > DECODE_MAX_PAIRS:
        raise ValueError(
            f"the decode path serves at most {DECODE_MAX_PAIRS} pairs, got {num_pairs}"
        )
    _, two_i, hidden = w13.shape
    inter_size = two_i // 2
    inter = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)
    # the shared expert's down runs as this many program rows, each over about a routed
    # expert's width of its intermediate (triton_decode_down); one when the rows are returned
    shared_splits = 0
    if shared is not None:
        shared_splits = triton.cdiv(shared.down.shape[1], inter_size) if sum_tokens else 1
    out_rows = num_pairs + shared_splits * num_tokens
    pair_out = torch.empty(out_rows, hidden, dtype=torch.float32, device=x.device)
    s_pad = max(16, triton.next_power_of_2(num_pairs))
    # slots per expert: at most T with a top-k routing (distinct experts per token); more (a
    # given routing that repeats an expert within a token) take further passes
    rows = min(64, max(16, triton.next_power_of_2(num_tokens)))
    precision = dot_precision(x.dtype)
    # gate_up's float32 partials when the tuner splits H (sized for the largest split) and the
    # arrival counters of its (slot, column tile) pairs
    ws = torch.empty(SPLIT_K_MAX, num_pairs, two_i, dtype=torch.float32, device=x.device)
    gu_counters = arrival_counters(
        "moe-decode-gate-up", w13, DECODE_MAX_PAIRS * triton.cdiv(inter_size, 16)
    )
    kernel, meta = _decode_gate_up_kernel, {}
    if gate_up_meta is not None:
        if not 1 <= gate_up_meta.get("SPLIT_K", 1) <= SPLIT_K_MAX:
            raise ValueError(f"gate_up SPLIT_K must be in 1..{SPLIT_K_MAX}: {gate_up_meta}")
        kernel, meta = _decode_gate_up_kernel.fn, dict(gate_up_meta)
    num_experts = w13.shape[0]
    logits = route.logits if route is not None else x  # a dummy pointer when not routing
    kernel[lambda m: (num_pairs, triton.cdiv(inter_size, m["BLOCK_N"]), m["SPLIT_K"])](
        x, w13, inter, topk_ids, ws, gu_counters, logits, topk_weights, num_pairs, x.stride(0),
        w13.stride(0), w13.stride(1), inter.stride(0), float(route.scale) if scaled else 1.0,
        TOP_K=top_k, H=hidden, INTER=inter_size, S_PAD=s_pad, ROWS=rows,
        ROUTE=route is not None, E=num_experts, E_PAD=triton.next_power_of_2(num_experts),
        RENORMALIZE=route is not None and route.renormalize and not scaled, SCALE=scaled,
        PRECISION=precision, **meta, **pdl.launch_kwargs(x),
    )  # fmt: skip
    if shared is None:  # dummy pointers, never read
        y, gate, wsd, shared_inter = x, x, w2, 16
    else:
        y, wsd, gate = shared.gate_up, shared.down, shared.gate
        shared_inter = wsd.shape[1]
    out, counters = pair_out, pair_out  # dummies unless summing
    if sum_tokens:
        out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
        # one counter per column tile of the smallest BLOCK_N the tuner may pick (16)
        counters = arrival_counters("moe-decode-down", w2, triton.cdiv(hidden, 16))
    programs = num_pairs + shared_splits
    _decode_down_kernel[lambda m: (programs, triton.cdiv(hidden, m["BLOCK_N"]))](
        inter, w2, topk_weights, pair_out, topk_ids, num_pairs, inter.stride(0), w2.stride(0),
        w2.stride(1), y, y.stride(0), gate if gate is not None else y,
        gate.stride(0) if gate is not None else 0, wsd, wsd.stride(0), num_tokens, out,
        counters, logits, float(route.scale) if scaled else 1.0, H=hidden, INTER=inter_size,
        S_PAD=s_pad, ROWS=rows, HAS_SHARED=shared is not None, SHARED_INTER=shared_inter,
        SHARED_SPLITS=max(1, shared_splits), HAS_GATE=gate is not None and shared is not None,
        SUM=sum_tokens, TOP_K=top_k, ROUTE=route is not None, E=num_experts,
        E_PAD=triton.next_power_of_2(num_experts),
        RENORMALIZE=route is not None and route.renormalize and not scaled, SCALE=scaled,
        PRECISION=precision, **pdl.launch_kwargs(x),
    )  # fmt: skip
    return out


class RouteArgs(NamedTuple):
    """Routing done inside the gate_up kernel (one token): its router logits [1, E] (unit last
    stride), whether the top-k weights are renormalised, and DeepSeek-V2's routed scaling
    factor (not None: the weights times it, not renormalised, stored float32)."""

    logits: torch.Tensor
    renormalize: bool
    scale: float | None = None


class SharedExpertArgs(NamedTuple):
    """The shared expert as the decode path takes it: gate_up [T, 2Is] (x's dtype, unit last
    stride), down [H, Is] (unit last stride), gate [T, 1] (its gate logit) or None."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate: torch.Tensor | None
