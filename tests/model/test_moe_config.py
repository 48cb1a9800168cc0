"""ModelConfig's MoE and YaRN fields from HF configs, and our YaRN table against transformers'."""
from __future__ import annotations

import torch

from flatserve.model.config import ModelConfig
from flatserve.model.layers import Rotary, rope_attention_factor
from tests.model.moe_ckpt import moe_hf_config


def test_qwen3_moe_sparse_layers_follow_step_and_dense_list() -> None:
    hf = moe_hf_config("qwen3_moe")
    hf.num_hidden_layers, hf.decoder_sparse_step, hf.mlp_only_layers = 6, 2, [3]
    moe = ModelConfig.from_hf(hf).moe
    # (i + 1) % 2 == 0 -> layers 1, 3, 5 sparse; 3 is listed dense.
    assert moe.sparse_layers == (False, True, False, False, False, True)
    assert moe.norm_topk_prob and moe.router == "softmax_topk" and moe.swiglu_limit is None


def test_gpt_oss_flags() -> None:
    cfg = ModelConfig.from_hf(moe_hf_config("gpt_oss"))
    assert cfg.attention_sinks and cfg.attention_bias
    assert cfg.sliding_windows == (24, None, 24, None)  # sliding first, then alternating
    assert cfg.moe.router == "topk_softmax" and cfg.moe.router_bias and cfg.moe.expert_bias
    assert cfg.moe.swiglu_limit == 1.0 and cfg.moe.swiglu_alpha == 1.702


def test_yarn_table_matches_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = moe_hf_config("gpt_oss")
    cfg = ModelConfig.from_hf(hf)
    inv_ref, factor_ref = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    rot = Rotary(cfg.ropes[0], cfg.head_dim)
    assert torch.equal(rot.inv_freq, inv_ref)  # bit for bit: the same fp32 ops in order
    assert rope_attention_factor(cfg.ropes[0]) == factor_ref
    pos = torch.arange(300, dtype=torch.float32)
    emb = torch.cat([pos[:, None] * inv_ref] * 2, -1)
    t = rot.table(300)[:, :300]
    assert torch.equal(t[0], emb.cos() * factor_ref) and torch.equal(t[1], emb.sin() * factor_ref)
