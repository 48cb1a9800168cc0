"""HF `architectures` name -> model class, imported only when chosen."""
from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("flatserve.model.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("flatserve.model.qwen3", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("flatserve.model.gemma3", "Gemma3ForCausalLM"),
    # Llama wiring plus config flags (ModelConfig.moe, attention_sinks): registry entries only.
    "Qwen3MoeForCausalLM": ("flatserve.model.qwen3", "Qwen3ForCausalLM"),
    "GptOssForCausalLM": ("flatserve.model.llama", "LlamaForCausalLM"),
    "Gemma2ForCausalLM": ("flatserve.model.gemma3", "Gemma2ForCausalLM"),
    # Llama wiring; what differs is read from the config into ModelConfig's flags.
    "MistralForCausalLM": ("flatserve.model.llama", "LlamaForCausalLM"),  # window on every layer
    "Qwen2ForCausalLM": ("flatserve.model.llama", "LlamaForCausalLM"),  # q/k/v biases
    "Phi3ForCausalLM": ("flatserve.model.llama", "LlamaForCausalLM"),  # packed, partial, LongRoPE
    "SmolLM3ForCausalLM": ("flatserve.model.llama", "LlamaForCausalLM"),  # NoPE layers
    "GraniteForCausalLM": ("flatserve.model.llama", "LlamaForCausalLM"),  # multipliers
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; flatserve supports "
                         f"{', '.join(supported_architectures())}")
    module, cls = _MODELS[architecture]
    return getattr(importlib.import_module(module), cls)
