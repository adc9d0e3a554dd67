"""Microbenchmark of one MoE layer's routed experts (used by `deltaserve bench kernels --only
moe`), GPU only: every `moe` backend on the same inputs, per token count.

Shapes: Qwen3.5-35B-A3B (transformers' Qwen3_5MoeTextConfig defaults, documented as that
checkpoint's): hidden 2048, 256 experts, top-8, expert intermediate 512, bf16. The op is timed
from the router logits (routing included, as a model step runs it). Router logits are random
and peaky: a per-expert bias (std `PEAK`) over unit noise, so popular experts are shared across
tokens, as with a trained router, and a batch selects fewer distinct experts than T * k.

Several layers' worth of expert weights (each with its own router logits) are cycled so that no
call finds its experts in the L2 the previous call warmed (8 selected experts are 48 MB, about
an H100's L2). Graph-capable backends are timed inside one CUDA graph over all layers, replayed
as the engine replays decode steps; the torch reference (a host sync) is timed eagerly.

Bytes counted: the weights of the distinct experts the routing selects (w13 and w2 rows, read
once: the floor) + x, the router logits and the output. FLOPs: 2 * T * k * 3 * I * H.
"""

from __future__ import annotations

import torch

SHAPE = dict(num_experts=256, hidden=2048, inter=512, top_k=8)


def rank_shape(tp: int = 1) -> dict:
    """SHAPE as one rank of tensor parallelism `tp` holds it: each expert's intermediate split
    (inter / tp), as layers/moe.py shards it."""
    if tp < 1 or SHAPE["inter"] % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide inter {SHAPE['inter']}")
    return dict(SHAPE, inter=SHAPE["inter"] // tp)


PEAK = 1.5
LAYERS = 4  # weight copies cycled per timed step (4 x 1.6 GB)
# impl -> (module:class, constructor kwargs, graph-capturable); "triton" is the backend as
# registered (its path chosen by the pair count), "triton-decode" / "triton-sorted" force a path,
# "triton-tile" (one token only) runs the decode path's tile kernels where "triton" runs the
# one-token GEMV kernels (triton_decode_one_token)
IMPLS = {
    "triton": ("deltaserve.ops.moe.triton_backend:TritonMoE", {}, True),
    "triton-decode": (
        "deltaserve.ops.moe.triton_backend:TritonMoE",
        {"decode_max_pairs": 512},
        True,
    ),
    "triton-sorted": (
        "deltaserve.ops.moe.triton_backend:TritonMoE",
        {"decode_max_pairs": 0},
        True,
    ),
    "triton-tile": (
        "deltaserve.ops.moe.triton_backend:TritonMoE",
        {"one_token": "tile"},
        True,
    ),
    "grouped_mm": ("deltaserve.ops.moe.grouped_mm:GroupedMmMoE", {}, True),
    "torch": ("deltaserve.ops.moe.reference:TorchMoE", {}, False),
}


def triton_path(num_tokens: int) -> str:
    """The path the registered Triton backend takes at `num_tokens` tokens."""
    from deltaserve.ops.moe.triton_decode import DECODE_DEFAULT_PAIRS

    return "decode" if num_tokens * SHAPE["top_k"] <= DECODE_DEFAULT_PAIRS else "sorted"


def moe_impls(num_tokens: int) -> list[str]:
    """The impls with a row at `num_tokens`: a forced path only where "triton" takes the other
    one (and the decode path only up to DECODE_MAX_PAIRS pairs)."""
    from deltaserve.ops.moe.triton_decode import DECODE_MAX_PAIRS

    path = triton_path(num_tokens)
    decode_ok = num_tokens * SHAPE["top_k"] <= DECODE_MAX_PAIRS
    skip = {"triton-sorted"} if path == "sorted" else {"triton-decode"}
    if not decode_ok:
        skip.add("triton-decode")
    if num_tokens != 1:
        skip.add("triton-tile")
    return [i for i in IMPLS if i not in skip]


def _load(impl: str):
    import importlib

    target, kwargs, graph = IMPLS[impl]
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs), graph


def make_weights(
    seed: int = 0, dtype=torch.bfloat16, shape: dict = SHAPE
) -> list[tuple[torch.Tensor, ...]]:
    """LAYERS (w13, w2, router bias) of `shape` on the GPU (weights ~ N(0, 1/fan_in))."""
    e, h, i = shape["num_experts"], shape["hidden"], shape["inter"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h**-0.5).to(dtype)
        w2 = (torch.randn(e, h, i, device="cuda", generator=gen) * i**-0.5).to(dtype)
        out.append((w13, w2, torch.randn(e, device="cuda", generator=gen) * PEAK))
    return out


def make_layers(num_tokens: int, weights, seed: int = 1) -> list[dict]:
    """One {x, w13, w2, logits} per weight set: fresh x and peaky router logits."""
    gen = torch.Generator(device="cuda").manual_seed(seed + num_tokens)
    layers = []
    for w13, w2, bias in weights:
        logits = torch.randn(num_tokens, bias.numel(), device="cuda", generator=gen) + bias
        x = torch.randn(num_tokens, w13.shape[-1], device="cuda", generator=gen)
        layers.append(dict(x=x.to(w13.dtype), w13=w13, w2=w2, logits=logits.to(w13.dtype)))
    return layers


def distinct_experts(logits: torch.Tensor) -> int:
    """How many distinct experts the routing of `logits` selects (read on the host, once)."""
    ids = torch.topk(torch.softmax(logits.float(), dim=-1), SHAPE["top_k"], dim=-1).indices
    return int(ids.unique().numel())


def bench_moe(num_tokens: int, impl: str, layers: list[dict]) -> dict:
    """{"us", "bytes", "flops", "experts"} per layer call of `impl` at `num_tokens` tokens
    (`layers` from make_layers)."""
    import triton.testing

    backend, graph = _load(impl)
    k = SHAPE["top_k"]

    def run_all() -> None:
        for layer in layers:
            backend(layer["x"], layer["w13"], layer["w2"], router_logits=layer["logits"], top_k=k)

    run_all()  # compile / autotune outside the graph
    torch.cuda.synchronize()
    if graph:
        ms = triton.testing.do_bench_cudagraph(run_all, rep=100)
    else:
        ms = triton.testing.do_bench(run_all, rep=100)
    h, i = layers[0]["w2"].shape[1:]  # the layers' own shape (a TP rank's: rank_shape)
    expert_bytes = 3 * i * h * layers[0]["w13"].element_size()
    experts = sum(distinct_experts(layer["logits"]) for layer in layers) / len(layers)
    # x in, the output, the router logits
    act_bytes = sum(2 * layer["x"].nbytes + layer["logits"].nbytes for layer in layers)
    return {
        "us": ms * 1e3 / len(layers),
        "bytes": experts * expert_bytes + act_bytes / len(layers),
        "flops": 2.0 * num_tokens * k * 3 * i * h,
        "experts": experts,
    }
