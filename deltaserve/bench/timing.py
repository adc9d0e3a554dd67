"""Timing one throughput row: prompts, a prefill timed end to end, and a run of pure decode
steps of B sequences (checked: every sequence gains exactly one token per step), with the
context either prefilled or synthetic (bench/synthetic.py)."""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

_request_ids = itertools.count()


def decode_plan(batch: int, length: int, args, budget: int) -> tuple[bool, int, int]:
    """(synthetic context?, most untimed steps before the timed ones, max_tokens per sequence).

    A real prefill of `batch` prompts of `length` takes at most about B x L / (budget - B)
    steps (decodes of the sequences already prefilled share the budget); the first sequences
    decode meanwhile, so max_tokens leaves room for them never to finish before the timed steps
    end."""
    synthetic = args.skip_prefill_context and length >= 2
    prefill_steps = 1 if synthetic else -(-batch * length // max(budget - batch, 1)) + 2
    untimed = prefill_steps + args.warmup_steps + 1
    routing = getattr(args, "routing_steps", 0)  # recorded after the timed steps (MoE)
    return synthetic, untimed, untimed + args.decode_steps + routing + 1


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompt(gen, length: int, vocab: int) -> list[int]:
    import torch

    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def _add(engine, ids: list[int], max_tokens: int) -> str:
    from deltaserve.sampling_params import SamplingParams

    rid = f"bench-{next(_request_ids)}"
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    engine.add_request(rid, {"prompt_token_ids": ids}, params)
    return rid


def time_prefill(engine, length: int, gen) -> float:
    """Seconds to prefill one fresh prompt of `length` tokens and sample its first token."""
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine still holds requests; a prefill would not run alone")
    ids = _prompt(gen, length, engine.vocab_size)
    sync(engine.runner.device)
    start = time.perf_counter()
    _add(engine, ids, max_tokens=1)
    while engine.has_unfinished_requests():
        engine.step()
    sync(engine.runner.device)
    return time.perf_counter() - start


def capacity_reason(engine, batch: int, total_len: int) -> str | None:
    """Why `batch` sequences of `total_len` tokens cannot all run at once, or None."""
    sched = engine.scheduler
    if batch > sched.max_running:
        return f"batch {batch} > {sched.max_running} sequences the engine runs at once"
    bm = sched.block_manager
    if bm is not None:
        need = batch * -(-total_len // bm.block_size)
        if need > bm.num_free_blocks:
            return f"KV needs {need} blocks of {bm.block_size} tokens; the cache has {bm.capacity}"
    pool = sched.state_pool
    if pool is not None and batch > pool.num_free:
        return f"needs {batch} recurrent-state slots; the pool has {pool.capacity}"
    return None


def _is_decoding(seq) -> bool:
    return not seq.is_finished and seq.num_computed_tokens == seq.num_tokens - 1


def time_decode(
    engine, batch: int, length: int, args, gen, budget: int, routing_steps: int = 0
) -> dict[str, Any]:
    """Prefill (or synthesise) `batch` contexts of `length`, warm up, time `decode_steps` pure
    decode steps. Returns seconds, mean context of the timed steps, per-step times; with
    `routing_steps`, also "distinct_experts": per MoE layer, the mean distinct experts of that
    many untimed decode steps of the same sequences run right after the timed ones
    (deltaserve.bench.routing)."""
    from deltaserve.bench.synthetic import fill_caches, mark_context_computed

    synthetic, untimed, max_tokens = decode_plan(batch, length, args, budget)
    rids = [_add(engine, _prompt(gen, length, engine.vocab_size), max_tokens) for _ in range(batch)]
    seqs = [engine.requests[r].seqs[0] for r in rids]
    try:
        if synthetic:
            fill_caches(engine, args.seed)
            mark_context_computed(engine, seqs)
        steps = 0
        while (
            not all(_is_decoding(s) for s in seqs)
            or min(s.num_output_tokens for s in seqs) < 1 + args.warmup_steps
        ):
            if steps >= untimed or any(s.is_finished for s in seqs):
                raise RuntimeError(f"decode B={batch} L={length}: sequences never all decoded")
            engine.step()
            steps += 1
        sched = engine.scheduler
        if sched.waiting or len(sched.running) != batch:
            raise RuntimeError(
                "other sequences share the engine; the timed steps would not be pure"
            )
        before = [s.num_output_tokens for s in seqs]
        computed = [s.num_computed_tokens for s in seqs]
        step_s = []
        sync(engine.runner.device)
        start = time.perf_counter()
        for _ in range(args.decode_steps):
            t = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t)
        sync(engine.runner.device)
        seconds = time.perf_counter() - start
        gained = {s.num_output_tokens - b for s, b in zip(seqs, before)}
        if gained != {args.decode_steps}:
            raise RuntimeError(
                f"decode B={batch} L={length}: sequences gained {sorted(gained)} tokens in "
                f"{args.decode_steps} steps; the timed steps were not all pure decode steps"
            )
        distinct = None
        if routing_steps:
            from deltaserve.bench.routing import record_decode_routing

            distinct = record_decode_routing(engine, seqs, routing_steps)
    finally:
        engine.abort_request(rids)
    # step k reads the context plus its own new token: num_computed + k + 1 keys
    context = statistics.fmean(computed) + (args.decode_steps - 1) / 2 + 1
    return {
        "seconds": seconds,
        "context_mean": context,
        "step_s": step_s,
        "synthetic": synthetic,
        "distinct_experts": distinct,
    }


# ---- report ------------------------------------------------------------------------------------
