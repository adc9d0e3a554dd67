"""Time the drafter's block forward (eager and CUDA graphs) and context insertion, with a random
drafter of a released shape and a stand-in target (random embedding and lm_head of the
target's shape): the drafter's share of a speculative step.

    python -m deltaserve.spec.dflash.bench --preset qwen3.5-9b-dflash --batch 1 4 16 \\
        --drafts 15 7 --context 1024

Prints one line per (batch, k): ms per block forward eager and in a graph, and ms to insert the
context of 1 + k accepted positions per row.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch
from torch import nn

from deltaserve.forward_context import Kernels
from deltaserve.ops.fused import load_fused_ops
from deltaserve.spec.dflash.config import parse_dflash_config
from deltaserve.spec.dflash.drafter import DFlashDrafter, build_drafter
from deltaserve.spec.dflash.graphs import DrafterGraphs
from deltaserve.spec.dflash.presets import drafter_preset_config

BLOCK_SIZE = 16  # KV block size


class RandomTargetHead(nn.Module):
    """A target's embedding and lm_head (random), its hidden size and layer count."""

    def __init__(self, hidden: int, vocab: int, num_layers: int, device, dtype) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=hidden)
        self.vocab_size = vocab
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Identity() for _ in range(num_layers))
        self.model.embed_tokens = nn.Embedding(vocab, hidden, device=device, dtype=dtype)
        nn.init.normal_(self.model.embed_tokens.weight, std=hidden**-0.5)
        self.head = nn.Parameter(torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.02)
        self.requires_grad_(False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.head.T).float()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, iters: int) -> float:
    """Mean wall ms of fn() over `iters` runs after 2 warm-up runs."""
    for _ in range(2):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) * 1e3 / iters


def setup_rows(drafter: DFlashDrafter, batch: int, context: int, device) -> tuple:
    """Caches for `batch` rows of `context` positions (filled with random context) and the
    (last tokens, context lengths, block tables) of one step."""
    blocks_per_row = (context + BLOCK_SIZE) // BLOCK_SIZE + 1
    num_blocks = batch * blocks_per_row + 1
    dtype = drafter.model.fc.weight.dtype
    drafter.caches = [
        {
            n: torch.zeros(sh, dtype=dt, device=device)
            for n, (sh, dt) in s.tensors(num_blocks, BLOCK_SIZE, dtype, torch.float32).items()
        }
        for s in drafter.layer_specs()
    ]
    tables = torch.arange(1, num_blocks, device=device, dtype=torch.int32)
    tables = tables.reshape(batch, blocks_per_row)
    cfg = drafter.config
    taps = torch.randn(context, cfg.num_taps, cfg.hidden_size, device=device, dtype=dtype)
    for r in range(batch):
        slots = tables[r].long()[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=device)
        drafter.insert_context(
            taps, torch.arange(context, device=device), slots.reshape(-1)[:context]
        )
    last = torch.randint(0, cfg.mask_token_id, (batch,), device=device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return last, lens, tables


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3.5-9b-dflash")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--drafts", type=int, nargs="+", default=[15])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-graphs", action="store_true")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = parse_dflash_config(drafter_preset_config(args.preset), args.preset)
    target = RandomTargetHead(
        cfg.hidden_size,
        cfg.vocab_size or cfg.mask_token_id + 1,
        cfg.num_target_layers or max(cfg.target_layer_ids) + 1,
        device,
        dtype,
    )
    fused = load_fused_ops("triton" if device.type == "cuda" else "torch")
    drafter = build_drafter(cfg, target, dtype, device, Kernels(fused=fused), random_seed=0)
    print(f"drafter {args.preset}: context {args.context}, {dtype}, {device}")
    with torch.inference_mode():
        for batch in args.batch:
            rows = setup_rows(drafter, batch, args.context, device)
            for k in args.drafts:
                print(bench_one(drafter, rows, k, args.iters, graphs=not args.no_graphs))


def bench_one(drafter: DFlashDrafter, rows: tuple, k: int, iters: int, graphs: bool) -> str:
    """One result line: block forward eager / graph ms and context insertion ms."""
    last, lens, tables = rows
    batch, device = last.shape[0], last.device
    cfg = drafter.config
    eager = time_ms(lambda: drafter.draft_logits(last, lens, tables, k).argmax(-1), device, iters)
    graph = float("nan")
    if device.type == "cuda" and graphs:
        g = DrafterGraphs(drafter, batch, k, tables.shape[1])
        g.capture()
        graph = time_ms(lambda: g.replay(last, lens, tables), device, iters)
    n = (1 + k) * batch
    dtype = drafter.model.fc.weight.dtype
    taps = torch.randn(n, cfg.num_taps, cfg.hidden_size, device=device, dtype=dtype)
    pos = torch.arange(n, device=device)
    insert = time_ms(lambda: drafter.insert_context(taps, pos, pos + BLOCK_SIZE), device, iters)
    return (
        f"batch {batch:3d} k {k:2d}: block forward {eager:7.3f} ms eager, {graph:7.3f} ms "
        f"graph; context insert ({n} positions) {insert:7.3f} ms"
    )


if __name__ == "__main__":
    main()
