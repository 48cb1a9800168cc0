"""The CPU linears' paths end to end: a whole bf16 model on each packed path (oneDNN, AMX) against
the fp32 engine, no further off than plain bf16; `auto`'s choice; refusals with the reason."""
from __future__ import annotations

import random

import pytest
import torch

from flatserve.model import amx, avx2, onednn

AVAILABLE = {"onednn": onednn.available(torch.bfloat16), "amx": amx.available(torch.bfloat16),
             "avx2": avx2.available(torch.bfloat16)}


@pytest.mark.parametrize("gemm", ["onednn", "amx", "avx2"])
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])  # untied / tied embedding
def test_packed_model_is_as_close_to_fp32_as_plain_bf16(gemm, family, tmp_path) -> None:
    if not AVAILABLE[gemm]:
        pytest.skip(f"cpu_gemm {gemm} cannot run here")
    from flatserve import LLM, SamplingParams
    from tests.conftest import build_checkpoint

    path, _ = build_checkpoint(family, tmp_path)
    rng = random.Random(20261125)  # seeded: the bound below is checked on fixed inputs
    prompts = [{"prompt_token_ids": [rng.randrange(4, 500) for _ in range(rng.randint(1, 120))]}
               for _ in range(6)]
    sp = SamplingParams(max_tokens=1, temperature=0, logprobs=5, ignore_eos=True)
    runs = {}
    for name, kw in (("fp32", dict(dtype="float32")), ("torch", dict(dtype="bfloat16", cpu_gemm="torch")),
                     (gemm, dict(dtype="bfloat16", cpu_gemm=gemm))):
        llm = LLM(device="cpu", model=str(path), max_model_len=256, **kw)
        assert llm.engine.state.cpu_gemm == (gemm if name == gemm else "torch")
        if name == "amx":  # the test configs tile: every linear is on the kernel
            linears = [m for m in llm.engine.runner.model.modules()
                       if isinstance(m, (amx.AMXLinear, onednn.OneDNNLinear, torch.nn.Linear))]
            assert linears and all(isinstance(m, amx.AMXLinear) for m in linears)
        runs[name] = [o.outputs[0].logprobs[0] for o in
                      llm.generate(prompts, sp, use_tqdm=False)]
        del llm

    def worst(name: str) -> float:  # largest logprob gap to fp32 over tokens both list
        return max(abs(a[t].logprob - b[t].logprob)
                   for a, b in zip(runs[name], runs["fp32"]) for t in set(a) & set(b))

    assert worst(gemm) <= max(2 * worst("torch"), 2e-2)


def test_auto_picks_the_first_path_that_runs(tmp_path) -> None:
    from flatserve import LLM
    from tests.conftest import build_checkpoint

    path, _ = build_checkpoint("llama", tmp_path)
    want = next((g for g in ("amx", "onednn", "avx2") if AVAILABLE[g]), "torch")
    assert LLM(device="cpu", model=str(path), dtype="bfloat16", max_model_len=64).engine.state.cpu_gemm == want
    assert LLM(device="cpu", model=str(path), dtype="float32", max_model_len=64).engine.state.cpu_gemm == "torch"


@pytest.mark.parametrize("gemm", ["onednn", "amx", "avx2"])
def test_packed_path_refused_where_it_cannot_apply(gemm, default_model_path) -> None:
    from flatserve import LLM

    with pytest.raises(ValueError, match=f"cpu_gemm '{gemm}' needs"):
        LLM(device="cpu", model=str(default_model_path), dtype="float32", cpu_gemm=gemm)
