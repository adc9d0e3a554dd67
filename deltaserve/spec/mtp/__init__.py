"""Speculative method "mtp": drafting with the target checkpoint's own multi-token-prediction
head. The head's layers are in deltaserve/models/mtp.py (built by the target's model class);
here: start-up checks (checks.py), the chain's attention (attention.py), the head on the device
(drafter.py) and the proposer (proposer.py)."""

from __future__ import annotations

from typing import Any

__all__ = ["MTPProposer"]


def __getattr__(name: str) -> Any:
    # NOTE: lazy: the model instance imports the start-up checks without the proposer
    if name == "MTPProposer":
        from deltaserve.spec.mtp.proposer import MTPProposer

        return MTPProposer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
