"""Load safetensors checkpoints (sharded or not) into a model, applying its declared mapping.

Every checkpoint tensor is matched to a parameter (or a shard of a fused one); a missing,
unexpected or mis-shaped tensor fails the load with its name and both shapes. Under tensor
parallelism each rank checks the tensor's full shape, then keeps only its own part (the
module's `tp_rules`, see deltaserve.distributed.sharding).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from deltaserve.distributed.parallel_state import tp_rank, tp_size
from deltaserve.distributed.sharding import ShardRule
from deltaserve.logger import get_logger
from deltaserve.models.base import CausalLM

logger = get_logger(__name__)


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model (names and shapes in the message)."""


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those named by the index, else every
    *.safetensors file in the directory."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise WeightLoadError(f"{index.name} names missing shard(s): {', '.join(absent)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {path}")
    return files


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, on the CPU."""
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _map_name(model: CausalLM, name: str) -> tuple[str, str | None] | None:
    """checkpoint name -> (parameter name, shard name or None); None when skipped."""
    for prefix in model.skip_prefixes:
        if name.startswith(prefix):
            return None
    for src, dst in model.prefix_map:
        if name.startswith(src):
            name = dst + name[len(src) :]
            break
    parts = name.split(".")
    for i, part in enumerate(parts):
        packed = model.packed_modules.get(part)
        if packed is not None:
            parts[i] = packed[0]
            return ".".join(parts), packed[1]
    return name, None


def _checkpoint_name(model: CausalLM, param_name: str, shard: str | None) -> str:
    """The inverse of `_map_name`: the checkpoint name expected for a parameter (shard)."""
    name = param_name
    if shard is not None:
        fused = model.packed_modules[shard][0]
        name = ".".join(shard if p == fused else p for p in name.split("."))
    for src, dst in model.prefix_map:
        if name.startswith(dst):
            return src + name[len(dst) :]
    return name


def _shard_offsets(model: CausalLM, param_name: str) -> dict[str, tuple[int, int]] | None:
    """The (offset, size) row slices of a fused parameter's shards, or None if not fused."""
    module = model.get_submodule(param_name.rpartition(".")[0])
    return getattr(module, "shard_offsets", None)


def _shard_rule(model: CausalLM, param_name: str, shard: str | None) -> ShardRule | None:
    """How the checkpoint tensor of a parameter (shard) is split across ranks, or None when
    every rank holds all of it."""
    module_name, _, attr = param_name.rpartition(".")
    rules = getattr(model.get_submodule(module_name), "tp_rules", None) or {}
    return rules.get((attr, shard))


def _target(model: CausalLM, param_name: str, param: torch.Tensor, shard: str | None):
    """(this rank's slice of the parameter to fill, the full shape the checkpoint must have,
    the rule that cuts the checkpoint tensor or None)."""
    target = param.data
    if shard is not None:
        offset, size = _shard_offsets(model, param_name)[shard]
        target = target.narrow(0, offset, size)
    rule = _shard_rule(model, param_name, shard)
    shape = list(target.shape)
    if rule is not None:
        shape[rule.dim] = rule.global_size
    return target, tuple(shape), rule


def _shape(t: torch.Size | tuple) -> str:
    return "[" + ", ".join(str(d) for d in t) + "]"


def load_weights(model: CausalLM, path: str | Path) -> None:
    """Copy every checkpoint tensor into `model` (already on its device and dtype)."""
    path = Path(path)
    start = time.perf_counter()
    params = dict(model.named_parameters())
    tied = model.tied_parameters()
    loaded: set[tuple[str, str | None]] = set()
    skipped: dict[str, int] = {}
    unexpected: list[str] = []
    nbytes = 0
    for ckpt_name, tensor in iter_checkpoint(path):
        mapped = _map_name(model, ckpt_name)
        if mapped is None or mapped[0] in tied:
            key = next((p + "*" for p in model.skip_prefixes if ckpt_name.startswith(p)), ckpt_name)
            skipped[key] = skipped.get(key, 0) + 1
            continue
        param_name, shard = mapped
        param = params.get(param_name)
        if param is None:
            unexpected.append(f"{ckpt_name} {_shape(tensor.shape)}")
            continue
        target, expected, rule = _target(model, param_name, param, shard)
        if tuple(tensor.shape) != expected:
            raise WeightLoadError(
                f"tensor {ckpt_name} has shape {_shape(tensor.shape)} in the checkpoint but the "
                f"model expects {_shape(expected)}"
            )
        if (param_name, shard) in loaded:
            raise WeightLoadError(f"tensor {ckpt_name} appears twice in the checkpoint")
        if rule is not None:
            tensor = rule.slice(tensor, tp_rank(), tp_size())
            n = tensor.shape[rule.dim]
            if n < target.shape[rule.dim]:  # vocabulary padding of the last rank(s)
                target.narrow(rule.dim, n, target.shape[rule.dim] - n).zero_()
            target = target.narrow(rule.dim, 0, n)
        target.copy_(tensor)
        loaded.add((param_name, shard))
        nbytes += tensor.numel() * tensor.element_size()

    if unexpected:
        raise WeightLoadError(
            f"unexpected tensor(s) in {path}: "
            + ", ".join(unexpected[:20])
            + (f" (+{len(unexpected) - 20} more)" if len(unexpected) > 20 else "")
        )
    missing = []
    for name, param in params.items():
        shards = _shard_offsets(model, name)
        for shard in shards or [None]:
            if (name, shard) not in loaded:
                _, shape, _ = _target(model, name, param, shard)
                missing.append(f"{_checkpoint_name(model, name, shard)} {_shape(shape)}")
    if missing:
        raise WeightLoadError(
            f"missing tensor(s) in {path}: "
            + ", ".join(missing[:20])
            + (f" (+{len(missing) - 20} more)" if len(missing) > 20 else "")
        )
    if skipped:
        logger.info(
            "skipped checkpoint tensors not used for text generation: %s",
            ", ".join(f"{key} ({count})" for key, count in sorted(skipped.items())),
        )
    logger.info(
        "loaded %.1f MB of weights from %s in %.1fs",
        nbytes / 1e6,
        path.name,
        time.perf_counter() - start,
    )


@contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(model_cls: type, text_config, tie_word_embeddings: bool, dtype, device) -> CausalLM:
    """Construct the model without initialising weights: on the meta device, then memory on
    `device` in `dtype`, to be filled by `load_weights`."""
    with default_dtype(dtype), torch.device("meta"):
        model = model_cls(text_config, tie_word_embeddings=tie_word_embeddings)
    model = model.to_empty(device=device)
    return model.eval().requires_grad_(False)
