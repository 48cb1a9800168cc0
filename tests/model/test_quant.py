"""Weight-only int8 (`quantization="int8"`): the kernels against a float64 reference of the same
quantized weights, and a whole model against the same checkpoint with its weights replaced by
their int8 round trip."""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from flatserve.model.quant import GEMV_ROWS, Int8Linear, quantize_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, GEMV_ROWS, 37])  # the int8 GEMV kernel, then dequantized slices
def test_int8_linear_matches_float64_reference(dtype, rows) -> None:
    N, K = random.choice([(300, 64), (5000, 640), (640, 2048)])
    w = torch.randn(N, K) * torch.rand(N, 1) * 3  # rows of different scales
    q, s = quantize_rows(w)
    deq = q.double() * s.double()[:, None]
    # Quantization error bound: half a step of each row's scale.
    assert ((w.double() - deq).abs() <= s.double()[:, None] / 2 + 1e-6).all()
    bias = torch.randn(N)
    lin = Int8Linear(q, s, bias.to(dtype), dtype)
    x = torch.randn(rows, K).to(dtype)
    ref = x.double() @ (q.double() * s.to(dtype).double()[:, None]).t() + bias.to(dtype).double()
    got = lin(x).double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((got - ref).norm() / ref.norm()).item() < tol


@pytest.mark.parametrize("family", ["qwen3", "llama"])  # untied / tied embedding (int8 lookup)
def test_quantized_model_matches_its_round_tripped_checkpoint(family, tmp_path) -> None:
    """fp32 logprobs of ragged prompts: the int8 engine equals the plain engine run on a checkpoint
    whose Linear weights were replaced by dequant(quant(w)): the int8 path changes nothing else."""
    from flatserve import LLM, SamplingParams
    from tests.conftest import build_checkpoint

    path, model = build_checkpoint(family, tmp_path)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                q, s = quantize_rows(m.weight)
                m.weight.copy_(q.float() * s[:, None])
    rt = tmp_path / "roundtrip"
    model.save_pretrained(rt)
    from tests.conftest import _tokenizer

    _tokenizer().save_pretrained(rt)
    rng = random.Random(20261125)  # seeded: the bound below is checked on fixed inputs
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randint(1, 120))] for _ in range(6)]
    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=5, ignore_eos=True)
    runs = []
    for p, quant in ((path, "int8"), (rt, None)):
        # 2 sequences at a time: decode steps take the int8 GEMV kernel, prefills the slices.
        llm = LLM(device="cpu", model=str(p), dtype="float32", quantization=quant, max_model_len=256,
                  max_num_seqs=2)
        runs.append(llm.generate([{"prompt_token_ids": x} for x in prompts], sp, use_tqdm=False))
        if quant:
            # Weights: int8 plus one fp32 scale per row (about a quarter of fp32's bytes).
            assert llm.engine.state.weights_bytes < 0.35 * sum(
                p.numel() * 4 for p in model.parameters())
        del llm
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in set(da) & set(db):
                assert abs(da[t].logprob - db[t].logprob) < 1e-4


def test_unknown_quantization_is_refused() -> None:
    from flatserve.config import EngineConfig

    with pytest.raises(ValueError, match="quantization must be int8"):
        EngineConfig.from_kwargs(quantization="int4")
