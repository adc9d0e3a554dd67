"""Start-up checks for speculative method "mtp": the target can build an MTP head and its
checkpoint carries one (`mtp.*` tensors). NOTE: torch-free (reads safetensors headers only)."""

from __future__ import annotations

from pathlib import Path

from deltaserve.distributed.parallel_state import tp_size


class MTPConfigError(ValueError):
    """Speculative method "mtp" asked of a target that cannot serve it (why in the message)."""


def check_mtp_target(model_cls: type, architecture: str, path: str | Path, random: bool) -> None:
    """Raise MTPConfigError unless `model_cls` builds an MTP head, tensor parallelism is off
    and (for a checkpoint, not random weights) the checkpoint at `path` has `mtp.*` tensors."""
    if not getattr(model_cls, "supports_mtp", False):
        raise MTPConfigError(
            f"speculative method 'mtp': {architecture} has no MTP head in deltaserve "
            "(Qwen3.5, Qwen3.5-MoE and Qwen3-Next checkpoints carry one)"
        )
    if tp_size() > 1:
        raise MTPConfigError("speculative method 'mtp' under tensor parallelism is not supported")
    if random:
        return
    from deltaserve.loader.files import safetensors_tensor_names
    from deltaserve.loader.weights import checkpoint_files

    names = [n for f in checkpoint_files(Path(path)) for n in safetensors_tensor_names(f)]
    if not any(n.startswith("mtp.") for n in names):
        raise MTPConfigError(
            f"speculative method 'mtp': the checkpoint {path} has no mtp.* tensors (no MTP "
            "head to draft with)"
        )
