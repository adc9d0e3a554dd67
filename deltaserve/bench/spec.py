"""`deltaserve bench spec`: the speculative-decoding machinery at forced acceptance.

A random-weight target (default the Qwen3.5-9B preset) cannot be drafted for, so acceptance is
forced: the proposer ("bench_drafts" by default: random tokens, no cost; or any registered
method, e.g. a random-weight DFlash drafter, via --proposer / --proposer-options) drafts
k = --num-speculative-tokens tokens per row, and the acceptance is overridden so that each
verify step keeps exactly tau - 1 drafts and emits tau tokens (tau = 1 .. k + 1). The verify
step (1 + k tokens per row), the GDN rollback (whenever tau < k + 1) and the proposer run as
in real use; only the outcome of acceptance is forced (the text is meaningless).

For each batch B and tau: tok/s = B x tau x steps / time, against plain decode (no drafts) on
the same engine, and the time per step of the proposer and of the verify step (forward,
acceptance and rollback). Contexts are synthetic (`--context`, caches filled with random
values, a DFlash drafter's context K / V included) so nothing is prefilled. The "graphs" column
says how many timed target steps replayed a CUDA graph (verify steps with the taps a DFlash
drafter reads included) and, for a drafter with graphs, how many block forwards did. Output:
a markdown table, and `--json PATH`.

DFlash at the released 9B shape: `deltaserve bench spec --proposer dflash --proposer-options
'{"model": "random:qwen3.5-9b-dflash"}'` (the default target is the matching qwen3.5-9b).
MTP (the target's own head, random with the preset's weights): `deltaserve bench spec
--proposer mtp --num-speculative-tokens K --taus 1,..,K+1`; the head's chain runs eagerly, its
K / V over the synthetic context are the filled random values.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from deltaserve.bench.throughput import _int_list
from deltaserve.cli import add_backend_args, backend_kwargs

DEFAULT_TAUS = (1, 2, 4, 8, 16)
GPU_DEFAULT_MODEL = "qwen3.5-9b"
# on CPU the 9B's float32 weights alone take 36 GB: the tiny preset, unless one is named
CPU_DEFAULT_MODEL = "tiny-qwen3.5"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("spec", help="speculative decoding at forced acceptance (tau tokens/step)")
    p.add_argument(
        "--random-model",
        default=None,
        help=f"random-weight preset (target; default {GPU_DEFAULT_MODEL} on a GPU, "
        f"{CPU_DEFAULT_MODEL} on CPU)",
    )
    p.add_argument("--batches", type=_int_list, default=[1, 4, 16], metavar="B,..")
    p.add_argument("--taus", type=_int_list, default=list(DEFAULT_TAUS), metavar="T,..")
    p.add_argument("--num-speculative-tokens", type=int, default=15, metavar="K")
    p.add_argument("--context", type=int, default=512, metavar="L")
    p.add_argument("--steps", type=int, default=20, help="timed steps per row")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--proposer", default="bench_drafts", help="a registered proposer method")
    p.add_argument("--proposer-options", default="{}", metavar="JSON")
    p.add_argument("--device", default="auto")
    add_backend_args(p)  # the backend flags and --state-dtype of the engine commands
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    p.set_defaults(handler=run)


def _register_bench_proposer() -> None:
    from deltaserve.spec.proposer import Draft, Proposer
    from deltaserve.spec.registry import ProposerMethod, register_proposer

    class BenchDrafts(Proposer):
        """k random draft tokens per row (costs nothing; acceptance is forced)."""

        def propose(self, seqs, max_drafts):
            vocab = int(self.config.model.text_config.vocab_size)
            return [Draft([(seq.seq_id * 31 + i) % vocab for i in range(k)])
                    for seq, k in zip(seqs, max_drafts, strict=True)]  # fmt: skip

    register_proposer(ProposerMethod("bench_drafts", BenchDrafts))


class ForcedAcceptance:
    """Wraps the runner's `LogitsProcessor.sample`: every row with drafts keeps exactly
    `accepted` of them (or all it has), then emits the target's own token at that position."""

    def __init__(self, logits_processor) -> None:
        self.inner = logits_processor.sample
        self.accepted = 0
        logits_processor.sample = self

    def __call__(self, logits, use, banned, out) -> None:
        self.inner(logits, use, banned, out)
        for seq, rows in zip(use.seqs, use.num_rows, strict=True):
            if rows == 1:
                continue
            k = rows - 1
            a = min(self.accepted, k)
            drafts = seq.token_ids[len(seq.token_ids) - k :]
            sampled = out.sampled[seq.seq_id]
            bonus = sampled[-1] if len(sampled) > a else sampled[0]
            out.sampled[seq.seq_id] = [type(bonus)(t, 0.0, 0, []) for t in drafts[:a]] + [bonus]
            out.num_rejected[seq.seq_id] = k - a


def _graph_replays(engine) -> tuple[int, int]:
    """(target steps that replayed a decode graph, drafter block forwards that replayed one)
    so far."""
    graphs = engine.runner.graphs
    drafter = getattr(engine.spec.proposer, "graphs", None)
    return (
        sum(graphs.replays.values()) if graphs is not None else 0,
        sum(drafter.replays.values()) if drafter is not None else 0,
    )


def _time_steps(engine, seqs, steps: int, sync) -> tuple[float, int, float]:
    """(seconds, tokens emitted, proposer seconds) over `steps` engine steps."""
    spec = engine.spec
    proposer_s = 0.0
    inner = spec.proposer.propose

    def timed(seqs_, limits):
        nonlocal proposer_s
        sync()
        t = time.perf_counter()
        res = inner(seqs_, limits)
        sync()
        proposer_s += time.perf_counter() - t
        return res

    spec.proposer.propose = timed
    before = sum(s.num_output_tokens for s in seqs)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    seconds = time.perf_counter() - start
    spec.proposer.propose = inner
    if any(s.is_finished for s in seqs):
        raise RuntimeError("a sequence finished during the timed steps: raise --context room")
    return seconds, sum(s.num_output_tokens for s in seqs) - before, proposer_s


def run(args: argparse.Namespace) -> int:
    import torch

    from deltaserve.bench.memory import check_random_model_fits
    from deltaserve.bench.synthetic import (
        fill_cache_tensors,
        fill_caches,
        mark_context_computed,
    )
    from deltaserve.config import create_engine_config, resolve_device
    from deltaserve.engine.llm_engine import LLMEngine
    from deltaserve.sampling_params import SamplingParams

    if args.random_model is None:
        cuda = resolve_device(args.device).type == "cuda"
        args.random_model = GPU_DEFAULT_MODEL if cuda else CPU_DEFAULT_MODEL
        if not cuda:
            print(f"bench spec on CPU: --random-model {CPU_DEFAULT_MODEL}", file=sys.stderr)
    check_random_model_fits(args.random_model, args.dtype, args.device)
    _register_bench_proposer()
    k = args.num_speculative_tokens
    options = json.loads(args.proposer_options)
    max_batch = max(args.batches)
    room = (max(args.taus) + 1) * (args.steps + args.warmup_steps + 2) + k + 8
    config = create_engine_config(
        None,
        random_model=args.random_model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.context + room,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(8192, max_batch * (k + 1)),
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        speculative_config={"method": args.proposer, "num_speculative_tokens": k, **options},
        # timed rows compute every token and decode without taking prefix snapshots
        enable_prefix_caching=False,
        **backend_kwargs(args),
    )
    engine = LLMEngine(config)
    forced = ForcedAcceptance(engine.runner.logits)
    dev = engine.runner.device

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    fill_caches(engine, args.seed)
    proposer = engine.spec.proposer
    drafter = getattr(proposer, "drafter", None)  # a DFlash drafter's or MTP head's K / V
    if drafter is not None:
        fill_cache_tensors(drafter.caches, args.seed + 1)
    assume_context = getattr(proposer, "assume_context", None)
    gen = torch.Generator().manual_seed(args.seed)
    rows: list[dict[str, Any]] = []
    for batch in args.batches:
        for tau in [0, *args.taus]:  # 0: plain decode (no drafts)
            if tau > k + 1:
                continue
            params = SamplingParams(temperature=0, max_tokens=room, ignore_eos=True)
            rids = []
            for i in range(batch):
                rid = f"b{batch}t{tau}r{i}"
                prompt = torch.randint(3, engine.vocab_size - 3, (args.context,), generator=gen)
                engine.add_request(rid, {"prompt_token_ids": prompt.tolist()}, params)
                rids.append(rid)
            seqs = [engine.requests[r].seqs[0] for r in rids]
            mark_context_computed(engine, seqs)
            if assume_context is not None:  # the drafter "observed" the synthetic context
                for seq in seqs:
                    assume_context(seq)
            spec_k = engine.spec.k
            engine.spec.k = k if tau else 0  # plain decode: propose nothing
            forced.accepted = max(tau - 1, 0)
            for _ in range(args.warmup_steps + 1):
                engine.step()
            replays = _graph_replays(engine)
            seconds, tokens, proposer_s = _time_steps(engine, seqs, args.steps, sync)
            target_graphs, drafter_graphs = (
                b - a for a, b in zip(replays, _graph_replays(engine), strict=True)
            )
            engine.spec.k = spec_k
            engine.abort_request(rids)
            rows.append(
                {
                    "batch": batch,
                    "tau": tau or 1,
                    "speculative": bool(tau),
                    "tok_s": tokens / seconds,
                    "step_ms": 1e3 * seconds / args.steps,
                    "proposer_ms": 1e3 * proposer_s / args.steps,
                    "verify_ms": 1e3 * (seconds - proposer_s) / args.steps,
                    "tokens_per_step": tokens / args.steps / batch,
                    "graph_steps": target_graphs,
                    "drafter_graph_steps": drafter_graphs,
                }
            )
    base = {r["batch"]: r["tok_s"] for r in rows if not r["speculative"]}
    has_drafter_graphs = getattr(proposer, "graphs", None) is not None
    graphs = engine.runner.graphs
    print(
        "graphs: timed target steps that replayed a CUDA graph"
        + (", then drafter block forwards that did" if has_drafter_graphs else "")
        + f", of {args.steps} steps"
        + (" (emulated: eager)" if graphs is not None and graphs.emulate else "")
    )
    print("| B | tau | tok/s | x plain | step ms | proposer ms | verify ms | graphs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        kind = r["tau"] if r["speculative"] else "plain"
        r["speedup"] = r["tok_s"] / base[r["batch"]]
        used = f"{r['graph_steps']}"
        if has_drafter_graphs and r["speculative"]:
            used += f", {r['drafter_graph_steps']}"
        print(
            f"| {r['batch']} | {kind} | {r['tok_s']:.1f} | {r['speedup']:.2f} | "
            f"{r['step_ms']:.2f} | {r['proposer_ms']:.2f} | {r['verify_ms']:.2f} | {used} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"k": k, "model": args.random_model, "rows": rows}, f, indent=1)
    return 0
