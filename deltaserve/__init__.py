"""deltaserve: an LLM inference engine for hybrid linear-attention and MLA models."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

if TYPE_CHECKING:
    from deltaserve.llm import LLM
    from deltaserve.outputs import CompletionOutput, RequestOutput
    from deltaserve.sampling_params import SamplingParams


def __getattr__(name: str):
    # Lazy: `import deltaserve` (and `deltaserve --help`) must not import torch.
    if name == "LLM":
        from deltaserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from deltaserve.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from deltaserve import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
