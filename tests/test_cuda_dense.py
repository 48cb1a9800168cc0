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


# A llama.cpp-style mix: three formats in the fused q/k/v linear, two in gate/up, the K formats
# where K allows (down_proj, K = 256), a quantized tied embedding / LM head.
_GGUF_MIX = {"layers.1.mlp.down_proj.weight": "q4_k", "layers.2.mlp.down_proj.weight": "q5_k",
             "down_proj.weight": "q6_k", "q_proj.weight": "q4_0", "k_proj.weight": "q5_0",
             "v_proj.weight": "q8_0", "o_proj.weight": "q4_0", "gate_proj.weight": "q5_0",
             "up_proj.weight": "q4_0", "embed_tokens.weight": "q8_0"}


def test_quantized_gguf_on_cuda_matches_its_dequantized_weights(tmp_path, monkeypatch) -> None:
    """A GGUF's blocks kept as stored on CUDA (Triton GEMVs for decode rows inside the CUDA
    graphs, dequantize + cuBLAS for prompt chunks, the embedding dequantizing its rows) gives
    the greedy tokens of the same file dequantized at load (`dequantize=True`), in fp32."""
    from transformers import AutoTokenizer

    from flatserve import LLM, SamplingParams
    from flatserve.model.quant import QuantEmbedding, QuantLinear
    from tests.model.gguf_write import write_gguf

    monkeypatch.setenv("FLATSERVE_CACHE", str(tmp_path / "cache"))
    path, hf = build_checkpoint("llama", tmp_path)
    gguf_path = write_gguf(hf, AutoTokenizer.from_pretrained(str(path)), tmp_path / "mix.gguf", _GGUF_MIX)
    rng = random.Random()
    prompts = [[rng.randrange(4, 512) for _ in range(rng.randint(1, 200))] for _ in range(8)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = []
    for dequantize in (False, True):
        llm = LLM(model=str(gguf_path), dtype="float32", device="cuda", dequantize=dequantize,
                  kv_cache_memory=2**28, max_model_len=512, max_num_batched_tokens=64,
                  enable_prefix_caching=False)
        mods = list(llm.engine.runner.model.modules())
        quantized = sum(isinstance(m, (QuantLinear, QuantEmbedding)) for m in mods)
        assert (quantized == 0) == dequantize, quantized  # 4 layers x 4 linears + embedding
        outs.append([o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)])
        del llm
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]
