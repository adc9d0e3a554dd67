"""Load safetensors checkpoints (sharded or not) into a model, applying its declared mapping.

Every checkpoint tensor is mapped to a slot of a parameter (the model's `weight_name_map()`:
the whole parameter, a shard of a fused one, an expert of a stacked one); a missing, unexpected,
mis-shaped or duplicate tensor fails the load with its name (and both shapes). The parameter's
module decides how the tensor lands (deltaserve.layers.weight_loading): under tensor
parallelism each rank checks the tensor's full shape, then keeps only its own part (the
module's `tp_rules`, see deltaserve.distributed.sharding). Once every tensor is in, modules may
transform their weights (`process_weights_after_loading`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from deltaserve.layers.weight_loading import (
    WeightName,
    load_weight,
    process_weights_after_loading,
    weight_covers,
    weight_shape,
    weight_slots,
)
from deltaserve.loader.files import (
    CheckpointFileError,
    one_line,
    read_json,
    safetensors_tensor_names,
)
from deltaserve.loader.progress import progress_bar
from deltaserve.logger import get_logger
from deltaserve.models.base import CausalLM

logger = get_logger(__name__)


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model (names and shapes in the message)."""


@dataclass(frozen=True)
class Shard:
    """One safetensors file of a checkpoint and how many tensors its header lists."""

    file: Path
    num_tensors: int


def checkpoint_shards(path: Path) -> list[Shard]:
    """The safetensors files of a checkpoint (those named by the index, else every
    *.safetensors file in the directory), each checked against its header before any tensor is
    read: a truncated or corrupt file raises CheckpointFileError naming it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointFileError(f"{index} is not valid (no weight_map)")
        files = sorted({path / str(f) for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise WeightLoadError(f"{index.name} names missing shard(s): {', '.join(absent)}")
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightLoadError(f"no *.safetensors files in {path}")
    return [Shard(f, len(safetensors_tensor_names(f))) for f in files]


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint, checked (see `checkpoint_shards`)."""
    return [shard.file for shard in checkpoint_shards(path)]


def iter_checkpoint(
    path: Path, shards: list[Shard] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, on the CPU. A file safetensors cannot
    read raises CheckpointFileError naming it."""
    for shard in checkpoint_shards(path) if shards is None else shards:
        file = shard.file
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # SafetensorError, OSError: a damaged file
            raise CheckpointFileError(f"{file} is truncated or corrupt ({one_line(e)})") from e
        with handle as f:
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointFileError(
                        f"{file} is truncated or corrupt (tensor {name}: {one_line(e)})"
                    ) from e
                yield name, tensor


def _with_progress(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_checkpoint(path)` under a progress bar over the tensors (see loader/progress.py)."""
    shards = checkpoint_shards(path)
    total = sum(s.num_tensors for s in shards)
    desc = f"loading weights ({len(shards)} shard{'s' if len(shards) > 1 else ''})"
    with progress_bar(total, desc, "tensor") as bar:
        for item in iter_checkpoint(path, shards):
            yield item
            bar.update(1)


def _shape(t: torch.Size | tuple) -> str:
    return "[" + ", ".join(str(d) for d in t) + "]"


def _owner(model: nn.Module, param_name: str) -> tuple[nn.Module, str]:
    """(the module holding a parameter, the parameter's attribute name in it)."""
    module_name, _, attr = param_name.rpartition(".")
    return model.get_submodule(module_name), attr


def load_weights(model: CausalLM, path: str | Path) -> None:
    """Copy every checkpoint tensor into `model` (already on its device and dtype), then run
    the modules' `process_weights_after_loading` hooks."""
    path = Path(path)
    start = time.perf_counter()
    names = model.weight_name_map()
    params = dict(model.named_parameters())
    owners = {name: _owner(model, name) for name in params}
    slots = [  # every slot the checkpoint must fill, in parameter order
        WeightName(name, shard, expert)
        for name, (module, attr) in owners.items()
        for shard, expert in weight_slots(module, attr)
    ]
    expected_slots = set(slots)
    tied = model.tied_parameters()
    loaded: set[WeightName] = set()
    skipped: dict[str, int] = {}
    unexpected: list[str] = []
    nbytes = 0
    for ckpt_name, tensor in _with_progress(path):
        target = names.map(ckpt_name)
        if target is None or target.param in tied:
            prefix = names.skipped_prefix(ckpt_name)
            key = ckpt_name if prefix is None else prefix + "*"
            skipped[key] = skipped.get(key, 0) + 1
            continue
        covers = [target]
        if target not in expected_slots:  # a tensor filling several slots, or unexpected
            owner = owners.get(target.param)
            covered = None if owner is None else weight_covers(*owner, target.shard, target.expert)
            if not covered:  # no such parameter, shard or expert
                unexpected.append(f"{ckpt_name} {_shape(tensor.shape)}")
                continue
            covers = [WeightName(target.param, shard, expert) for shard, expert in covered]
        module, attr = owners[target.param]
        expected = weight_shape(module, attr, target.shard, target.expert)
        if tuple(tensor.shape) != expected:
            raise WeightLoadError(
                f"tensor {ckpt_name} has shape {_shape(tensor.shape)} in the checkpoint but the "
                f"model expects {_shape(expected)}"
            )
        if any(slot in loaded for slot in covers):
            raise WeightLoadError(f"tensor {ckpt_name} appears twice in the checkpoint")
        load_weight(module, attr, tensor, target.shard, target.expert)
        loaded.update(covers)
        nbytes += tensor.numel() * tensor.element_size()

    if unexpected:
        raise WeightLoadError(
            f"unexpected tensor(s) in {path}: "
            + ", ".join(unexpected[:20])
            + (f" (+{len(unexpected) - 20} more)" if len(unexpected) > 20 else "")
        )
    missing = []
    for slot in slots:
        if slot not in loaded:
            module, attr = owners[slot.param]
            shape = weight_shape(module, attr, slot.shard, slot.expert)
            missing.append(f"{names.checkpoint_name(slot)} {_shape(shape)}")
    if missing:
        raise WeightLoadError(
            f"missing tensor(s) in {path}: "
            + ", ".join(missing[:20])
            + (f" (+{len(missing) - 20} more)" if len(missing) > 20 else "")
        )
    process_weights_after_loading(model)
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


def build_model(
    model_cls: type, text_config, tie_word_embeddings: bool, dtype, device, **extra
) -> CausalLM:
    """Construct the model without initialising weights: on the meta device, then memory on
    `device` in `dtype`, to be filled by `load_weights`. `extra`: keywords of the model class
    (e.g. `vision_config` for a model with a vision tower)."""
    with default_dtype(dtype), torch.device("meta"):
        model = model_cls(text_config, tie_word_embeddings=tie_word_embeddings, **extra)
    model = model.to_empty(device=device)
    return model.eval().requires_grad_(False)
