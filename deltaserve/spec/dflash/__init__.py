"""The DFlash block-diffusion drafter: config (config.py), the engine's paged drafter
(drafter.py, attention.py), its proposer (proposer.py), a dense float32 reference
(reference.py) and random drafters of released shapes (presets.py). The layers are in
deltaserve/models/dflash.py."""

from __future__ import annotations

from typing import Any

__all__ = ["DFlashProposer"]


def __getattr__(name: str) -> Any:
    # NOTE: lazy, so that deltaserve.models.dflash can import the config from this package
    # without importing the proposer (which imports the model)
    if name == "DFlashProposer":
        from deltaserve.spec.dflash.proposer import DFlashProposer

        return DFlashProposer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
