"""model/cuda_stack.py: one-token CUDA decode steps with the RMSNorms, residual adds and the gated
activation inside the q4_0 GEMVs, held with the Python layers (the stack off) to an fp32 run of the
layers on the same 4-bit weights; and the families it declines. Needs CUDA (the GEMVs are CUDA
C++)."""
from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (the stack's GEMVs are CUDA C++)", allow_module_level=True)

from flatserve import LLM, SamplingParams  # noqa: E402
from flatserve.model import cuda_gemv, cuda_stack  # noqa: E402
from flatserve.model.layers import DecoderLayers  # noqa: E402
from tests.conftest import build_checkpoint  # noqa: E402

# The stack rounds differently from the layers (the norm's 1 / rms scales the GEMV's fp32 sum
# instead of rounding rmsnorm(h) to bf16 first), so both bf16 runs are held to an fp32 run of the
# layers on the same 4-bit weights, and the stack must be about as close to it as the layers are:
# its worst chosen-token logprob error within 2x theirs (+ 0.02), and where its tokens part from the
# fp32 run's, a near-tie there (a gap within 2x the layers' worst such gap, or NEAR_TIE).
NEAR_TIE = 0.25


def _fast(llm: LLM) -> object | None:
    return next(m for m in llm.engine.runner.model.modules() if isinstance(m, DecoderLayers)).fast


def _run(path, prompts: list[list[int]], dtype: str = "bfloat16") -> tuple[list, object | None]:
    """Each prompt alone (every decode step one token), greedy, top-2 logprobs a step."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    with LLM(model=str(path), dtype=dtype, quantization="q4_0", max_model_len=512,
             kv_cache_memory=2**30) as llm:
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0] for p in prompts]
        return outs, _fast(llm)


def _against(outs: list, ref: list) -> tuple[float, float]:
    """(worst |logprob - ref's| of the chosen token over the steps before the tokens part,
    the largest ref top-2 gap where they part)."""
    worst, gap = 0.0, 0.0
    for a, b in zip(outs, ref):
        k = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(b.token_ids))
        for i in range(k):
            t = b.token_ids[i]
            worst = max(worst, abs(a.logprobs[i][t].logprob - b.logprobs[i][t].logprob))
        if k < len(b.token_ids):
            top = sorted((lp.logprob for lp in b.logprobs[k].values()), reverse=True)
            gap = max(gap, top[0] - top[1])
    return worst, gap


# "llama-no-handoff": q|k|v and gate|up normalize h themselves (FLATSERVE_CUDA_STACK_HANDOFF=0)
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "llama-no-handoff"])
def test_stack_is_as_close_to_fp32_as_the_python_layers(family: str, tmp_path, monkeypatch) -> None:
    if not cuda_gemv.prepare(torch.device("cuda")):
        pytest.skip(f"the CUDA C++ GEMV did not build here: {cuda_gemv._FAILED}")
    handoff = not family.endswith("-no-handoff")
    family = family.removesuffix("-no-handoff")
    monkeypatch.setattr(cuda_stack, "HANDOFF", handoff)
    path, _ = build_checkpoint(family, tmp_path)
    rng = random.Random()
    prompts = [[rng.randrange(4, 512) for _ in range(rng.randint(1, 200))] for _ in range(6)]
    ours, fast = _run(path, prompts)
    assert isinstance(fast, cuda_stack.CudaDecoderStack) and fast.taken > 0 and bool(fast.parts) == handoff
    monkeypatch.setattr(cuda_stack, "ENABLED", False)
    layers, off = _run(path, prompts)
    assert off is None
    ref, _ = _run(path, prompts, "float32")
    (w_ours, g_ours), (w_layers, g_layers) = _against(ours, ref), _against(layers, ref)
    print(f"{family}: against fp32, worst logprob error stack {w_ours:.4f} layers {w_layers:.4f}; "
          f"largest gap where tokens part: stack {g_ours:.3f} layers {g_layers:.3f}; "
          f"stack against layers {_against(ours, layers)[0]:.4f}")
    assert w_ours <= 2 * w_layers + 0.02
    assert g_ours <= max(NEAR_TIE, 2 * g_layers)
    # and no farther from the layers than the layers are from fp32 (H200, 2026-11-29, eight
    # runs: 0.05-0.08 against 0.17-0.48; one of the hand-off off 0.36, where the layers' error was
    # over 0.5: a bound of 0.6 x theirs + 0.03, fitted to the first four, failed there)
    assert _against(ours, layers)[0] <= w_layers + 0.03


def test_stack_declines_gemma3(tmp_path) -> None:
    """(1 + w) norms and a post-norm after each block: not the stack's layer; the layers run."""
    if not cuda_gemv.prepare(torch.device("cuda")):
        pytest.skip(f"the CUDA C++ GEMV did not build here: {cuda_gemv._FAILED}")
    path, _ = build_checkpoint("gemma3", tmp_path)
    _, fast = _run(path, [[5, 6, 7]])
    assert fast is None
