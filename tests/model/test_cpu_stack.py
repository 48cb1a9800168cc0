"""The C++ decoder stack of CPU decode steps (flatserve/model/cpu_stack.py) against the Python
layers running the same kernels: every step it takes is checked, on the same inputs, for
bit-identical hidden states and residuals, and for the same K/V rows in the cache, on fresh
random checkpoints of each family (Gemma 3's sandwich norms and sliding windows, Qwen3's q/k
norm, Llama 3's rope scaling), plain decodes and n-gram verify runs."""
from __future__ import annotations

import random

import pytest
import torch

from flatserve import LLM, SamplingParams
from flatserve import device as dev
from flatserve.attention.metadata import current_metadata
from flatserve.model import avx2, cpu_stack, quant
from flatserve.model.layers import DecoderLayers

# The stack's GEMM: the AMX kernel, the AVX2 one, or the quantized one on block weights (one op
# signature), each where it runs. "quant": q4_0 blocks for plain decodes, q8_0 for verify runs
# (both formats, half the runs of each with each).
_NO_QUANT = pytest.mark.skipif(quant.kernel() is None, reason="the C++ quant kernel did not build here")
GEMMS = [pytest.param("amx", marks=pytest.mark.skipif(
             "amx" not in dev.cpu_isa_levels(), reason="this CPU has no AMX")),
         pytest.param("avx2", marks=pytest.mark.skipif(
             not avx2.available(torch.bfloat16), reason="no AVX2 + FMA or its kernel did not build here")),
         pytest.param("quant", marks=_NO_QUANT)]

# Families with a layer the stack has no kernel for (cpu_stack._fits): Phi-3's partial rotary and
# LongRoPE, SmolLM3's NoPE layers, Granite's residual multipliers.
DECLINED = ("phi3", "phi3-longrope", "smollm3", "granite")


def _layers(llm: LLM) -> DecoderLayers:
    found = [m for m in llm.engine.runner.model.modules() if isinstance(m, DecoderLayers)]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("ngram", [0, 3])
def test_stack_equals_python_layers(tiny_checkpoint, ngram: int, gemm: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if gemm == "amx":  # the AMX CPU must have built and been granted the kernel (scripts/setup.sh)
        monkeypatch.setenv("FLATSERVE_CPU_ISA", "amx")
        from flatserve.model import amx
        assert amx.available(torch.bfloat16), f"AMX GEMM unavailable: {amx._ext.error}"
    family, path, _ = tiny_checkpoint
    spec = dict(speculative_method="ngram", num_speculative_tokens=ngram) if ngram else {}
    how = dict(quantization="q8_0" if ngram else "q4_0") if gemm == "quant" else dict(cpu_gemm=gemm)
    llm = LLM(model=str(path), device="cpu", dtype="bfloat16", max_model_len=512,
              num_gpu_blocks_override=64, enable_prefix_caching=False, **how, **spec)
    layers = _layers(llm)
    fast = layers.fast
    if family in DECLINED:  # a layer the stack has no kernel for: the Python layers run every step
        assert fast is None, family
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        return
    assert isinstance(fast, cpu_stack.CpuDecoderStack), family
    kv = llm.engine.runner.kv
    taken = [0, 0, 0]  # steps the stack took, of them with verify runs; steps it left

    def checked(h, residual, positions):
        pool = kv.clone()
        got = fast(h.clone(), None if residual is None else residual.clone(), positions)
        if got is None:
            taken[2] += 1
            return None
        taken[0] += 1
        taken[1] += current_metadata().max_q_len > 1
        stack_kv = kv.clone()
        kv.copy_(pool)  # the Python layers write the same slots again from the same state
        layers.fast = None
        try:
            want = layers(h, residual, positions)
        finally:
            layers.fast = checked
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(stack_kv, kv)
        return got

    layers.fast = checked
    rng = random.Random()
    # Repeating prompts give the n-gram proposer drafts; lengths cross the 64-token window.
    prompts = [[rng.randrange(3, 40) for _ in range(rng.randint(1, 12))] * rng.randint(1, 12)
               for _ in range(5)]
    llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    assert taken[0] >= 8 and taken[2] >= 1 and (taken[1] >= 1) == bool(ngram), taken


@pytest.mark.usefixtures("amx_kernel")  # the amx level; skips where the CPU has none
@pytest.mark.parametrize("kw", [dict(enforce_eager=True), dict(fused_ops="rmsnorm,rope"),
                                dict(cpu_gemm="onednn"), dict(dtype="float32", cpu_gemm="auto"),
                                dict(attention_backend="torch")])
def test_stack_only_where_every_kernel_is_its_own(tiny_checkpoint, kw: dict) -> None:
    """Off on request, and wherever a layer would leave the kernels the stack calls; the
    Python layers then run every step."""
    _, path, _ = tiny_checkpoint
    llm = LLM(device="cpu", model=str(path), **{"dtype": "bfloat16", "cpu_gemm": "amx", "max_model_len": 256,
                                  "num_gpu_blocks_override": 32, **kw})
    assert _layers(llm).fast is None
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
