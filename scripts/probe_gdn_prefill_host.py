"""Host cost of one GDN prefill layer call at chat-turn shapes (GPU machine).

python scripts/probe_gdn_prefill_host.py [--seqs 16] [--tokens 171] [--layers 24]

Calls the chosen GDN prefill backend as one step's GDN layers would (9B shapes: HK=16, HV=32,
K=V=128; `--seqs` sequences of `--tokens` new tokens each with an initial state), and reports
per call: host wall time with the device left to run behind (the host's own cost), device time
(CUDA events), and whether any device synchronisation happens inside (torch's sync debug mode).
Then the top functions by cumulative host time under cProfile. `--backend fla` is the engine's
`fla` backend: fla for every row unless DELTASERVE_GDN_SHORT_ROW_TOKENS sends short rows to the
one-launch Triton kernel (`deltaserve bench kernels --only gdn_prefill` times both side by side).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
import warnings

import torch

from deltaserve.ops.gdn.prefill_bench import make_meta


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=171)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--backend", default="fla", choices=["fla", "torch"])
    args = ap.parse_args()
    dev = torch.device("cuda")
    hk, hv, dk, dv = 16, 32, 128, 128
    total = args.seqs * args.tokens
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, generator=gen, dtype=torch.bfloat16)

    # q, k, v as strided views of one projection output, as the layer hands them over
    qkv = rnd(total, 2 * hk * dk + hv * dv)
    q = qkv[:, : hk * dk].view(total, hk, dk)
    k = qkv[:, hk * dk : 2 * hk * dk].view(total, hk, dk)
    v = qkv[:, 2 * hk * dk :].view(total, hv, dv)
    a, b = rnd(total, hv), rnd(total, hv)
    A_log = torch.zeros(hv, device=dev)
    dt_bias = torch.zeros(hv, device=dev)
    state = torch.zeros(args.seqs + 1, hv, dv, dk, device=dev)
    meta = make_meta(args.seqs, args.tokens, dev)
    if args.backend == "fla":
        from deltaserve.ops.gdn.fla_prefill import FlaGDNPrefill

        backend = FlaGDNPrefill()
    else:
        from deltaserve.ops.gdn.reference import TorchGDNPrefill

        backend = TorchGDNPrefill()

    def step() -> None:
        for _ in range(args.layers):
            backend.forward(q, k, v, a, b, A_log, dt_bias, state, meta)

    for _ in range(3):  # compile, autotune
        step()
    torch.cuda.synchronize()

    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = [str(w.message).splitlines()[0] for w in caught]
    print(f"device syncs inside one step of {args.layers} calls: {len(syncs)}")
    for line in sorted(set(syncs))[:10]:
        print("   ", line)

    reps = 10
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    host = (time.perf_counter() - t0) / (reps * args.layers)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / (reps * args.layers)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        step()
    end.record()
    torch.cuda.synchronize()
    gpu = start.elapsed_time(end) / 1e3 / (reps * args.layers)
    print(
        f"{args.backend}: {args.seqs} seqs x {args.tokens} tokens, per layer call: host "
        f"{host * 1e6:.0f} us, wall {wall * 1e6:.0f} us, device {gpu * 1e6:.0f} us"
    )

    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
    print(buf.getvalue()[-6000:])


if __name__ == "__main__":
    main()
