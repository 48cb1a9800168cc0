"""Llama family (Llama 2/3, with Llama 3 rope scaling); Qwen3 is the same wiring plus q/k norm.
Qwen3-MoE and GPT-OSS are this wiring too, with flags from their configs: MoE blocks
(`ModelConfig.moe`), and for GPT-OSS q/k/v/o biases, attention sinks, YaRN rope and
alternating sliding-window layers."""
from __future__ import annotations

import torch
from torch import nn

from flatserve.model.config import ModelConfig
from flatserve.model.layers import Attention, DecoderLayers, RMSNorm
from flatserve.model.moe import mlp_for


class LlamaDecoderLayer(nn.Module):
    # The C++ decoder stack's norm roles (model/cpu_stack.py): in, attn_out, mlp_in, mlp_out.
    stack_norms = ("input_layernorm", None, "post_attention_layernorm", None)

    def __init__(self, cfg: ModelConfig, layer: int, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, qk_norm)
        self.mlp = mlp_for(cfg, layer)  # GatedMLP, or the MoE block (Qwen3-MoE, GPT-OSS)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer input, running residual) -> (this layer's MLP output, residual): the hidden
        state is their sum, added inside the next norm (one fused kernel on CUDA)."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, positions), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = DecoderLayers(LlamaDecoderLayer(cfg, i, qk_norm) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, H]
        return self.norm(*self.layers(h, None, positions))[0]


class LlamaForCausalLM(nn.Module):
    qk_norm = False  # Qwen3 flips this

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, self.qk_norm)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)  # [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [S', V]
