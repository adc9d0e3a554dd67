"""`speculative_config`: which proposer drafts, how many tokens, with what options (vLLM's shape).

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    LLM(model, speculative_config={"method": "dflash", "model": DRAFTER_DIR,
                                   "num_speculative_tokens": 15})
    deltaserve serve MODEL --speculative-config '{"method": "ngram", ...}'

Methods are registered in deltaserve/spec/registry.py (name -> proposer class, imported lazily,
and the option keys each method accepts). Validation happens once, here, with errors that name
the key and what it may be.

NOTE: no torch import here (the command line builds its flags from this package).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deltaserve.spec.registry import PROPOSER_METHODS

COMMON_KEYS = ("method", "num_speculative_tokens", "model")
MAX_SPECULATIVE_TOKENS = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated speculative-decoding setup.

    method: a registered proposer ("ngram", "dflash", ...). num_speculative_tokens: k, the most
    drafts a sequence carries into one verify step. model: the drafter checkpoint directory
    (methods that have a drafter). prompt_lookup_min / _max: ngram's match lengths (tried
    longest first). options: the method's other keys, as given."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def query_len(self) -> int:
        """Tokens of a full verify row: the last accepted token plus k drafts."""
        return 1 + self.num_speculative_tokens


def _int_at_least(d: Mapping[str, Any], key: str, lo: int) -> int | None:
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"speculative_config: {key} must be an integer >= {lo}, got {value!r}")
    return value


def parse_speculative_config(
    value: SpeculativeConfig | Mapping[str, Any] | str | None,
) -> SpeculativeConfig | None:
    """The user's speculative_config (a dict, its JSON text, or a SpeculativeConfig) checked
    and completed; None stays None. Raises ValueError naming the bad key."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON ({e})") from e
    if not isinstance(value, Mapping):
        raise ValueError(
            f"speculative_config must be a dict (or its JSON text), got {type(value).__name__}"
        )
    method = value.get("method")
    if method is None:
        raise ValueError(
            f"speculative_config needs a method (one of {', '.join(PROPOSER_METHODS)})"
        )
    entry = PROPOSER_METHODS.get(method)
    if entry is None:
        raise ValueError(
            f"speculative_config: unknown method {method!r}; known: {', '.join(PROPOSER_METHODS)}"
        )
    allowed = set(COMMON_KEYS) | set(entry.keys)
    unknown = sorted(k for k in value if k not in allowed)
    if unknown:
        raise ValueError(
            f"speculative_config: unknown key(s) {', '.join(unknown)} for method {method!r}; "
            f"accepted: {', '.join(sorted(allowed))}"
        )
    k = _int_at_least(value, "num_speculative_tokens", 1)
    if k is None:
        raise ValueError("speculative_config needs num_speculative_tokens (an integer >= 1)")
    if k > MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"speculative_config: num_speculative_tokens={k} is more than {MAX_SPECULATIVE_TOKENS}"
        )
    model = value.get("model")
    if entry.needs_model and not model:
        raise ValueError(f"speculative_config: method {method!r} needs model (a drafter directory)")
    if model is not None and not entry.needs_model:
        raise ValueError(f"speculative_config: method {method!r} takes no model")
    lo = _int_at_least(value, "prompt_lookup_min", 1)
    hi = _int_at_least(value, "prompt_lookup_max", 1)
    if method == "ngram":
        # vLLM's defaults: both 5 when neither is given, else the missing one equals the other
        if lo is None and hi is None:
            lo = hi = 5
        elif hi is None:
            hi = lo
        elif lo is None:
            lo = hi
        if lo > hi:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
            )
    options = {
        key: v
        for key, v in value.items()
        if key not in COMMON_KEYS and key not in ("prompt_lookup_min", "prompt_lookup_max")
    }
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=k,
        model=None if model is None else str(model),
        prompt_lookup_min=lo,
        prompt_lookup_max=hi,
        options=options,
    )
