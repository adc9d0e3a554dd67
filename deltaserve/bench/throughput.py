"""`deltaserve bench throughput`: engine prefill and decode throughput against their floors.

Prefill: for each prompt length P, one prompt of P random token ids through the engine
(max_tokens=1), after one warm-up of the same shape; the median of `--repeats` runs.
Decode: for each batch B and context L, B prompts of L random ids are prefilled (or given a
synthetic context, `--skip-prefill-context`), decode `--warmup-steps` tokens each, then exactly
`--decode-steps` engine steps are timed; each must be a pure decode step of all B sequences
(checked: every sequence gains exactly one token per step). tok/s = B x steps / time.
Floors: deltaserve.bench.floors, against the copy and matmul ceilings measured on the CUDA device
before the engine starts (or given with --copy-bw / --matmul-flops). A MoE model's decode floor
counts the distinct experts each layer selects, recorded over `--routing-steps` untimed decode
steps of the same sequences right after the timed ones (deltaserve.bench.routing); its prefill
floor counts the active parameters. Output: a markdown table, and `--json PATH`.

On CPU (`--device cpu`, or auto without a GPU) the defaults fit a CPU: without --model or
--random-model the bench runs the demo model, rows not given are small ones, and the floors are
against this CPU's own measured copy and matmul rates, not a GPU's. A random preset is checked
against the free memory before its weights are allocated.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from deltaserve.bench.memory import check_random_model_fits
from deltaserve.bench.timing import (
    capacity_reason,
    decode_plan,
    time_decode,
    time_prefill,
)
from deltaserve.cli import BACKEND_FLAGS, add_async_arg, add_backend_args, add_model_arg

DEFAULT_RANDOM_MODEL = "qwen3.5-9b"
# (flag, metavar, GPU default) of the row lists; CPU_ROWS: their defaults on CPU (seconds each)
ROW_FLAGS = (
    ("--prefill-lens", "P,..", (512, 2048, 8192)),
    ("--decode-batches", "B,..", (1, 16, 64, 256)),
    ("--contexts", "L,..", (512, 2048, 8192)),
)
CPU_ROWS = {"--prefill-lens": (64, 256), "--decode-batches": (1, 8), "--contexts": (64, 256)}


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return values


def add_parser(subcommands: Any) -> None:
    """Register `throughput` on the `deltaserve bench` sub-commands."""
    p = subcommands.add_parser(
        "throughput",
        help="engine prefill / decode throughput against the bandwidth and FLOP floors",
        description=__doc__.split("\n\n")[1],
    )
    add_model_arg(p)  # positional MODEL or --model DIR (not with --random-model)
    p.add_argument(
        "--random-model",
        default=None,
        metavar="NAME",
        help=f"preset shape with random weights (default on a GPU: {DEFAULT_RANDOM_MODEL}; on "
        "CPU the demo model)",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    for flag, metavar, gpu_rows in ROW_FLAGS:
        p.add_argument(
            flag,
            type=_int_list,
            default=None,
            metavar=metavar,
            help=f"default {_csv(gpu_rows)} on a GPU, {_csv(CPU_ROWS[flag])} on CPU",
        )
    p.add_argument("--decode-steps", type=int, default=64, metavar="N", help="timed steps")
    p.add_argument("--warmup-steps", type=int, default=8, metavar="N", help="untimed decodes")
    p.add_argument("--repeats", type=int, default=3, metavar="N", help="prefill runs (median)")
    p.add_argument(
        "--routing-steps",
        type=int,
        default=8,
        metavar="N",
        help="MoE models: untimed decode steps after the timed ones whose routing (distinct "
        "experts per layer) sets the decode floor",
    )
    p.add_argument(
        "--skip-prefill-context",
        action="store_true",
        help="decode rows: mark each context computed without running the prefill (the caches "
        "hold random values); such rows are labelled 'synthetic context'",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    add_async_arg(p)
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, metavar="N", help="GPUs (one process each)"
    )
    add_backend_args(p)  # the backend flags and --state-dtype of the engine commands
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--copy-bw",
        type=float,
        default=None,
        metavar="B/S",
        help="copy ceiling (bytes read + written per second); default: measured on the CUDA "
        "device, or on the CPU",
    )
    p.add_argument(
        "--matmul-flops",
        type=float,
        default=None,
        metavar="FLOP/S",
        help="matmul ceiling (bf16 on a GPU, the model dtype on CPU); default: measured on the "
        "CUDA device, or on the CPU",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    p.set_defaults(handler=handler)


# ---- engine ------------------------------------------------------------------------------------


def _build_llm(args: argparse.Namespace, max_model_len: int, max_num_seqs: int, budget: int):
    from deltaserve.config import create_engine_config
    from deltaserve.llm import LLM

    kwargs = dict(
        dtype=args.dtype,
        device=args.device,
        state_dtype=args.state_dtype,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        seed=args.seed,
        # NOTE: timed rows must compute every token (no hits) and decode without snapshots
        enable_prefix_caching=False,
    )
    for flag in BACKEND_FLAGS:
        kwargs[flag.replace("-", "_")] = getattr(args, flag.replace("-", "_"))
    if args.model is not None:
        return LLM(args.model, **kwargs), Path(args.model).name
    name = args.random_model or DEFAULT_RANDOM_MODEL
    if "random_model" not in inspect.signature(create_engine_config).parameters:
        raise ValueError("this engine cannot build random models yet: pass --model DIR")
    check_random_model_fits(name, args.dtype, args.device, args.tensor_parallel_size)
    return LLM(random_model=name, **kwargs), f"random:{name}"


def _cpu_defaults(args: argparse.Namespace, cuda: bool) -> None:
    """Fill the options left unset: the GPU's rows, or on CPU small rows and (without --model or
    --random-model) the demo model, saying so on stderr."""
    defaulted = []
    for flag, _, gpu_rows in ROW_FLAGS:
        dest = flag.removeprefix("--").replace("-", "_")
        if getattr(args, dest) is None:
            rows = gpu_rows if cuda else CPU_ROWS[flag]
            setattr(args, dest, list(rows))
            defaulted.append(f"{flag} {_csv(rows)}")
    if cuda:
        return
    if defaulted:
        _log("bench on CPU: small rows by default: " + "; ".join(defaulted))
    if args.model is None and args.random_model is None:
        from deltaserve.loader.demo import DEMO_NOTICE, ensure_demo_model

        _log(f"no --model on CPU: using the demo model ({DEMO_NOTICE})")
        args.model = str(ensure_demo_model())


def _row(kind: str, batch: int, length: int, tok_s: float, floor: float, **extra) -> dict:
    return {
        "kind": kind,
        "batch": batch,
        "length": length,
        "tok_s": tok_s,
        "floor_tok_s": floor,
        "pct_of_floor": 100.0 * tok_s / floor,
        "synthetic_context": False,
        **extra,
    }


def format_table(rows: list[dict]) -> str:
    """The markdown table: one row per measurement."""
    from deltaserve.bench.tp_comm import comm_note

    lines = [
        "| kind | B | prompt/context | tok/s | floor tok/s | % of floor | notes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        notes = ["synthetic context"] if r.get("synthetic_context") else []
        if r.get("distinct_experts") is not None:
            notes.append(
                f"{r['distinct_experts_mean']:.1f} distinct experts/layer, "
                f"{r['weight_bytes_streamed'] / 1e9:.2f} GB weights"
            )
        if comm_note(r):
            notes.append(comm_note(r))
        note = "; ".join(notes)
        lines.append(
            f"| {r['kind']} | {r['batch']} | {r['length']} | {r['tok_s']:,.1f} | "
            f"{r['floor_tok_s']:,.1f} | {r['pct_of_floor']:.1f}% | {note} |"
        )
    return "\n".join(lines)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _measure_prefill(engine, costs, ceilings, args, gen) -> list[dict]:
    from deltaserve.bench import floors

    rows = []
    for length in args.prefill_lens:
        time_prefill(engine, length, gen)  # warm-up, same shape
        seconds = statistics.median(time_prefill(engine, length, gen) for _ in range(args.repeats))
        dense, attention = floors.prefill_flops(costs, length)
        floor = length / ((dense + attention) / ceilings.matmul_flop_per_s)
        extra = dict(seconds=seconds, flops_params=dense, flops_attention=attention)
        rows.append(_row("prefill", 1, length, length / seconds, floor, **extra))
        _log(f"prefill P={length}: {length / seconds:,.1f} tok/s")
    return rows


def _measure_decode(
    engine, costs, ceilings, args, gen, budget: int
) -> tuple[list[dict], list[dict]]:
    from deltaserve.bench import floors

    rows, skipped = [], []
    max_model_len = engine.config.model.max_model_len
    for batch in args.decode_batches:
        for length in args.contexts:
            _, _, max_tokens = decode_plan(batch, length, args, budget)
            total = length + max_tokens
            reason = capacity_reason(engine, batch, total)
            if reason is None and total > max_model_len:
                reason = f"{total} tokens per sequence > max_model_len {max_model_len}"
            if reason is not None:
                skipped.append(dict(kind="decode", batch=batch, length=length, reason=reason))
                _log(f"skip decode B={batch} L={length}: {reason}")
                continue
            routing = args.routing_steps if costs.is_moe else 0
            res = time_decode(engine, batch, length, args, gen, budget, routing)
            tok_s = batch * args.decode_steps / res["seconds"]
            ctx = res["context_mean"]
            distinct = res["distinct_experts"]
            extra = dict(
                seconds=res["seconds"],
                steps=args.decode_steps,
                context_mean=ctx,
                step_bytes=floors.decode_step_bytes(costs, batch, ctx, distinct),
                step_s_median=statistics.median(res["step_s"]),
                synthetic_context=res["synthetic"],
            )
            if distinct is not None:
                extra.update(
                    routing_steps=routing,
                    distinct_experts=distinct,
                    distinct_experts_mean=statistics.fmean(distinct),
                    weight_bytes_streamed=floors.weight_bytes_streamed(costs, distinct),
                )
            floor = floors.decode_floor_tok_s(
                costs, batch, ctx, ceilings.copy_bytes_per_s, distinct
            )
            rows.append(_row("decode", batch, length, tok_s, floor, **extra))
            _log(f"decode B={batch} L={length}: {tok_s:,.1f} tok/s")
    return rows, skipped


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def handler(args: argparse.Namespace) -> int:
    """Build the engine once, measure every prefill and decode row, print and save them."""
    import torch

    from deltaserve.bench import floors
    from deltaserve.bench.provenance import provenance
    from deltaserve.bench.tp_comm import AllReduceCounter, add_comm_costs

    if args.decode_steps < 1 or args.warmup_steps < 0 or args.repeats < 1:
        raise ValueError("--decode-steps and --repeats must be >= 1, --warmup-steps >= 0")
    if args.routing_steps < 1:
        raise ValueError("--routing-steps must be >= 1")
    if args.model is not None and args.random_model is not None:
        raise ValueError("give a model (MODEL / --model) or --random-model, not both")
    from deltaserve.config import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    _cpu_defaults(args, cuda)
    budget = args.max_num_batched_tokens or max(args.prefill_lens + args.decode_batches)
    longest = max(
        length + decode_plan(batch, length, args, budget)[2]
        for batch in args.decode_batches
        for length in args.contexts
    )
    max_model_len = max(max(args.prefill_lens) + 1, longest)
    # NOTE: measured before the engine starts: the measurement has the GPU to itself, and its
    # buffers are freed before the cache planner looks at free memory. On CPU: this CPU's rates,
    # the matmul in the dtype the model will run in.
    cpu_dtype = None if cuda else resolve_dtype(args.dtype, None, device)
    ceilings = floors.resolve_ceilings(cuda, args.copy_bw, args.matmul_flops, cpu_dtype)
    _log(f"ceilings: {ceilings.describe()}")
    llm, model_name = _build_llm(args, max_model_len, max(args.decode_batches), budget)
    engine = llm.llm_engine
    runner, cfg = engine.runner, engine.config
    costs = floors.model_costs(runner.model, runner.specs, cfg.model.dtype, cfg.cache.state_dtype)
    gen = torch.Generator().manual_seed(args.seed)
    counter = AllReduceCounter(engine)  # TP: the all-reduces of the prefills' forwards
    rows = _measure_prefill(engine, costs, ceilings, args, gen)
    all_reduces_per_step = counter.per_forward()
    decode_rows, skipped = _measure_decode(engine, costs, ceilings, args, gen, budget)
    rows += decode_rows
    add_comm_costs(engine, rows, all_reduces_per_step, counter.at_norms_per_forward())

    header = [
        f"model {model_name} ({cfg.model.architecture}) on {runner.device}, "
        f"{_dtype_name(cfg.model.dtype)}, state {_dtype_name(cfg.cache.state_dtype)}, "
        f"enforce_eager={args.enforce_eager}, async_scheduling={cfg.async_scheduling}, "
        f"tensor parallel {cfg.tensor_parallel_size}"
        + (" (costs and floors are per rank: its shard)" if cfg.tensor_parallel_size > 1 else ""),
        f"{costs.num_params / 1e9:.3f} B parameters; {costs.streamed_weight_bytes / 1e9:.2f} GB "
        f"streamed per decode step; KV {costs.kv_bytes_per_token} B/token; recurrent state "
        f"{costs.state_bytes_per_seq / 1e6:.2f} MB/sequence",
        *(
            [
                f"MoE: {len(costs.expert_bytes)} MoE layers of {costs.num_experts[0]} experts, "
                f"top-{costs.top_k[0]}; {costs.active_params / 1e9:.3f} B active parameters; "
                f"{costs.dense_streamed_weight_bytes / 1e9:.2f} GB dense weights streamed per "
                f"decode step, plus {costs.expert_bytes[0] / 1e6:.2f} MB per selected expert"
            ]
            if costs.is_moe
            else []
        ),
        f"ceilings: {ceilings.describe()}",
        "backends: "
        + ", ".join(f"{op} {d.chosen.name}" for op, d in runner.backend_decisions.items())
        + f"; decode CUDA graphs: {'on' if runner.graphs is not None else 'off'}",
    ]
    notes = [
        f"prefill floor: (2 x {'active ' if costs.is_moe else ''}params x P + causal attention "
        f"FLOPs) / {ceilings.matmul_flop_per_s:.4g} FLOP/s",
        "decode floor: (weights streamed + KV read at the timed steps' mean context + state read "
        f"and written) / {ceilings.copy_bytes_per_s:.4g} B/s; floor tok/s = B / floor time",
    ]
    if costs.is_moe:
        notes.append(
            "MoE decode floor: the weights streamed are the dense weights plus, per MoE layer, "
            "the distinct experts the step's tokens selected (mean over "
            f"{args.routing_steps} untimed decode steps of the same sequences right after the "
            "timed ones, routed on the device)"
        )
    if cfg.tensor_parallel_size > 1:
        notes.append(
            "tensor parallel: floors are one rank's (its shard's bytes over one GPU's copy "
            "rate); all-reduce: the step's all-reduces of [B, hidden] (count from the "
            "forwards), timed on every rank together in one CUDA graph (the logits' "
            "all-gather not included), through the path the engine uses (NCCL alone: the "
            "same all-reduces without the one-shot kernel); control message: one step "
            "description sent over the gloo control channel (rank 0's host time)"
        )
    if not cuda:
        notes.append(
            "on CPU the floors divide by this CPU's rates (ceilings line), not a GPU's; a model "
            "whose weights fit in the CPU's caches can beat the copy floor (over 100%)"
        )
    if any(r.get("synthetic_context") for r in rows):
        notes.append(
            "synthetic context: the prompt was marked computed without a prefill; the caches "
            "hold random values (a decode step's cost depends only on how much it reads)"
        )
    notes += [f"skipped decode B={s['batch']} L={s['length']}: {s['reason']}" for s in skipped]
    print("\n".join(header) + "\n\n" + format_table(rows) + "\n\n" + "\n".join(notes))
    if args.json:
        result = {
            **provenance(),
            "model": model_name,
            "architecture": cfg.model.architecture,
            "device": str(runner.device),
            "dtype": _dtype_name(cfg.model.dtype),
            "state_dtype": _dtype_name(cfg.cache.state_dtype),
            "enforce_eager": args.enforce_eager,
            "async_scheduling": cfg.async_scheduling,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "ceilings": ceilings.as_dict(),
            "costs": {
                "num_params": costs.num_params,
                "streamed_weight_bytes": costs.streamed_weight_bytes,
                "active_params": costs.active_params,
                "dense_streamed_weight_bytes": costs.dense_streamed_weight_bytes,
                "expert_bytes": list(costs.expert_bytes),
                "kv_bytes_per_token": costs.kv_bytes_per_token,
                "state_bytes_per_seq": costs.state_bytes_per_seq,
            },
            "rows": rows,
            "skipped": skipped,
            "notes": notes,
        }
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
