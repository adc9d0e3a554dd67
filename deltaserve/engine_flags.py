"""The engine's command-line flags, generated from one table of `create_engine_config`'s keywords.

`ENGINE_FLAGS` has one entry per keyword of `deltaserve.config.create_engine_config` (and so of
`LLM(...)`): an `EngineFlag` (how the flag looks on the command line) or, for a keyword with no
flag of its own, a string saying what covers it. tests/test_cli_vllm_flags.py checks that the
table and the signature name the same keywords with the same defaults, so the CLI, `LLM()` and
`serve` cannot drift apart. Kernel backend flags (`--<family>-backend`) come from the backend
registry (deltaserve.backends.OP_FAMILIES).

NOTE: no torch import here (`deltaserve --help` must stay fast).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

# dtype names create_engine_config accepts (deltaserve.config._DTYPES, plus auto); vLLM's
# `--dtype half` is float16
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32", "half", "bf16", "fp16", "float")


@dataclass(frozen=True)
class EngineFlag:
    """How one engine keyword appears on the command line.

    kind: "value" (takes a value of `type`), "switch" (store_true) or "bool" (--x / --no-x).
    group: None (the command's own options), "GPU" or "backends" (added by add_backend_args).
    default: the keyword's default in create_engine_config, or None where None means "not
    passed" (the engine's default applies)."""

    help: str
    kind: str = "value"
    type: Any = None
    default: Any = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    group: str | None = None
    aliases: tuple[str, ...] = ()

    def flag(self, keyword: str) -> str:
        return "--" + keyword.replace("_", "-")


ENGINE_FLAGS: dict[str, EngineFlag | str] = {
    "model": "the positional MODEL or --model (see add_model_arg)",
    "random_model": "`deltaserve bench throughput --random-model`",
    "backends": "one --<family>-backend flag per op family (deltaserve.backends.OP_FAMILIES)",
    "tokenizer": EngineFlag("tokenizer directory (default: the model directory)", metavar="DIR"),
    "dtype": EngineFlag(
        "weights and activations dtype (half = float16; auto: float32 on CPU, the checkpoint's "
        "half dtype on GPU)",
        default="auto",
        choices=DTYPE_CHOICES,
    ),
    "device": EngineFlag("device to run on", default="auto", choices=("auto", "cpu", "cuda")),
    "max_model_len": EngineFlag(
        "longest prompt + output, in tokens (default: from the model config)",
        type=int,
        metavar="N",
    ),
    "max_num_seqs": EngineFlag(
        "sequences run at once (default 256)", type=int, default=256, metavar="N"
    ),
    "max_num_batched_tokens": EngineFlag(
        "token budget of one step (default 8192 with chunked prefill, else max-model-len)",
        type=int,
        metavar="N",
    ),
    "enable_chunked_prefill": EngineFlag(
        "split long prompts into chunks under the step's token budget (default on)",
        kind="bool",
        default=True,
    ),
    "enable_prefix_caching": EngineFlag(
        "reuse the cached KV blocks (and, for hybrid models, recurrent-state snapshots) of "
        "shared prompt prefixes (default on)",
        kind="bool",
    ),
    "prefix_state_memory": EngineFlag(
        "memory for the recurrent-state snapshots of hybrid models' prefix caching, in GiB "
        "(below 1024, e.g. 4 or 0.5) or bytes (1024 and up) (default: a tenth of the cache memory, "
        "at most 4 snapshots per max-num-seqs)",
        type=float,
        metavar="SIZE",
    ),
    "prefix_snapshot_interval": EngineFlag(
        "hybrid models: also snapshot the recurrent state every N tokens of a long prefill, so "
        "a shared document is a hit (0: only at prompt and answer ends; default 1024)",
        type=int,
        default=1024,
        metavar="N",
    ),
    "prefix_snapshot_decode_interval": EngineFlag(
        "hybrid models: a decoding sequence rewrites its trailing state snapshot (what its next "
        "turn or its recompute hits) at every multiple of N tokens it passes, a multiple of "
        "--block-size (default: every block; larger: fewer state copies during decode, a next "
        "turn recomputing up to N - 1 more tokens; 0: none, hits only at prompt ends)",
        type=int,
        metavar="N",
    ),
    "block_size": EngineFlag(
        "tokens per KV cache block, a power of two (default 16)",
        type=int,
        default=16,
        metavar="N",
    ),
    "skip_tokenizer_init": EngineFlag(
        "load no tokenizer (token-id prompts only)", kind="switch", default=False
    ),
    "seed": EngineFlag(
        "random seed of the engine's sampler (default 0); with generate / chat also each "
        "request's sampling seed",
        type=int,
    ),
    "num_gpu_blocks_override": EngineFlag(
        "number of KV cache blocks, instead of sizing them from the memory budget",
        type=int,
        metavar="N",
        group="GPU",
    ),
    "state_dtype": EngineFlag(
        "dtype of the GDN recurrent state pool (default float32)",
        default="float32",
        choices=("float32", "bfloat16"),
        group="backends",
    ),
    "enforce_eager": EngineFlag(
        "no CUDA graphs for decode steps", kind="switch", default=False, group="GPU"
    ),
    "gpu_memory_utilization": EngineFlag(
        "share of the GPU's memory for weights, activations, KV cache and state pool (default 0.9)",
        type=float,
        default=0.9,
        metavar="F",
        group="GPU",
    ),
    "kv_cache_memory_bytes": EngineFlag(
        "memory for the KV cache and state pool, in GiB (below 1024) or bytes (1024 and up), "
        "in place of --gpu-memory-utilization's share on a GPU (several engines on one GPU) "
        "and of DELTASERVE_CACHE_MEMORY_GB on CPU (default: those decide)",
        type=float,
        metavar="SIZE",
        group="GPU",
    ),
    "tensor_parallel_size": EngineFlag(
        "split the model over N processes, one per GPU (gloo processes on CPU); N must divide "
        "the attention and GDN head counts (default 1)",
        type=int,
        default=1,
        metavar="N",
        aliases=("-tp",),
    ),
    "limit_mm_per_prompt": EngineFlag(
        "most images per prompt, e.g. image=2 or '{\"image\": 2}' (image=0: no vision tower; "
        "default 999)",
        type=str,
        metavar="SPEC",
    ),
    "async_scheduling": EngineFlag(
        "overlap the host's work on decode step k+1 with the GPU's step k (default: on with "
        "CUDA and no tensor parallelism)",
        kind="bool",
        group="GPU",
    ),
    "warmup": EngineFlag(
        "run a few dummy requests through the prefill path at start-up, so its Triton kernels "
        "compile before the first request instead of stalling it (default: on with CUDA)",
        kind="bool",
        group="GPU",
    ),
    "trust_remote_code": EngineFlag(
        "accepted for vLLM compatibility; deltaserve runs no code from the checkpoint (its "
        "models are its own implementations)",
        kind="switch",
        default=False,
    ),
    "speculative_config": EngineFlag(
        "speculative decoding, as JSON in vLLM's shape: "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"method": "dflash", "model": DIR, "num_speculative_tokens": 15}\'',
        type=str,
        metavar="JSON",
    ),
    "chat_template": EngineFlag(
        "chat template to use instead of the tokenizer's: a Jinja file or the template text",
        metavar="FILE|TEXT",
    ),
}


def add_engine_flag(parser: Any, keyword: str) -> None:
    """Add the flag of one engine keyword (an `EngineFlag` of ENGINE_FLAGS) to `parser`."""
    spec = ENGINE_FLAGS[keyword]
    if not isinstance(spec, EngineFlag):
        raise ValueError(f"engine keyword {keyword!r} has no flag of its own: {spec}")
    names = [spec.flag(keyword), *spec.aliases]
    common: dict[str, Any] = {"dest": keyword, "default": spec.default, "help": spec.help}
    if spec.kind == "switch":
        parser.add_argument(*names, action="store_true", **common)
    elif spec.kind == "bool":
        parser.add_argument(*names, action=argparse.BooleanOptionalAction, **common)
    else:
        parser.add_argument(
            *names, type=spec.type, choices=spec.choices, metavar=spec.metavar, **common
        )


class _ModelAction(argparse.Action):
    """Stores the model of the positional MODEL or of --model; both given and different is an
    error. An absent positional (None) leaves an earlier --model alone."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        if values is None:
            return
        given = getattr(namespace, "model", None)
        if given is not None and given != values:
            parser.error(f"model given twice: {given!r} and {values!r}")
        namespace.model = values


_MODEL_HELP = (
    "local HF model directory (config.json + safetensors + tokenizer). Default: the embedded "
    "demo model (random weights, built locally on first use)."
)


def add_model_arg(parser: argparse.ArgumentParser, positional: bool = True) -> None:
    """The model: `--model DIR` and (with `positional`) vLLM's positional `MODEL`, both stored
    in `args.model` (None: the demo model)."""
    if positional:
        parser.add_argument(
            "model",
            nargs="?",
            default=None,
            action=_ModelAction,
            metavar="MODEL",
            help="the model, as with --model",
        )
    parser.add_argument(
        "--model", default=None, action=_ModelAction, metavar="DIR", help=_MODEL_HELP
    )


def add_engine_args(parser: argparse.ArgumentParser, model_arg: bool = True) -> None:
    """Options that configure the engine (`LLM(...)` / `create_engine_config(...)`), shared by
    every command that runs one: the model (positional MODEL and --model; `model_arg=False`
    when the command adds it itself), then one flag per `EngineFlag` of ENGINE_FLAGS."""
    if model_arg:
        add_model_arg(parser)
    for keyword, spec in ENGINE_FLAGS.items():
        if isinstance(spec, EngineFlag) and spec.group is None:
            add_engine_flag(parser, keyword)
    add_backend_args(parser)
    gpu = parser.add_argument_group("GPU")
    for keyword, spec in ENGINE_FLAGS.items():
        if isinstance(spec, EngineFlag) and spec.group == "GPU":
            add_engine_flag(gpu, keyword)


def add_async_arg(parser: Any) -> None:
    """--async-scheduling / --no-async-scheduling (default: on with a GPU, one process)."""
    add_engine_flag(parser, "async_scheduling")


def add_backend_args(parser: argparse.ArgumentParser) -> None:
    """Kernel backend choices, one `--<family>-backend` flag per op family of the registry
    (deltaserve.backends.OP_FAMILIES), and the recurrent-state dtype."""
    from deltaserve.backends import OP_FAMILIES

    group = parser.add_argument_group("kernel backends (auto: the fastest able one, with reasons)")
    for family in OP_FAMILIES.values():
        choices = ["auto", *family.backend_names]
        group.add_argument(
            family.flag,
            dest=family.keyword,
            default="auto",
            choices=choices,
            help=f"{family.description}: {', '.join(choices)} (default auto)",
        )
    for keyword, spec in ENGINE_FLAGS.items():
        if isinstance(spec, EngineFlag) and spec.group == "backends":
            add_engine_flag(group, keyword)


class _BackendFlags(Mapping[str, list[str]]):
    """flag name without the leading dashes (e.g. "attention-backend") -> the backends of its op
    family; read from the registry on every access, so it never goes stale."""

    def _flags(self) -> dict[str, list[str]]:
        from deltaserve.backends import OP_FAMILIES

        return {f.flag.removeprefix("--"): list(f.backend_names) for f in OP_FAMILIES.values()}

    def __getitem__(self, flag: str) -> list[str]:
        return self._flags()[flag]

    def __iter__(self) -> Iterator[str]:
        return iter(self._flags())

    def __len__(self) -> int:
        return len(self._flags())


# flag -> backends that exist for that op family (generated from deltaserve/backends.py); the
# namespace attribute of each flag is `flag.replace("-", "_")`, e.g. `attention_backend`
BACKEND_FLAGS: Mapping[str, list[str]] = _BackendFlags()


def backend_kwargs(args: argparse.Namespace) -> dict[str, str]:
    """`<family>_backend` -> the backend chosen on the command line ("auto" when not given), for
    every op family of the registry (`LLM(...)` / `create_engine_config(...)` keywords)."""
    from deltaserve.backends import OP_FAMILIES

    return {f.keyword: getattr(args, f.keyword) for f in OP_FAMILIES.values()}


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM(...)` / `create_engine_config(...)` keyword arguments from the engine flags in
    `args` (those of add_engine_args); a flag left at None is not passed (the engine's default
    applies), nor is one the command does not have."""
    kwargs = {
        keyword: getattr(args, keyword, None)
        for keyword, spec in ENGINE_FLAGS.items()
        if isinstance(spec, EngineFlag)
    }
    return {k: v for k, v in kwargs.items() if v is not None} | backend_kwargs(args)
