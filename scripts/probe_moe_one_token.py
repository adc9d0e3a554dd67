"""One MoE layer at one token on the GPU: the one-token kernels (ops/moe/triton_decode_one_token.py)
against the decode path's tile kernels, per layer shape (the 35B-A3B's, V2-Lite's).

python scripts/probe_moe_one_token.py [--json PATH]
For each shape and kernel choice: the op's time per layer (4 layers' weights cycled inside one
CUDA graph, so no layer finds its experts in L2; routing from peaky router logits, a shared
expert given itself as the MoE blocks pass it), the bytes it must read (the selected experts'
and the shared expert's weights) as GB/s, and each kernel's mean time from torch.profiler over
graph replays (kernels overlap under programmatic dependent launch: run with DELTASERVE_PDL=0
for per-kernel times), plus the tuner's chosen configurations.
"""

from __future__ import annotations

import argparse
import json

import torch

# name -> (E, top_k, inter, shared_inter, gated shared expert, routed scaling factor)
SHAPES = {
    "35b-a3b": (256, 8, 512, 512, True, None),
    "v2-lite": (64, 6, 1408, 2816, False, 16.0),
}
HIDDEN, LAYERS = 2048, 4


def make_layers(shape: tuple, seed: int = 0) -> list[dict]:
    e, k, inter, shared, gated, scale = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*size: int, scale_: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, device="cuda", generator=gen) * scale_).to(torch.bfloat16)

    layers = []
    for _ in range(LAYERS):
        bias = torch.randn(e, device="cuda", generator=gen) * 1.5
        wide = randn(1, 2 * shared + 4, scale_=2.0)
        layer = dict(
            x=randn(1, HIDDEN),
            w13=randn(e, 2 * inter, HIDDEN, scale_=HIDDEN**-0.5),
            w2=randn(e, HIDDEN, inter, scale_=inter**-0.5),
            router_logits=torch.randn(1, e, device="cuda", generator=gen) + bias,
            shared_gate_up=wide[:, : 2 * shared],
            shared_down=randn(HIDDEN, shared, scale_=shared**-0.5),
        )
        if gated:
            layer["shared_gate"] = wide[:, 2 * shared + 1 : 2 * shared + 2]
        layers.append(layer)
    return layers


def measure(name: str, choice: str) -> dict:
    import triton.testing

    from deltaserve.ops.moe.triton_backend import TritonMoE

    e, k, inter, shared, gated, scale = SHAPES[name]
    layers = make_layers(SHAPES[name])
    moe = TritonMoE(one_token=choice)

    def run_all() -> None:
        for layer in layers:
            moe(**layer, top_k=k, routed_scaling_factor=scale)

    run_all()  # compile and tune outside the graph
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(run_all, rep=200)
    us = ms * 1e3 / LAYERS
    weight_bytes = 2 * (k * 3 * inter * HIDDEN + 3 * shared * HIDDEN)  # bf16
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
    kernels = {
        ev.key: round(ev.device_time_total / ev.count, 2)
        for ev in prof.key_averages()
        if ev.device_time_total > 0 and "kernel" in ev.key
    }
    return dict(
        shape=name, choice=choice, us=round(us, 2), gb_s=round(weight_bytes / us / 1e3, 1),
        weight_mb=round(weight_bytes / 1e6, 2), kernels=kernels,
    )  # fmt: skip


def chosen_configs() -> dict:
    """The tuners' choices so far, per kernel and tuning key."""
    from deltaserve.ops.moe import triton_decode_one_token as one

    out = {}
    for kname in ("_one_token_gate_up_kernel", "_one_token_down_kernel"):
        tuner = getattr(one, kname)
        out[kname] = {str(key): str(cfg) for key, cfg in getattr(tuner, "cache", {}).items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [measure(name, choice) for name in SHAPES for choice in ("gemv", "tile")]
    for r in rows:
        print(f"{r['shape']} {r['choice']}: {r['us']} us/layer, {r['gb_s']} GB/s over "
              f"{r['weight_mb']} MB; kernels (us): {r['kernels']}")  # fmt: skip
    configs = chosen_configs()
    print(json.dumps(configs, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, configs=configs), f, indent=1)


if __name__ == "__main__":
    main()
