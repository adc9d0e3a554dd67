"""The `moe` op family: the routed experts of a mixture-of-experts feed-forward layer.

A backend takes the hidden states x [T, H], either the router logits [T, E] (it routes: softmax
in float32 over all experts, top-k, then by Qwen's rule renormalised when asked and the weights
cast to x's dtype, or, given `routed_scaling_factor`, by DeepSeek-V2's greedy rule: the weights
times the factor, not renormalised (`renormalize` unused), kept in float32; `route` states both)
or a routing already made (`topk_ids` [T, k] int64, `topk_weights` [T, k]), and the experts' weights
stacked over experts: `w13` [E, 2I, H] (the gate projection's rows first, then the up
projection's) and `w2` [E, H, I]. It returns sum_j weight_j * expert_{id_j}(x) [T, H], where
expert_e(x) = w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x)).

Optionally the block's shared expert is combined in the same pass (no elementwise launches of
its own): given `shared_out` [T, H] (the shared expert's output, x's dtype, unit last stride)
and `shared_gate` [T, 1] (its gate logit, any strides), the op returns
    sum_j weight_j * expert_{id_j}(x) + sigmoid(shared_gate) * shared_out,
the whole sum in float32, rounded once to x's dtype (`shared_out` without `shared_gate`: added
ungated). Instead of `shared_out`, the shared expert itself may be given: `shared_gate_up`
[T, 2Is] (its gate projection's outputs then its up projection's, x's dtype, unit last stride,
any row stride: a slice of the block's fused projection) and `shared_down` [H, Is] (its down
projection's weight); the op then computes
    shared_out = (silu(gate) * up, rounded to x's dtype) @ shared_down.T
itself (`shared_expert_out` in torch; the Triton decode path streams `shared_down` beside the
routed experts' down projections in the same launch and keeps the product in float32).
Under tensor parallelism both terms are this rank's partials and the caller all-reduces the
result once (sigmoid(shared_gate) is replicated, so it commutes with the sum).

Backends (chosen at start-up, deltaserve.backends, only for models that declare MoE layers:
`MoESpec`, layer kind "moe"), in priority order (triton before grouped_mm is a guess until
`deltaserve bench kernels --only moe` decides):
- `triton` (triton_backend.py; CUDA, bf16 / fp16 / fp32): routing kernel (triton_routing.py,
  reading strided router logits in place);
  T * k <= 128 pairs: the decode path (triton_decode.py, each selected expert's weights streamed
  once); more: pairs sorted and aligned by expert (triton_align.py) through grouped GEMMs
  (triton_gemm.py: gate_up with SiLU-and-mul fused, down with the routing weights applied);
  the k outputs of each token and the gated shared expert summed in float32 in one kernel
  (triton_reduce.py; on the decode path by the down kernel itself, unless `shared_out` is a
  given tensor). No host sync: CUDA-graph capturable.
- `grouped_mm` (grouped_mm.py; CUDA bf16, compute capability 9.x / 10.x): the pairs sorted by
  expert through two `torch._grouped_mm` calls. No host sync: CUDA-graph capturable.
- `torch` (reference.py): any device and dtype; reads per-expert counts on the host (no graphs).
Every backend returns x's dtype and accumulates the k outputs (and the shared term) in
float32. Each also computes a float32 router's logits (`router_logits`, DeepSeek-V2's router):
torch's F.linear, or in `triton` one Triton launch for decode-sized calls (triton_router.py).
Expert ids of a given routing must lie in [0, E) (not checked on the device: that
would sync the host).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MoESpec:
    """What a MoE layer needs from a `moe` backend (grouped by `layer_kind` in Capabilities,
    like the cache specs; it holds no cache)."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int  # per expert
    layer_kind: ClassVar[str] = "moe"


def route(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    dtype: torch.dtype,
    routed_scaling_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router logits [T, E] -> (topk_ids [T, k] int64, topk_weights [T, k]): softmax in float32
    over all experts, the k largest; then Qwen's rule: renormalised to sum to 1 when
    `renormalize`, cast to `dtype`; or, with `routed_scaling_factor`, DeepSeek-V2's greedy rule
    (grouped_topk.deepseek_route's "greedy"): times the factor, not renormalised, float32
    (`renormalize` and `dtype` unused)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if routed_scaling_factor is not None:
        return ids, weights * routed_scaling_factor
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(dtype)


class MoEBackend(Protocol):
    """The interface every `moe` backend implements."""

    name: str
    supports_cuda_graph: bool

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
        """x [T, H] -> [T, H] in x's dtype (router logits, or the routing, and the optional
        shared expert term, as described above)."""
        ...

    def router_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A float32 router's logits (DeepSeek-V2's): x [T, H], weight [E, H] float32 ->
        x.float() @ weight.T [T, E] float32 (router_logits_torch, HF's computation,
        or a kernel equal to it up to float32 summation order)."""
        ...


def router_logits_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A float32 router's logits as HF computes them: x [T, H], weight [E, H] ->
    F.linear(x.float(), weight.float()) [T, E] float32."""
    return F.linear(x.float(), weight.float())


def add_shared(
    routed: torch.Tensor, shared_out: torch.Tensor | None, shared_gate: torch.Tensor | None
) -> torch.Tensor:
    """The shared expert term of the contract, in torch: routed [T, H] float32 ->
    routed + sigmoid(shared_gate) * shared_out (float32; shared_out alone: added ungated)."""
    if shared_out is None:
        return routed
    shared = shared_out.float()
    if shared_gate is not None:
        shared = torch.sigmoid(shared_gate.float()) * shared  # [T, 1] * [T, H]
    return routed + shared


def shared_expert_out(shared_gate_up: torch.Tensor, shared_down: torch.Tensor) -> torch.Tensor:
    """The shared expert's output in torch: shared_gate_up [T, 2Is], shared_down [H, Is] ->
    (silu(gate) * up, in the activation dtype as HF computes it) @ shared_down.T [T, H]."""
    inter = shared_down.shape[1]
    gate, up = shared_gate_up[:, :inter], shared_gate_up[:, inter:]
    return F.linear(F.silu(gate) * up, shared_down)


def check_shared_expert(
    x: torch.Tensor,
    shared_out: torch.Tensor | None,
    shared_gate_up: torch.Tensor | None,
    shared_down: torch.Tensor | None,
    shared_gate: torch.Tensor | None = None,
) -> None:
    """Raise ValueError naming what is wrong with a `moe` call's `shared_gate_up` /
    `shared_down` (both or neither, not with `shared_out`) and, with them, `shared_gate`."""
    if shared_gate_up is None and shared_down is None:
        return
    if shared_gate_up is None or shared_down is None:
        raise ValueError("moe: shared_gate_up and shared_down go together (one was None)")
    if shared_out is not None:
        raise ValueError("moe: give shared_out or shared_gate_up / shared_down, not both")
    hidden = x.shape[-1]
    if shared_down.dim() != 2 or shared_down.shape[0] != hidden:
        raise ValueError(
            f"moe: shared_down must be [H={hidden}, Is], got {tuple(shared_down.shape)}"
        )
    want = (x.shape[0], 2 * shared_down.shape[1])
    if tuple(shared_gate_up.shape) != want or shared_gate_up.stride(-1) != 1:
        raise ValueError(
            f"moe: shared_gate_up must be [T, 2Is] = {want} with a unit last stride, got "
            f"{tuple(shared_gate_up.shape)} (strides {shared_gate_up.stride()})"
        )
    for name, t in (("shared_gate_up", shared_gate_up), ("shared_down", shared_down)):
        if t.dtype != x.dtype:
            raise ValueError(f"moe: {name} is {t.dtype}, x is {x.dtype}")
    if shared_gate is not None and shared_gate.shape != (x.shape[0], 1):
        raise ValueError(
            f"moe: shared_gate must be [T={x.shape[0]}, 1], got {tuple(shared_gate.shape)}"
        )


def resolve_shared(
    x: torch.Tensor,
    shared_out: torch.Tensor | None,
    shared_gate: torch.Tensor | None,
    shared_gate_up: torch.Tensor | None,
    shared_down: torch.Tensor | None,
) -> torch.Tensor | None:
    """Check a call's shared-expert arguments; returns `shared_out`, computed in torch
    (`shared_expert_out`) when the shared expert itself was given."""
    check_shared_expert(x, shared_out, shared_gate_up, shared_down)
    if shared_gate_up is not None and shared_down is not None:
        shared_out = shared_expert_out(shared_gate_up, shared_down)
    check_shared(x, shared_out, shared_gate)
    return shared_out


def check_shared(
    x: torch.Tensor, shared_out: torch.Tensor | None, shared_gate: torch.Tensor | None
) -> None:
    """Raise ValueError naming what is wrong with a `moe` call's shared expert arguments."""
    if shared_out is None:
        if shared_gate is not None:
            raise ValueError("moe: shared_gate was given without shared_out or shared_gate_up")
        return
    if shared_out.shape != x.shape or shared_out.stride(-1) != 1:
        raise ValueError(
            f"moe: shared_out must be [T, H] = {tuple(x.shape)} with a unit last stride, got "
            f"{tuple(shared_out.shape)} (strides {shared_out.stride()})"
        )
    if shared_out.dtype != x.dtype:
        raise ValueError(f"moe: shared_out is {shared_out.dtype}, x is {x.dtype}")
    if shared_gate is not None and shared_gate.shape != (x.shape[0], 1):
        raise ValueError(
            f"moe: shared_gate must be [T={x.shape[0]}, 1], got {tuple(shared_gate.shape)}"
        )


def check_inputs(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor | None,
    top_k: int,
    topk_ids: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
) -> None:
    """Raise ValueError naming what is wrong with a `moe` call's shapes (shapes only: expert ids
    are not range-checked on the device, which would sync the host)."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"moe: x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got x {tuple(x.shape)}, "
            f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
        )
    num_experts, two_i, hidden = w13.shape
    if x.shape[1] != hidden or tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(
            f"moe: shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)} "
            f"(want [E, 2I, {x.shape[1]}]), w2 {tuple(w2.shape)} (want [E, H, I])"
        )
    if topk_ids is not None and topk_weights is not None:
        if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
            raise ValueError(f"moe: topk_ids must be [T={x.shape[0]}, k], got {topk_ids.shape}")
        if topk_weights.shape != topk_ids.shape:
            raise ValueError(
                f"moe: topk_weights {tuple(topk_weights.shape)} must match topk_ids "
                f"{tuple(topk_ids.shape)}"
            )
        return
    if router_logits is None or top_k <= 0:
        raise ValueError("moe: give router_logits and top_k, or topk_ids and topk_weights")
    if router_logits.shape != (x.shape[0], num_experts):
        raise ValueError(
            f"moe: router_logits must be [T={x.shape[0]}, E={num_experts}], "
            f"got {tuple(router_logits.shape)}"
        )
    if top_k > num_experts:
        raise ValueError(f"moe: top_k {top_k} > {num_experts} experts")
