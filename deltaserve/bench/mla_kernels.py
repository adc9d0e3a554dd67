"""`deltaserve bench kernels --only mla`: absorbed MLA decode against the copy ceiling.

One layer's decode call (writer excluded) at DeepSeek-V2 shapes (R = 512, P = 64, H = 16 for
V2-Lite and 128 for V2, bf16, page 16, every sequence's blocks scattered), per backend: ours in
Triton (its default configuration and a few alternatives, named in the `config` column) and
FlashInfer's MLA wrapper where installed; the torch reference only at small sizes. Bytes are
the latents read, B * context * (R + P) * 2; timed in a CUDA graph (triton.testing).
"""

from __future__ import annotations

from typing import Any

import torch

R, P, PAGE = 512, 64, 16
MLA_HEADS = (16, 128)
MLA_POINTS = [(64, 4096), (16, 4096), (1, 4096), (64, 512), (1, 512)]
MLA_POINTS_QUICK = [(64, 4096)]
# alternative Triton configurations timed beside the default (the default's row has none;
# triton_decode.decode_config: PROGRAMS_PER_SM sets the split count, None drops a key)
TRITON_VARIANTS = (
    # the whole-width tile at two programs an SM: the default before the column chunks (at
    # H 128 the 64-row whole tile, which spills ~500 bytes)
    {"R_CHUNKS": 1, "num_stages": 2, "maxnreg": None, "PROGRAMS_PER_SM": 2},
    # around the defaults (H 16: 8 column chunks over 64 latents, three stages, two programs
    # an SM; H 128: 8 chunks, no register cap, one program an SM), one wave each
    {"num_stages": 2},
    {"PROGRAMS_PER_SM": 4},
    {"R_CHUNKS": 8, "maxnreg": None, "PROGRAMS_PER_SM": 2},  # H 128 at two an SM
    {"NUM_SPLITS": 16},
    # H 16's previous default: 32 latents a tile, three stages, 128 registers, four programs
    {"BLOCK_N": 32, "num_stages": 3, "maxnreg": 128, "PROGRAMS_PER_SM": 4},
)
TORCH_MAX_TOKENS = 16 * 4096  # B * context past which the reference is skipped (slow)


def make_mla_inputs(
    batch: int, context: int, heads: int, r: int = R, p: int = P, page: int = PAGE,
    dtype: torch.dtype = torch.bfloat16, device: str = "cuda", seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Random queries and a full paged latent cache, each sequence's blocks at random."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = -(-context // page)
    cache = torch.randn(batch * blocks, page, r + p, generator=gen, device=device).to(dtype)
    perm = torch.randperm(batch * blocks, generator=gen, device=device)
    return dict(
        q_lat=torch.randn(batch, heads, r, generator=gen, device=device).to(dtype),
        q_pe=torch.randn(batch, heads, p, generator=gen, device=device).to(dtype),
        cache=cache,
        block_tables=perm.view(batch, blocks).to(torch.int32),  # [B, blocks]
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
    )


def mla_step(impl: str, x: dict[str, Any], scale: float, config: dict | None = None):
    """The decode call of `impl` ("triton", "flashinfer", "torch") over inputs `x`, as a
    no-argument function (FlashInfer planned here, outside the timing)."""
    from deltaserve.ops.mla.triton_decode import mla_decode

    out = torch.empty_like(x["q_lat"])
    if impl == "triton":
        args = (x["q_lat"], x["q_pe"], x["cache"], x["seq_lens"], x["block_tables"], scale)
        return lambda: mla_decode(*args, out=out, config=config)
    batch = x["seq_lens"].shape[0]
    context = int(x["seq_lens"][0])
    page = x["cache"].shape[1]
    blocks = x["block_tables"].shape[1]
    r = x["q_lat"].shape[-1]
    if impl == "torch":
        from deltaserve.ops.mla.reference import paged_mla

        qsl = list(range(batch + 1))
        return lambda: paged_mla(
            x["q_lat"], x["q_pe"], x["cache"], qsl, [context] * batch, x["block_tables"], scale
        )
    if impl == "flashinfer":
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        dev = x["cache"].device
        wrapper = BatchMLAPagedAttentionWrapper(
            torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
        )
        ar = torch.arange(batch + 1, dtype=torch.int32)
        wrapper.plan(
            ar, ar * blocks, x["block_tables"].reshape(-1), torch.full((batch,), context,
            dtype=torch.int32), x["q_lat"].shape[1], r, x["q_pe"].shape[-1], page, True, scale,
            x["q_lat"].dtype, x["cache"].dtype,
        )  # fmt: skip
        ckv, kpe = x["cache"][..., :r], x["cache"][..., r:]
        return lambda: wrapper.run(x["q_lat"], x["q_pe"], ckv, kpe, out=out)
    raise ValueError(f"unknown MLA impl {impl!r}")


def latent_bytes(batch: int, context: int, r: int = R, p: int = P, elem: int = 2) -> float:
    return float(batch * context * (r + p) * elem)


def bench_mla_rows(
    points: list[tuple[int, int]],
    errors: list[str],
    variants: list[dict] | None = None,
    heads_list: list[int] | None = None,
) -> list[dict]:
    """Rows of every implementation available, per head count and (batch, context): the
    Triton default, then each of `variants` (decode_config overrides; default
    TRITON_VARIANTS), FlashInfer, the torch reference where small. `heads_list` defaults to
    MLA_HEADS."""
    import triton.testing

    from deltaserve.backend_checks import package_installed
    from deltaserve.bench.kernels import kernel_row

    has_fi = package_installed("flashinfer")
    if not has_fi:
        errors.append("mla: flashinfer not installed, its rows are skipped")
    rows = []
    scale = (128 + 64) ** -0.5
    variants = TRITON_VARIANTS if variants is None else variants
    for heads in heads_list or MLA_HEADS:
        for batch, context in points:
            shape = dict(batch=batch, context=context, heads=heads)
            x = make_mla_inputs(batch, context, heads)
            runs = [("triton", None)] + [("triton", dict(v)) for v in variants]
            if has_fi:
                runs.append(("flashinfer", None))
            if batch * context <= TORCH_MAX_TOKENS:
                runs.append(("torch", None))
            for impl, config in runs:
                label = "" if config is None else " ".join(f"{k}={v}" for k, v in config.items())
                try:
                    step = mla_step(impl, x, scale, config)
                    step()  # compile / warm up
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench_cudagraph(step, rep=100)
                    name = impl if config is None else "triton-variant"
                    row = kernel_row("mla", name, latent_bytes(batch, context), ms * 1e3, **shape)
                    rows.append({**row, "config": label})
                except Exception as e:  # noqa: BLE001 - report and keep going
                    errors.append(f"mla {impl} {label} {shape}: {type(e).__name__}: {e}")
                    rows.append(
                        kernel_row(
                            "mla", impl, None, None, **shape, config=label, error=str(e)[:200]
                        )
                    )
                torch.cuda.empty_cache()
            del x
    return rows


def format_mla_table(rows: list[dict]) -> list[str]:
    from deltaserve.bench.kernels import _family_table

    return _family_table(
        rows,
        "Absorbed MLA decode, R 512 + P 64, bf16, page 16 (bytes: the latents read, "
        "B x context x 576 x 2)",
        [
            ("H", "---:", lambda r: r["heads"]),
            ("batch", "---:", lambda r: r["batch"]),
            ("context", "---:", lambda r: r["context"]),
        ],
        [("config", "---", lambda r: r.get("config", ""))],
    )
