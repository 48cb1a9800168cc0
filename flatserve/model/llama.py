"""Llama wiring, and the families that are Llama plus flags on ModelConfig (registry.py):
Mistral (a window on every layer), Qwen2 (q/k/v biases), Phi-3 (q|k|v and gate|up already packed
in the checkpoint, partial rotary, LongRoPE), SmolLM3 (NoPE layers), Granite (embedding, residual,
attention and logit multipliers). Qwen3 is the same wiring plus q/k norm. Qwen3-MoE and GPT-OSS
are this wiring too: MoE blocks (`ModelConfig.moe`), and for GPT-OSS q/k/v/o biases, attention
sinks, YaRN rope and alternating sliding-window layers."""
from __future__ import annotations

import torch
from torch import nn

from flatserve.model.config import ModelConfig
from flatserve.model.layers import Attention, DecoderLayers, Embedding, RMSNorm
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
        self.residual_multiplier = cfg.residual_multiplier  # Granite: 0.22 on 3.x 8B; else 1

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer input, running residual) -> (this layer's MLP output, residual): the hidden
        state is their sum, added inside the next norm (one fused kernel on CUDA)."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        a = self.self_attn(h, positions)  # [T, H]
        if self.residual_multiplier != 1.0:
            a = a * self.residual_multiplier
        h, residual = self.post_attention_layernorm(a, residual)
        h = self.mlp(h)
        return (h * self.residual_multiplier if self.residual_multiplier != 1.0 else h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = DecoderLayers(LlamaDecoderLayer(cfg, i, qk_norm) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embedding_multiplier = cfg.embedding_multiplier  # Granite: 12 on 3.x; else 1

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, H]
        if self.embedding_multiplier != 1.0:
            h = h * self.embedding_multiplier
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
        logits = self.lm_head(hidden)  # [S', V]
        s = self.cfg.logits_scaling  # Granite divides (8 on 3.x 8B); a positive scale keeps the argmax
        return logits if s == 1.0 else logits / s
