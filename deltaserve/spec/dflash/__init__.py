"""The DFlash block-diffusion drafter: config (config.py), the engine's paged drafter
(drafter.py, attention.py), its proposer (proposer.py), a dense float32 reference
(reference.py) and random drafters of released shapes (presets.py). The layers are in
deltaserve/models/dflash.py."""

from deltaserve.spec.dflash.proposer import DFlashProposer

__all__ = ["DFlashProposer"]
