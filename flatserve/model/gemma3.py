"""Gemma 3 text: sandwich norms with (1 + w) weights, q/k norm, scaled embeddings, gelu-tanh,
and interleaved sliding-window layers whose rotary base differs from the global layers'.
Gemma 2 is the same wiring without q/k norm, with attention and final-logit soft-capping
(both from ModelConfig) and one rotary base."""
from __future__ import annotations

import torch
from torch import nn

from flatserve.model.config import ModelConfig
from flatserve.model.layers import Attention, DecoderLayers, Embedding, GatedMLP, RMSNorm, norm_then_add_norm


class Gemma3DecoderLayer(nn.Module):
    # The C++ decoder stack's norm roles (model/cpu_stack.py): in, attn_out, mlp_in, mlp_out.
    stack_norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                   "post_feedforward_layernorm")

    def __init__(self, cfg: ModelConfig, layer: int, qk_norm: bool) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, layer, qk_norm=qk_norm, norm_offset=1.0)
        self.mlp = GatedMLP(H, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(H, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(H, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(H, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(H, eps, offset=1.0)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sandwich norms; the residual sum rides in the pre-MLP and the next input norm."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h, residual = norm_then_add_norm(self.post_attention_layernorm, self.pre_feedforward_layernorm,
                                         self.self_attn(h, positions), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = DecoderLayers(Gemma3DecoderLayer(cfg, i, qk_norm) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)
        self.embed_scale = cfg.hidden_size ** 0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        e = self.embed_tokens(input_ids)  # [T, H]
        # HF rounds the scale to the weight dtype first (matters in bf16: sqrt(640) -> 25.25).
        h = e * torch.tensor(self.embed_scale, dtype=e.dtype)
        return self.norm(*self.layers(h, None, positions))[0]


class Gemma3ForCausalLM(nn.Module):
    qk_norm = True  # Gemma 2 has none

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Gemma3TextModel(cfg, self.qk_norm)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [S', V]
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    qk_norm = False
