"""The Triton fused-MoE `moe` backend: routing, expert GEMMs and the top-k sum on the device,
with no host sync (the whole op can be captured in a CUDA graph).

Per call (x [T, H]):
1. routing (triton_routing), unless the routing is given (Qwen's rule, or with
   `routed_scaling_factor` DeepSeek-V2 greedy's: float32 weights times the factor);
2. T * k <= DECODE_DEFAULT_PAIRS: the decode path (triton_decode): no sort, each selected expert's
   weights streamed once; otherwise the pairs are sorted and aligned by expert (triton_align)
   and run through the grouped GEMMs (triton_gemm);
3. the k weighted outputs of each token summed in float32, the gated shared expert added when
   given (triton_reduce), rounded once into [T, H] in x's dtype. A shared expert given itself
   (`shared_gate_up`, `shared_down`) runs inside the decode path's down kernel; on the sorted
   path its SiLU-and-mul (Triton) and down projection (F.linear) run before the reduce. On the
   decode path without a `shared_out` tensor the down kernel does this sum itself (the last
   program of each column tile), and for a single token the gate_up kernel routes it itself,
   so a batch-1 MoE layer is gate_up and down: two launches after the block's in_proj. A single
   token with experts of width <= ONE_TOKEN_GEMV_MAX_INTER runs the GEMV-style pair of
   triton_decode_one_token instead (DELTASERVE_MOE_ONE_TOKEN=gemv|tile forces either).
Buffers are sized from the shapes only (worst case), so a graph captured at one batch size
replays for any routing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve import env
from deltaserve.ops.fused.activation import silu_and_mul
from deltaserve.ops.moe import (
    check_inputs,
    check_shared,
    check_shared_expert,
    router_logits_torch,
)
from deltaserve.ops.moe.triton_align import align_by_expert
from deltaserve.ops.moe.triton_decode import (
    DECODE_DEFAULT_PAIRS,
    DECODE_MAX_PAIRS,
    RouteArgs,
    SharedExpertArgs,
    decode_experts,
)
from deltaserve.ops.moe.triton_decode_one_token import one_token_experts
from deltaserve.ops.moe.triton_gemm import choose_block_m, sorted_experts
from deltaserve.ops.moe.triton_reduce import reduce_pairs
from deltaserve.ops.moe.triton_router import ROUTER_TRITON_MAX_ROWS, router_logits_triton
from deltaserve.ops.moe.triton_routing import route_triton

# the widest experts (a rank's intermediate) for which one token runs the GEMV-style kernels
# by default. One H100, decode batch 1 (docs/benchmarks.md, "One token: GEMV-style kernels"):
# qwen3.5-35b-a3b (width 512) 323.4 tok/s against 315.6 with the tile kernels; deepseek-v2-lite
# (width 1408) 365.0 against 369.5, where the tile kernels' grid of one program row per expert
# already streams a layer's 138 MB near the copy rate.
ONE_TOKEN_GEMV_MAX_INTER = 512


class TritonMoE:
    """The `moe` backend object. `decode_max_pairs` (at most DECODE_MAX_PAIRS) moves the switch
    between the decode path and the sorted path (0: always sorted; benchmarks and tests force
    each path with it); `one_token` ("auto", "gemv" or "tile"; default DELTASERVE_MOE_ONE_TOKEN)
    picks the kernels of one token routed from its logits (benchmarks compare them)."""

    name = "triton"
    supports_cuda_graph = True  # grids and buffers from shapes only; routing never read on host

    def __init__(
        self, decode_max_pairs: int = DECODE_DEFAULT_PAIRS, one_token: str | None = None
    ) -> None:
        if not 0 <= decode_max_pairs <= DECODE_MAX_PAIRS:
            raise ValueError(f"decode_max_pairs must be in 0..{DECODE_MAX_PAIRS}")
        if one_token not in (None, "auto", "gemv", "tile"):
            raise ValueError(f"one_token must be 'auto', 'gemv' or 'tile', got {one_token!r}")
        self.decode_max_pairs = decode_max_pairs
        # one token's kernels: None reads DELTASERVE_MOE_ONE_TOKEN at each call
        self.one_token = one_token

    def _one_token_gemv(self, inter: int) -> bool:
        """Whether one token routed from its logits runs the GEMV-style kernels
        (triton_decode_one_token) for experts of width `inter`, else the tile kernels."""
        choice = self.one_token or env.moe_one_token()
        if choice == "auto":
            return inter <= ONE_TOKEN_GEMV_MAX_INTER
        return choice == "gemv"

    def router_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [T, H], weight [E, H] float32 -> [T, E] float32: one Triton launch up to
        ROUTER_TRITON_MAX_ROWS tokens (one: triton_router.py says why), torch's F.linear
        above."""
        if x.shape[0] <= ROUTER_TRITON_MAX_ROWS and weight.dtype == torch.float32:
            return router_logits_triton(x, weight)
        return router_logits_torch(x, weight)

    def __call__(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        router_logits: torch.Tensor | None = None,
        top_k: int = 0,
        renormalize: bool = True,
        routed_scaling_factor: float | None = None,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        shared_out: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
        shared_gate_up: torch.Tensor | None = None,
        shared_down: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_inputs(x, w13, w2, router_logits, top_k, topk_ids, topk_weights)
        check_shared_expert(x, shared_out, shared_gate_up, shared_down, shared_gate)
        fused_shared = shared_gate_up is not None and shared_down is not None
        if not fused_shared:
            check_shared(x, shared_out, shared_gate)
        if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
            raise ValueError("moe (triton): x, w13 and w2 need a unit last stride")
        route = None
        if topk_ids is None or topk_weights is None:
            if x.shape[0] == 1 and top_k <= self.decode_max_pairs and shared_out is None:
                # one token on the decode path: gate_up routes it (no routing launch)
                logits = router_logits.contiguous()  # [1, E]: a copy only if strided in E
                route = RouteArgs(logits, renormalize, routed_scaling_factor)
                # DeepSeek-V2's scaled weights stay float32 (the down kernel reads float32)
                w_dtype = x.dtype if routed_scaling_factor is None else torch.float32
                topk_ids = torch.empty(1, top_k, dtype=torch.int32, device=x.device)
                topk_weights = torch.empty(1, top_k, dtype=w_dtype, device=x.device)
            else:
                topk_ids, topk_weights = route_triton(
                    router_logits, top_k, renormalize, x.dtype, routed_scaling_factor
                )
        topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
        num_tokens, k = topk_ids.shape
        if num_tokens == 0:
            return torch.zeros_like(x)
        num_pairs = num_tokens * k
        if num_pairs <= self.decode_max_pairs:
            shared = None
            if fused_shared:
                if shared_down.stride(-1) != 1:
                    raise ValueError("moe (triton): shared_down needs a unit last stride")
                shared = SharedExpertArgs(shared_gate_up, shared_down, shared_gate)
            if route is not None and self._one_token_gemv(w13.shape[1] // 2):
                return one_token_experts(
                    x, w13, w2, route.logits, topk_ids, topk_weights, renormalize,
                    routed_scaling_factor, *(shared or (None, None, None)),
                )  # fmt: skip
            if shared_out is None:  # the down kernel sums the tokens' rows: no reduce launch
                return decode_experts(x, w13, w2, topk_ids, topk_weights, shared, True, route=route)
            pair_out = decode_experts(x, w13, w2, topk_ids, topk_weights)
            return reduce_pairs(pair_out, k, x.dtype, shared_out, shared_gate)
        if fused_shared:  # prefill sizes: SiLU-and-mul (one Triton launch) and F.linear
            shared_out = F.linear(silu_and_mul(shared_gate_up), shared_down)
        block_m = choose_block_m(num_pairs, w13.shape[0])
        aligned = align_by_expert(topk_ids, w13.shape[0], block_m)
        pair_out = sorted_experts(x, w13, w2, topk_ids, topk_weights, aligned)
        return reduce_pairs(pair_out, k, x.dtype, shared_out, shared_gate)
