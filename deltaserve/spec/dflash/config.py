"""The DFlash drafter's config.json, as z-lab ships it, read into one validated dataclass.

A z-lab drafter checkpoint is a small Qwen3 decoder stack: `architectures ["DFlashDraftModel"]`,
`model_type "qwen3"`, the usual Qwen3 shape keys, plus the drafting keys
`block_size`, `mask_token_id` and `target_layer_ids`. Those three are read from the
`dflash_config` object first, then from the top level (both layouts are released). Optional:
`num_target_layers`, `layer_types` ("full_attention" / "sliding_attention" per layer),
`sliding_window`, `is_causal` (top level; None: a sliding layer is causal, a full one is not,
as z-lab's attention decides), and the logit / embedding scales `input_embedding_scale`,
`output_multiplier`, `final_logit_softcapping` (dflash_config first, then top level).

Every malformed key fails with a `DFlashConfigError` naming the file and the key; a drafter that
does not fit its target (hidden size, vocabulary, number of target layers, tapped layers out of
range, mask id outside the vocabulary) fails `check_target` with both figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltaserve.loader.files import read_json

ARCHITECTURE = "DFlashDraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")


class DFlashConfigError(ValueError):
    """A drafter config that cannot be served (the file or the key in the message)."""


@dataclass(frozen=True)
class DFlashConfig:
    """Everything the drafter's math reads from its config.json (global head counts)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    attention_bias: bool
    vocab_size: int | None
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    layer_types: tuple[str, ...]
    sliding_window: int | None
    is_causal: bool | None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def layer_causal(self, i: int) -> bool:
        """Whether draft layer i masks the block causally (z-lab: `is_causal` when set, else a
        sliding-window layer is causal and a full-attention one is not)."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        """The sliding window of draft layer i (None: it attends to every position)."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def check_target(
        self, hidden_size: int, vocab_size: int, num_layers: int, where: str = "the drafter"
    ) -> None:
        """Raise DFlashConfigError when this drafter cannot draft for a target of this shape."""
        problems = []
        if hidden_size != self.hidden_size:
            problems.append(
                f"hidden_size {self.hidden_size} != the target's {hidden_size} (the drafter "
                "reads the target's hidden states and embeddings)"
            )
        if self.vocab_size is not None and self.vocab_size != vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != the target's {vocab_size}")
        if not 0 <= self.mask_token_id < vocab_size:
            problems.append(
                f"mask_token_id {self.mask_token_id} is outside the target's vocabulary "
                f"[0, {vocab_size})"
            )
        if self.num_target_layers is not None and self.num_target_layers != num_layers:
            problems.append(
                f"num_target_layers {self.num_target_layers} != the target's {num_layers} "
                "layers (trained for another target)"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < num_layers]
        if bad:
            problems.append(
                f"target_layer_ids {list(self.target_layer_ids)} name layer(s) {bad} outside "
                f"the target's {num_layers} layers"
            )
        if problems:
            raise DFlashConfigError(f"{where} does not fit the target: " + "; ".join(problems))


def _int(raw: dict[str, Any], key: str, where: str, minimum: int = 1) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DFlashConfigError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _float(value: Any, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DFlashConfigError(f"{where}: {key} must be a number, got {value!r}")
    return float(value)


def _rope(raw: dict[str, Any], where: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor): `rope_parameters` (transformers 5) or the legacy
    `rope_theta` / `rope_scaling` keys; only the default (unscaled) rotary is supported."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise DFlashConfigError(f"{where}: rope_parameters must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise DFlashConfigError(f"{where}: rope_type {rope_type!r} is not supported (default)")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    return _float(theta, "rope_theta", where), _float(factor, "partial_rotary_factor", where)


def parse_dflash_config(raw: dict[str, Any], where: str = "config.json") -> DFlashConfig:
    """A drafter config.json (as a dict) -> DFlashConfig; DFlashConfigError naming the key."""
    archs = raw.get("architectures") or []
    if ARCHITECTURE not in archs:
        raise DFlashConfigError(
            f"{where}: architectures {archs!r} do not name {ARCHITECTURE!r} (only z-lab "
            "DFlashDraftModel drafters are supported)"
        )
    model_type = raw.get("model_type", "qwen3")
    if model_type != "qwen3":
        raise DFlashConfigError(f"{where}: model_type {model_type!r} is not 'qwen3'")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise DFlashConfigError(f"{where}: hidden_act {act!r} is not supported (silu)")
    draft = raw.get("dflash_config") or {}
    if not isinstance(draft, dict):
        raise DFlashConfigError(f"{where}: dflash_config must be an object, got {draft!r}")

    def drafting(key: str, default: Any = None) -> Any:
        return draft[key] if key in draft else raw.get(key, default)

    merged = {
        "block_size": drafting("block_size"),
        "mask_token_id": drafting("mask_token_id"),
    }
    for key in ("block_size", "mask_token_id"):
        if merged[key] is None:
            raise DFlashConfigError(f"{where}: {key} is missing (in dflash_config or top level)")
    block_size = _int(merged, "block_size", where, minimum=2)
    mask_token_id = _int(merged, "mask_token_id", where, minimum=0)
    taps = drafting("target_layer_ids")
    if taps is None:
        raise DFlashConfigError(
            f"{where}: target_layer_ids is missing (in dflash_config or top level)"
        )
    if (
        not isinstance(taps, list)
        or not taps
        or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in taps)
    ):
        raise DFlashConfigError(
            f"{where}: target_layer_ids must be a non-empty list of layer indices >= 0, "
            f"got {taps!r}"
        )

    hidden = _int(raw, "hidden_size", where)
    num_layers = _int(raw, "num_hidden_layers", where)
    heads = _int(raw, "num_attention_heads", where)
    kv_heads = _int(raw, "num_key_value_heads", where) if "num_key_value_heads" in raw else heads
    if heads % kv_heads:
        raise DFlashConfigError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
            f"{kv_heads}"
        )
    head_dim = raw.get("head_dim") or hidden // heads
    layer_types = raw.get("layer_types") or ["full_attention"] * num_layers
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise DFlashConfigError(
            f"{where}: layer_types must list one type per layer ({num_layers}), got {layer_types!r}"
        )
    unknown = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if unknown:
        raise DFlashConfigError(
            f"{where}: layer_types has unknown type(s) {unknown}; known: {list(LAYER_TYPES)}"
        )
    window = raw.get("sliding_window")
    if "sliding_attention" in layer_types:
        window = _int(raw, "sliding_window", where)
    is_causal = raw.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise DFlashConfigError(f"{where}: is_causal must be true, false or null")
    num_target_layers = raw.get("num_target_layers")
    if num_target_layers is not None:
        num_target_layers = _int(raw, "num_target_layers", where)
    softcap = drafting("final_logit_softcapping")
    softcap = _float(softcap, "final_logit_softcapping", where) if softcap else None
    theta, factor = _rope(raw, where)
    vocab = raw.get("vocab_size")
    return DFlashConfig(
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size", where),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=_float(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", where),
        rope_theta=theta,
        partial_rotary_factor=factor,
        attention_bias=bool(raw.get("attention_bias", False)),
        vocab_size=None if vocab is None else _int(raw, "vocab_size", where),
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(taps),
        num_target_layers=num_target_layers,
        layer_types=tuple(layer_types),
        sliding_window=window,
        is_causal=is_causal,
        input_embedding_scale=_float(
            drafting("input_embedding_scale", 1.0), "input_embedding_scale", where
        ),
        output_multiplier=_float(drafting("output_multiplier", 1.0), "output_multiplier", where),
        final_logit_softcapping=softcap,
    )


def load_dflash_config(path: str | Path) -> DFlashConfig:
    """Read and validate `path`/config.json of a drafter checkpoint directory."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise DFlashConfigError(f"no config.json in drafter directory {path}")
    return parse_dflash_config(read_json(cfg_file), str(cfg_file))
