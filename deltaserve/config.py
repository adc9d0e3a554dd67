"""Engine configuration: frozen dataclasses, validated once, "auto" resolved and logged once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import deltaserve.backends as backend_registry
from deltaserve.logger import get_logger
from deltaserve.spec.config import SpeculativeConfig, parse_speculative_config

logger = get_logger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class ModelConfig:
    """The checkpoint and how its weights run."""

    path: str
    hf_config: Any  # the top-level transformers config
    text_config: Any  # the language model's config (== hf_config for text-only checkpoints)
    architecture: str
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    tokenizer: str | None  # None with skip_tokenizer_init
    seed: int
    random_model: str | None = None  # a preset name: random weights, no checkpoint files
    chat_template: str | None = None  # replaces the tokenizer's chat template when set


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache and recurrent-state pool."""

    block_size: int
    enable_prefix_caching: bool | None  # None = auto: on (every model)
    num_gpu_blocks_override: int | None
    state_dtype: torch.dtype
    # recurrent-state snapshots for prefix caching of hybrid models (cache/snapshots.py):
    # their memory in bytes (None: a share of the cache memory) and the interval, in tokens, of
    # the snapshots taken inside long prefills (0: none)
    prefix_state_memory: int | None = None
    prefix_snapshot_interval: int = 1024
    # the trailing snapshot of a decoding sequence is rewritten at every multiple of this many
    # tokens it passes (None: every block; 0: never, hits only at prompt ends)
    prefix_snapshot_decode_interval: int | None = None

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on (auto resolves to on)."""
        return self.enable_prefix_caching is not False


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    # op family -> forced backend name (deltaserve.backends.OP_FAMILIES); a missing family is
    # "auto". Validated and stripped of "auto" entries on construction.
    backends: Mapping[str, str] = field(default_factory=dict)
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory for weights + caches
    # the cache pools' bytes (KV blocks, state slots, snapshots) in place of
    # gpu_memory_utilization's share on CUDA (several engines on one GPU) and of
    # DELTASERVE_CACHE_MEMORY_GB on CPU (None: those decide)
    kv_cache_memory_bytes: int | None = None
    tensor_parallel_size: int = 1  # one process per device; heads and MLP split across them
    async_scheduling: bool = False  # overlapped decode: host prepares step k+1 during step k
    speculative: SpeculativeConfig | None = None  # speculative decoding (deltaserve/spec)
    # most items per prompt by modality ({"image": N}; deltaserve/multimodal/limits.py)
    limit_mm_per_prompt: Mapping[str, int] = field(default_factory=lambda: {"image": 999})
    # run dummy requests through the prefill path at start-up so its kernels compile before
    # serving (engine/warmup.py); None = auto: on for CUDA devices
    warmup: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "backends", validate_backends(self.backends))

    @property
    def forced_backends(self) -> dict[str, str]:
        """Every op family of the registry -> the user's backend choice ("auto" when not
        forced)."""
        return {op: self.backends.get(op, "auto") for op in backend_registry.OP_FAMILIES}


def validate_backends(choices: Mapping[str, str]) -> dict[str, str]:
    """The user's backend choices (op family -> backend name or "auto") checked against the
    registry, "auto" entries dropped. Raises ValueError naming the valid families / backends."""
    families = backend_registry.OP_FAMILIES
    unknown = [op for op in choices if op not in families]
    if unknown:
        raise ValueError(
            f"unknown op famil{'y' if len(unknown) == 1 else 'ies'} "
            f"{', '.join(map(repr, unknown))}; known: {', '.join(families)}"
        )
    chosen = {}
    for op, name in choices.items():
        if name == "auto":
            continue
        names = families[op].backend_names
        if name not in names:
            raise ValueError(f"unknown {op} backend {name!r}; choose from auto, {', '.join(names)}")
        chosen[op] = name
    return chosen


def backend_choices(
    backends: Mapping[str, str] | None = None, keywords: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """Merge `backends={"attention": "triton"}` with per-family keywords (`attention_backend=
    "triton"`, one for every op family of the registry) into one validated dict. A keyword that
    names no op family is a TypeError; two different choices for one family a ValueError."""
    merged = dict(backends or {})
    by_keyword = {f.keyword: f.name for f in backend_registry.OP_FAMILIES.values()}
    for key, name in (keywords or {}).items():
        op = by_keyword.get(key)
        if op is None:
            raise TypeError(
                f"unexpected keyword argument {key!r} (the backend keywords are "
                f"{', '.join(by_keyword)})"
            )
        if name == "auto":
            continue
        if merged.get(op, "auto") not in ("auto", name):
            raise ValueError(f"{op} backend given twice: {merged[op]!r} and {key}={name!r}")
        merged[op] = name
    return validate_backends(merged)


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unsupported device {device!r}: use auto, cpu or cuda") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}: use auto, cpu or cuda")
    return dev


def resolve_dtype(
    dtype: str | torch.dtype, checkpoint_dtype: Any, device: torch.device
) -> torch.dtype:
    """auto: float32 on CPU; the checkpoint's half dtype on GPU (bfloat16 for fp32 checkpoints)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}: use auto, bfloat16, float16 or float32")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    if isinstance(checkpoint_dtype, str):
        checkpoint_dtype = _DTYPES.get(checkpoint_dtype)
    if checkpoint_dtype in (torch.bfloat16, torch.float16):
        return checkpoint_dtype
    return torch.bfloat16


def create_engine_config(
    model: str | None,
    *,
    random_model: str | None = None,
    tokenizer: str | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool | None = None,
    prefix_state_memory: float | None = None,
    prefix_snapshot_interval: int = 1024,
    prefix_snapshot_decode_interval: int | None = None,
    block_size: int = 16,
    skip_tokenizer_init: bool = False,
    seed: int = 0,
    num_gpu_blocks_override: int | None = None,
    state_dtype: str | torch.dtype = "float32",
    backends: Mapping[str, str] | None = None,
    enforce_eager: bool = False,
    gpu_memory_utilization: float = 0.9,
    kv_cache_memory_bytes: float | str | None = None,
    tensor_parallel_size: int = 1,
    async_scheduling: bool | None = None,
    trust_remote_code: bool = False,
    chat_template: str | None = None,
    speculative_config: dict | str | None = None,
    limit_mm_per_prompt: dict | str | None = None,
    warmup: bool | None = None,
    **backend_keywords: str,
) -> EngineConfig:
    """Validate the user's settings against the checkpoint and resolve every "auto".

    With `random_model` (a preset of deltaserve.loader.random_model), `model` must be None: the
    preset's real config is used with random weights and no tokenizer (benchmarks).

    Kernel backends: `backends={"attention": "triton", ...}` (op family -> backend name) and/or
    one keyword per op family of deltaserve.backends.OP_FAMILIES, `<family>_backend=NAME`
    (`attention_backend=`, `gdn_prefill_backend=`, `gdn_decode_backend=`, `conv1d_backend=`,
    `fused_backend=`, `decode_gemm_backend=`, ...); "auto" or absent: the fastest able one.

    `chat_template`: a Jinja template file or the template text, used instead of the
    tokenizer's. `trust_remote_code` is accepted for vLLM compatibility: no checkpoint code is
    ever run (deltaserve's models are its own implementations).

    `speculative_config`: vLLM's shape, e.g. `{"method": "ngram", "num_speculative_tokens": 4}`
    (deltaserve/spec/config.py); overlapped decode is off while speculating.

    `limit_mm_per_prompt`: images per prompt, vLLM's shape (`{"image": N}`, "image=N" or its
    JSON); image=0 also skips loading the vision tower.

    `warmup`: run a few dummy requests through the prefill path at the end of start-up, so its
    Triton kernels compile before the first request (deltaserve/engine/warmup.py); None (auto):
    on for CUDA devices, off on CPU.

    Every keyword has a command-line flag (deltaserve.engine_flags.ENGINE_FLAGS; a test keeps
    the two in step).
    """
    chosen_backends = backend_choices(backends, backend_keywords)
    if trust_remote_code:
        logger.info(
            "trust_remote_code: accepted, but no remote code is run (deltaserve builds models "
            "from its own implementations)"
        )
    template = read_chat_template(chat_template)
    if random_model is not None:
        from deltaserve.loader.random_model import random_model_config

        if model is not None:
            raise ValueError("pass either model or random_model, not both")
        hf_config, text_config, architecture = random_model_config(random_model)
        path = Path(f"random-{random_model}")
        shown = path.name
        # no tokenizer of its own: only one given explicitly (e.g. to serve token-id prompts)
        skip_tokenizer_init = skip_tokenizer_init or tokenizer is None
    else:
        from deltaserve.loader.files import check_checkpoint_files
        from deltaserve.loader.hf_config import load_hf_config
        from deltaserve.loader.hub import resolve_model_path

        if model is None:
            raise ValueError("no model given: pass a checkpoint directory or random_model")
        # a local directory, or a Hub id already in the Hugging Face cache ("model directory
        # not found" otherwise, saying where the files are expected)
        path = resolve_model_path(model)
        # a Hub id resolves to a snapshot directory named by its hash: log the id
        shown = path.name if Path(str(model)).is_dir() else str(model)
        hf_config, text_config, architecture = load_hf_config(path)
        check_checkpoint_files(path)  # truncated / corrupt files, named, before any loading
    if tokenizer is not None and not skip_tokenizer_init:
        from deltaserve.loader.hub import resolve_model_path

        tokenizer = str(resolve_model_path(tokenizer, what="tokenizer"))
    dev = resolve_device(device)
    checkpoint_dtype = getattr(text_config, "dtype", None) or getattr(hf_config, "dtype", None)
    run_dtype = resolve_dtype(dtype, checkpoint_dtype, dev)
    if dev.type == "cpu" and run_dtype == torch.float16:
        logger.warning("float16 on CPU is slow and imprecise; consider float32")

    max_pos = int(getattr(text_config, "max_position_embeddings", 0) or 0)
    if max_model_len is None:
        if max_pos <= 0:
            raise ValueError("config.json has no max_position_embeddings: pass max_model_len")
        max_model_len = max_pos
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    if max_pos and max_model_len > max_pos:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={max_pos}"
        )
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if max_num_batched_tokens is None:
        max_num_batched_tokens = 8192 if enable_chunked_prefill else max_model_len
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"without chunked prefill, max_num_batched_tokens ({max_num_batched_tokens}) must be "
            f">= max_model_len ({max_model_len})"
        )
    if not isinstance(prefix_snapshot_interval, int) or prefix_snapshot_interval < 0:
        raise ValueError(
            "prefix_snapshot_interval must be an integer >= 0 (tokens; 0 = no snapshots inside "
            f"long prefills), got {prefix_snapshot_interval!r}"
        )
    decode_interval = prefix_snapshot_decode_interval
    if decode_interval is not None and (
        not isinstance(decode_interval, int) or decode_interval < 0 or decode_interval % block_size
    ):
        raise ValueError(
            "prefix_snapshot_decode_interval must be 0 (no snapshots during decode) or a "
            f"multiple of block_size ({block_size}) in tokens, got {decode_interval!r}"
        )
    if num_gpu_blocks_override is not None and num_gpu_blocks_override < 2:
        raise ValueError(f"num_gpu_blocks_override must be >= 2, got {num_gpu_blocks_override}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    kv_cache_bytes = parse_memory(kv_cache_memory_bytes, "kv_cache_memory_bytes")
    if kv_cache_bytes == 0:
        raise ValueError("kv_cache_memory_bytes must be > 0 (GiB or bytes), got 0")
    _check_tensor_parallel(tensor_parallel_size, text_config, dev)
    state_dt = _DTYPES.get(state_dtype) if isinstance(state_dtype, str) else state_dtype
    if state_dt not in (torch.float32, torch.bfloat16):
        raise ValueError(f"state_dtype must be float32 or bfloat16, got {state_dtype!r}")

    speculative = parse_speculative_config(speculative_config)
    from deltaserve.multimodal.limits import parse_limit_mm_per_prompt

    mm_limits = parse_limit_mm_per_prompt(limit_mm_per_prompt)
    if speculative is not None:
        if tensor_parallel_size > 1:
            raise ValueError("speculative_config is not supported with tensor parallelism yet")
        if async_scheduling:
            raise ValueError(
                "async_scheduling (overlapped decode) cannot be combined with speculative "
                "decoding yet: speculative steps run synchronously"
            )
        async_scheduling = False
    if async_scheduling is None:  # auto: on where the GPU runs beside the host (TP included)
        async_scheduling = dev.type == "cuda"

    if skip_tokenizer_init:
        tok = None
    else:
        tok = tokenizer or str(path)
    config = EngineConfig(
        model=ModelConfig(
            path=str(path),
            hf_config=hf_config,
            text_config=text_config,
            architecture=architecture,
            dtype=run_dtype,
            device=dev,
            max_model_len=max_model_len,
            tokenizer=tok,
            seed=seed,
            random_model=random_model,
            chat_template=template,
        ),
        cache=CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            num_gpu_blocks_override=num_gpu_blocks_override,
            state_dtype=state_dt,
            prefix_state_memory=parse_memory(prefix_state_memory, "prefix_state_memory"),
            prefix_snapshot_interval=prefix_snapshot_interval,
            prefix_snapshot_decode_interval=prefix_snapshot_decode_interval,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
        ),
        backends=chosen_backends,
        enforce_eager=enforce_eager,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_memory_bytes=kv_cache_bytes,
        tensor_parallel_size=tensor_parallel_size,
        async_scheduling=async_scheduling,
        speculative=speculative,
        limit_mm_per_prompt=mm_limits,
        warmup=warmup,
    )
    logger.info(
        "model %s (%s) on %s, dtype %s, max_model_len %d, max_num_seqs %d, "
        "max_num_batched_tokens %d, chunked prefill %s, tensor parallel size %d",
        shown,
        architecture,
        dev,
        str(run_dtype).removeprefix("torch."),
        max_model_len,
        max_num_seqs,
        max_num_batched_tokens,
        "on" if enable_chunked_prefill else "off",
        tensor_parallel_size,
    )
    return config


def parse_memory(value: float | str | None, name: str) -> int | None:
    """A memory size in bytes from GiB (a number below 1024, e.g. 4 or 0.5) or bytes (a number
    of at least 1024); None stays None. Raises ValueError naming `name`."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of GiB or bytes, got {value!r}") from None
    if not number >= 0 or number == float("inf"):
        raise ValueError(f"{name} must be >= 0 (GiB or bytes), got {value!r}")
    if number >= 1024:
        return int(number)
    return int(number * 2**30)


def read_chat_template(chat_template: str | None) -> str | None:
    """The template text of `chat_template`: a file's contents, or the text itself when it is a
    Jinja template (contains "{"). A name that is neither is a ValueError naming it."""
    if chat_template is None:
        return None
    path = Path(chat_template)
    if "{" not in chat_template and "\n" not in chat_template:
        if not path.is_file():
            raise ValueError(
                f"chat template file not found: {chat_template} (pass a Jinja file or the "
                "template text)"
            )
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read chat template {chat_template} ({e})") from e
    return chat_template


def _check_tensor_parallel(tp: int, text_config: Any, device: torch.device) -> None:
    """A size the devices and the model's head counts allow (clear errors at start-up, before
    any worker process starts)."""
    from deltaserve.distributed.sharding import check_tp_shapes

    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
    if tp > 1 and device.type == "cuda" and tp > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size={tp} needs {tp} GPUs, this machine has "
            f"{torch.cuda.device_count()}"
        )
    check_tp_shapes(text_config, tp)
