"""Issue #32's dense families on CUDA: the Triton backend with the fused ops and CUDA graphs,
fp32 greedy tokens against transformers' `generate` on the same GPU, chunked at 64 tokens."""
from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import DENSE_FAMILIES, build_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_dense_family_greedy_matches_transformers_on_cuda(family, tmp_path) -> None:
    from flatserve import LLM, SamplingParams
    from tests.model.test_parity import _assert_greedy_equal, _hf_greedy, _longrope_safe

    path, hf = build_checkpoint(family, tmp_path)
    hf = hf.cuda()
    llm = LLM(model=str(path), dtype="float32", device="cuda", attention_backend="triton",
              fused_ops="auto", kv_cache_memory=2**28, max_model_len=512, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    rng = random.Random()
    prompts = [[rng.randrange(4, 512) for _ in range(rng.randint(1, 300))] for _ in range(8)]
    if family == "phi3-longrope":
        prompts = [_longrope_safe(p, "chunked") for p in prompts]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref = _hf_greedy(hf, p, 24)
        _assert_greedy_equal(hf, p, o.outputs[0].token_ids, ref)
