"""Qwen3 dense: Llama wiring with per-head RMSNorm on q and k before rotary."""
from __future__ import annotations

from flatserve.model.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
