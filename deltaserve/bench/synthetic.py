"""Synthetic decode contexts for `deltaserve bench throughput --skip-prefill-context`.

Timing decode at batch 256 and context 8192 would first need a 2M-token prefill. Instead, the
sequences' prompts are marked computed without running the model: each gets the KV blocks and
the state slot a real prefill would have given it, and `num_computed_tokens` is set to all but
its last prompt token, so the engine's next step computes that token and samples, as a decode
step over a full-length context. The cache tensors are filled once with small random values, so
no kernel reads zeros or NaN. Decode cost does not depend on what the cache holds, only on how
much of it is read.

NOTE: sequences are admitted through `Scheduler.admit_computed`; the only engine state touched
from outside is the runner's cache tensors, written in place, for benchmarks only.
"""

from __future__ import annotations

import weakref

import torch

from deltaserve.engine.sequence import Sequence

KV_STD = 0.5  # cached keys / values (post-norm, post-rotary keys are O(1) per channel)
CONV_STD = 0.5  # conv state: the last inputs of the conv1d
SSM_STD = 0.02  # recurrent state [HV, V, K]

_filled: weakref.WeakSet = weakref.WeakSet()  # model runners whose caches are filled


def fill_caches(engine, seed: int = 0) -> None:
    """Fill every KV-cache and state-pool tensor of `engine` with small random values, once
    (later calls do nothing)."""
    runner = engine.runner
    if runner in _filled:
        return
    caches = getattr(runner, "caches", None)
    if caches is None:
        raise RuntimeError("the model runner has no `caches`: synthetic contexts need them")
    fill_cache_tensors(caches, seed)
    _filled.add(runner)


def fill_cache_tensors(caches: list[dict[str, torch.Tensor]], seed: int = 0) -> None:
    """Fill the K / V and state tensors of `caches` (one dict per layer) with small random
    values (a drafter's caches too)."""
    stds = {"k_cache": KV_STD, "v_cache": KV_STD, "conv_state": CONV_STD, "ssm_state": SSM_STD}
    with torch.no_grad():
        for i, cache in enumerate(caches):
            for field, std in stds.items():
                t = cache.get(field)
                if t is None:
                    continue
                gen = torch.Generator(device=t.device).manual_seed(seed * 7919 + 4 * i + len(field))
                t.normal_(0.0, std, generator=gen)


def mark_context_computed(engine, seqs: list[Sequence]) -> None:
    """Admit waiting `seqs` as running with all but their last prompt token computed.

    Each gets KV blocks for its prompt and a state slot, as a finished prefill would. Raises
    RuntimeError (leaving the caller to abort the requests) when the engine cannot hold them."""
    sched = engine.scheduler
    for seq in seqs:
        if seq.num_tokens < 2:
            raise RuntimeError("synthetic context needs prompts of at least 2 tokens")
        sched.admit_computed(seq, seq.num_tokens - 1)
