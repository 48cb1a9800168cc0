"""flatserve: flat, paged, varlen LLM serving on PyTorch."""
from __future__ import annotations

from typing import Any

from flatserve.engine.outputs import CompletionOutput, RequestOutput
from flatserve.engine.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":  # lazy: `import flatserve` stays light (no transformers import)
        from flatserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
