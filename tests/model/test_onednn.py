"""oneDNN pre-packed bf16 linears (`cpu_gemm="onednn"`): the layer against a float64 reference,
and a whole bf16 model against the fp32 engine, no further off than the plain bf16 path."""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from flatserve.model import onednn

needs_onednn = pytest.mark.skipif(not onednn.available(torch.bfloat16),
                                  reason="no oneDNN with native bf16 on this CPU")


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 5, 300])
def test_onednn_linear_matches_float64_reference(rows) -> None:
    N, K = random.choice([(300, 64), (5000, 640), (640, 2048)])
    w = (torch.randn(N, K) * torch.rand(N, 1) * 3).bfloat16()
    bias = torch.randn(N).bfloat16()
    x = torch.randn(2, rows, K).bfloat16()  # leading dims are flattened and restored
    got = onednn.OneDNNLinear(w, bias)(x)
    assert got.shape == (2, rows, N) and got.dtype == torch.bfloat16
    if rows == 0:
        return
    ref = x.double() @ w.double().t() + bias.double()
    plain = nn.functional.linear(x, w, bias).double()
    err = ((got.double() - ref).norm() / ref.norm()).item()
    err_plain = ((plain - ref).norm() / ref.norm()).item()
    # bf16 output rounding alone is ~2e-3 relative; the packed path may not be worse than F.linear.
    assert err < 1e-2 and err <= 1.5 * err_plain + 1e-4


@needs_onednn
def test_pack_linears_counts_a_tied_head_once_more() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(1000, 64, dtype=torch.bfloat16)
            self.model.proj = nn.Linear(64, 64, dtype=torch.bfloat16)
            self.lm_head = nn.Linear(64, 1000, bias=False, dtype=torch.bfloat16)
            self.lm_head.weight = self.model.embed_tokens.weight

    m = M()
    assert onednn.pack_linears(m) == 1000 * 64 * 2
    assert isinstance(m.lm_head, onednn.OneDNNLinear) and isinstance(m.model.proj, onednn.OneDNNLinear)
    assert m.model.embed_tokens.weight.shape == (1000, 64)  # the lookup keeps its plain rows


@needs_onednn
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])  # untied / tied embedding
def test_onednn_model_is_as_close_to_fp32_as_plain_bf16(family, tmp_path) -> None:
    from flatserve import LLM, SamplingParams
    from tests.conftest import build_checkpoint

    path, _ = build_checkpoint(family, tmp_path)
    rng = random.Random()
    prompts = [{"prompt_token_ids": [rng.randrange(4, 500) for _ in range(rng.randint(1, 120))]}
               for _ in range(6)]
    sp = SamplingParams(max_tokens=1, temperature=0, logprobs=5, ignore_eos=True)
    runs = {}
    for name, kw in (("fp32", dict(dtype="float32")), ("torch", dict(dtype="bfloat16", cpu_gemm="torch")),
                     ("onednn", dict(dtype="bfloat16", cpu_gemm="onednn"))):
        llm = LLM(model=str(path), max_model_len=256, **kw)
        assert llm.engine.state.cpu_gemm == ("onednn" if name == "onednn" else "torch")
        runs[name] = [o.outputs[0].logprobs[0] for o in
                      llm.generate(prompts, sp, use_tqdm=False)]
        del llm

    def worst(name: str) -> float:  # largest logprob gap to fp32 over tokens both list
        return max(abs(a[t].logprob - b[t].logprob)
                   for a, b in zip(runs[name], runs["fp32"]) for t in set(a) & set(b))

    assert worst("onednn") <= max(2 * worst("torch"), 2e-2)


def test_onednn_refused_where_it_cannot_apply() -> None:
    from flatserve import LLM

    with pytest.raises(ValueError, match="cpu_gemm 'onednn' needs"):
        LLM(model=None, dtype="float32", cpu_gemm="onednn")
