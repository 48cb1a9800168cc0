"""Qwen3-MoE and GPT-OSS on CUDA (Triton attention with sinks, the fused MoE kernels, decode
steps replayed from CUDA graphs) against transformers on the CPU, fp32 (CUDA only)."""
from __future__ import annotations

import random

import pytest
import torch

from flatserve import LLM, SamplingParams
from flatserve.model.moe import MoeMLP
from tests.model.moe_ckpt import build_moe_checkpoint
from tests.model.test_parity import _assert_greedy_equal, _hf_greedy, _prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("eager", [False, True])
def test_moe_cuda_greedy_matches_transformers(family: str, eager: bool, tmp_path) -> None:
    path, hf = build_moe_checkpoint(family, tmp_path)
    llm = LLM(model=str(path), dtype="float32", attention_backend="triton", max_model_len=1024,
              max_num_batched_tokens=64, kv_cache_memory=2**28, enforce_eager=eager,
              enable_prefix_caching=False)
    assert (llm.engine.runner.graphs is None) == eager
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, MoeMLP)]
    assert blocks and all(b.path == "auto" for b in blocks)  # "auto" on CUDA: the Triton path
    prompts = _prompts(seed=random.randrange(1 << 30), max_len=300)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        _assert_greedy_equal(hf, p, o.outputs[0].token_ids, _hf_greedy(hf, p, 24))
    assert llm.engine.num_used_blocks == 0
