"""Qwen3-MoE and GPT-OSS from GGUF files (llama.cpp's `qwen3moe` / `gpt-oss` names, written with
the `gguf` package from the HF model's random weights; GPT-OSS's experts in MXFP4) and GPT-OSS
from an HF directory with MXFP4 experts (blocks + scales, dequantized at load): logits within
1e-4 of transformers (fp32, CPU) and the same greedy tokens."""
from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from flatserve import LLM, SamplingParams
from tests.model.moe_ckpt import build_moe_checkpoint, to_mxfp4, write_moe_gguf
from tests.model.test_parity import LOGIT_ATOL, _assert_greedy_equal, _hf_greedy, _prompts




def _check(llm: LLM, hf, n_tokens: int = 16) -> None:
    """Prefill logits at every position of a ragged batch, then greedy tokens."""
    from tests.model.test_moe_parity import ragged_logits

    prompts = _prompts(seed=random.randrange(1 << 30), n=6, max_len=200)
    ours, ref = ragged_logits(llm, hf, prompts)
    err = (ours - ref).abs().max().item()
    assert err < LOGIT_ATOL, f"max abs logit error {err:.2e}"
    params = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        _assert_greedy_equal(hf, p, o.outputs[0].token_ids, _hf_greedy(hf, p, n_tokens))


def _llm(path) -> LLM:
    return LLM(model=str(path), dtype="float32", device="cpu", attention_backend="torch",
               num_gpu_blocks_override=200, max_model_len=512, max_num_batched_tokens=64,
               enable_prefix_caching=False)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_gguf_matches_transformers(family: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FLATSERVE_CACHE", str(tmp_path / "cache"))  # the GGUF sidecar
    _, hf = build_moe_checkpoint(family, tmp_path, seed=3, gguf=True)
    gguf_path = write_moe_gguf(family, hf, tmp_path / f"{family}.gguf",
                               mxfp4_experts=family == "gpt_oss")
    _check(_llm(gguf_path), hf)


def test_gpt_oss_mxfp4_hf_directory(tmp_path) -> None:
    path, hf = build_moe_checkpoint("gpt_oss", tmp_path, seed=4)
    f = next(path.glob("*.safetensors"))
    sd = load_file(str(f))
    for i, layer in enumerate(hf.model.layers):
        ex = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(ex, name)  # HF [E, in, out]; MXFP4 groups run along `in`
            blocks, scales, vals = to_mxfp4(w.detach().transpose(1, 2).contiguous())
            with torch.no_grad():
                w.copy_(vals.transpose(1, 2))  # transformers holds what the blocks stand for
            key = f"model.layers.{i}.mlp.experts.{name}"
            del sd[key]
            sd[key + "_blocks"], sd[key + "_scales"] = blocks, scales
    save_file(sd, str(f), metadata={"format": "pt"})
    _check(_llm(path), hf)
